"""What a Triton model instance knows of itself: the device Triton placed it on, and its execute heartbeat.

Heartbeat: each instance stamps the start and the end of every execute (time.monotonic(), the same clock in
every process of the host), and the tokens it embeds, into a 32-byte file of its own,
$EGEMMA_HEARTBEAT_DIR/<instance name>.hb, that the watchdog (egemma.ops.watchdog) reads: an instance in one
execute for long while its process uses no CPU is hung, and one busy in one execute for far longer than its batch
takes is spinning, even when the other instances answer the canary. A stamp is one 8-byte store into a shared
mmap, no system call (the execute path is hot). Without the variable (tritonserver started
by hand) the stamps go to an anonymous map: the same code, watched by nobody."""
from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

HEARTBEAT_DIR = "EGEMMA_HEARTBEAT_DIR"
LAYOUT = struct.Struct("<ddqq")  # execute started, execute ended (0.0: never), pid, tokens of the execute (0: unsaid)
_STAMP, _COUNT = struct.Struct("<d"), struct.Struct("<q")
_TOKENS = 24  # offset of the tokens field


def instance_device(args: dict, requested: str) -> str:
    """The device an encoder instance runs on. KIND_GPU: the GPU Triton assigned (model_instance_device_id), made
    the process's current CUDA device so that every kernel, stream and CUDA graph lands there. KIND_CPU: the CPU.
    A `device` parameter naming another device than the kind's is an error. Otherwise (KIND_MODEL): `requested`
    (the engine resolves "auto" to the current CUDA device, cuda:N, or the CPU without a GPU). KIND_GPU without
    that CUDA device is an error, never a silent CPU run: Triton itself refuses KIND_GPU without GPUs, so this
    means the stub sees other GPUs than the server (e.g. a different CUDA_VISIBLE_DEVICES)."""
    kind, name = args.get("model_instance_kind"), args.get("model_instance_name", "?")
    if kind == "CPU":
        if requested not in ("auto", "cpu"):
            raise ValueError(f"instance {name}: the device parameter {requested!r} contradicts Triton's placement "
                             "on the CPU (KIND_CPU); leave it 'auto'")
        return "cpu"
    if kind != "GPU":
        return requested
    import torch
    idx = int(args["model_instance_device_id"])
    if requested not in ("auto", f"cuda:{idx}"):
        raise ValueError(f"instance {name}: the device parameter {requested!r} contradicts Triton's placement on "
                         f"GPU {idx} (KIND_GPU); leave it 'auto'")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if idx >= n:
        raise RuntimeError(f"instance {name}: Triton placed it on GPU {idx} (KIND_GPU), but this process sees "
                           f"{n} CUDA device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                           "on a host without GPUs render the model KIND_MODEL (the launcher does)")
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def heartbeat_dir() -> str | None:
    """$EGEMMA_HEARTBEAT_DIR, where TritonServer has the instances stamp their heartbeats and stats; None for a
    tritonserver started by hand."""
    return os.environ.get(HEARTBEAT_DIR) or None


class Heartbeat:
    """`with self.beat:` around execute (begin, end); `self.beat.tokens(n)` once the execute knows how many tokens
    it embeds, so that the watchdog allows a large batch proportionally longer."""

    def __init__(self, name: str, directory: str | None = None):
        directory = heartbeat_dir() if directory is None else directory
        if directory:
            fd = os.open(Path(directory) / f"{name}.hb", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, LAYOUT.size)
                self._mm = mmap.mmap(fd, LAYOUT.size)
            finally:
                os.close(fd)
        else:
            self._mm = mmap.mmap(-1, LAYOUT.size)
        LAYOUT.pack_into(self._mm, 0, 0.0, 0.0, os.getpid(), 0)

    def begin(self):
        self.tokens(0)  # first: the new start is never read with the last execute's size
        _STAMP.pack_into(self._mm, 0, time.monotonic())

    def tokens(self, n: int):
        _COUNT.pack_into(self._mm, _TOKENS, n)

    def end(self):
        _STAMP.pack_into(self._mm, 8, time.monotonic())

    def __enter__(self) -> "Heartbeat":
        self.begin()
        return self

    def __exit__(self, *exc):
        self.end()  # returns None: an exception in execute propagates


def read_heartbeats(directory: str | Path) -> dict[str, tuple[float, float, int, int]]:
    """{instance name: (execute started, execute ended, pid, tokens)} of every heartbeat file in directory."""
    out = {}
    try:
        paths = list(Path(directory).glob("*.hb"))
    except OSError:
        return out
    for p in paths:
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if len(raw) == LAYOUT.size:
            out[p.name[:-3]] = LAYOUT.unpack(raw)
    return out
