"""Raw HTTP/1.1 over sockets (what no client library would send), the requests that crash Triton 2.51's own HTTP,
and the real gateway process (egemma.ops.front.Front) in front of a server, for tests/test_front.py and
tests/test_protocol_fuzz.py."""
import json
import os
import socket
import struct
import time
from pathlib import Path

INFER = "/v2/models/embeddinggemma/infer"
# The gateway's two KServe paths: its fast lane takes plain requests, and hands a connection to aiohttp at the first
# request with a percent-escape in its target. Both must guard alike, so the guard tests run through each.
VIA_AIOHTTP = b"via=%61iohttp"


def via_aiohttp(data: bytes) -> bytes:
    """The same raw request with a percent-escape added to its target's query (data as is if it has no HTTP/1.x
    request line), so that the gateway serves it on its aiohttp path."""
    line, sep, rest = data.partition(b"\r\n")
    method, target, version = (line.split(b" ") + [b"", b""])[:3]
    if not sep or not version.startswith(b"HTTP/1."):
        return data
    return b" ".join([method, target + (b"&" if b"?" in target else b"?") + VIA_AIOHTTP, version]) + sep + rest


def request(port: int, method: str = "POST", path: str = INFER, body: bytes = b"", headers: dict | None = None,
            timeout: float = 30.0) -> tuple[int, dict, bytes]:
    """One request on a fresh connection; (status, lower-case headers, body), status 0 if the connection closed
    without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        h = {"Host": "x", "Content-Length": str(len(body)), **(headers or {})}
        s.sendall(f"{method} {path} HTTP/1.1\r\n".encode() + b"".join(f"{k}: {v}\r\n".encode() for k, v in h.items())
                  + b"\r\n" + body)
        return read_response(s)


def read_responses(s: socket.socket, n: int) -> list[tuple[int, dict, bytes]]:
    """The next n answers on s in order, (status, lower-case headers, body) each: pipelined answers may share a read.
    When the connection ends first: the answer being read with what came of its body, or (0, {}, what came)."""
    buf, out, closed = b"", [], False
    try:
        while len(out) < n:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                lines = buf[:end].decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
                size = end + 4 + int(headers.get("content-length", 0))
                if len(buf) >= size or closed:
                    out.append((int(lines[0].split()[1]), headers, buf[end + 4:size]))
                    buf = buf[size:]
                    continue
            if closed:
                break
            chunk = s.recv(65536)
            closed, buf = not chunk, buf + chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return out + [(0, {}, buf)] * (n - len(out))


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    return read_responses(s, 1)[0]


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Whether the other side closes s within timeout (reading and dropping anything it sends first)."""
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def text_request(**fields) -> bytes:
    """A KServe JSON infer request of one text, with fields of its input overridden."""
    return j({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": ["hello"], **fields}]})


def binary_request(blob: bytes, size: int | None = None, shape=(1, 1)) -> tuple[bytes, dict]:
    """(body, headers) of a binary-tensor-extension request of TEXT whose raw data is blob."""
    head = j({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": list(shape),
                          "parameters": {"binary_data_size": len(blob) if size is None else size}}]})
    return head + blob, {"Inference-Header-Content-Length": str(len(head))}


def bytes_element(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


DEEP = 100_000
# What kills a bare Triton 2.51 HTTP server here (SIGSEGV: stack overflow in recursive JSON walks; SIGABRT: an
# allocation of shape x element size that fails: both sizes are beyond any address space, so under any overcommit
# setting), each small: (path, body).
CRASHERS = {
    "deep_data": (INFER, text_request(data=None).replace(b"null", b"[" * DEEP + b'"x"' + b"]" * DEEP)),
    "shape_1e15_int8": (INFER, text_request(datatype="INT8", shape=[10 ** 15], data=[1])),
    "dim_2^63": (INFER, text_request(datatype="INT8", shape=[2 ** 63], data=[1])),
    "generate_deep": ("/v2/models/embeddinggemma/generate", b'{"TEXT": ' + b"[" * DEEP + b'"x"' + b"]" * DEEP + b"}"),
}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def tcp_connections(pid: int, port: int | None = None) -> int:
    """TCP sockets pid holds (listening ones included); with port, only the connections it accepted on that port
    (its own pooled connections to Triton come and go on their own)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed since the listing (e.g. a pooled connection to Triton)
            pass
    n = 0
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            fields = line.split()
            mine = f"socket:[{fields[9]}]" in inodes
            n += mine and (port is None or int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A")
    return n


def start_front(server, log: Path, *extra: str):
    """The gateway process before `server` (a TritonServer), as the launcher starts it; returns the Front."""
    from egemma.ops.front import Front
    from egemma.ops.tritonserver import free_port
    port = free_port()
    front = Front([f"--port={port}", f"--triton-http={server.http_url}", f"--triton-grpc={server.grpc_url}",
                   *extra], f"http://127.0.0.1:{port}", log=lambda msg: log.open("a").write(msg + "\n"),
                  env=server.path_env)
    front.port = port
    return front.start()
