"""Shared fixtures: generated checkpoints (both tokenizer variants, a bare one), the real checkpoint when given,
real tritonservers (`server` shared by the session, `start_server` for a test's own), and the check that the
shared server still serves after a test."""
import os

if not os.path.exists("/dev/nvidiactl"):  # no GPU: Triton-lang kernels run in Triton's interpreter. Set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # anything imports triton, which reads it once.

import contextlib
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from helpers import GOOD, ROOT, assert_close, reference, text_input


class Servers:
    """Starts real tritonservers, each with its own run directory and log file under root, on free ports unless
    given; `with Servers(...) as start:` stops every one still running at the end."""

    def __init__(self, root: Path, checkpoint: Path):
        self.root, self.checkpoint, self.n = root, checkpoint, itertools.count()
        self.stack = contextlib.ExitStack()

    def __call__(self, checkpoint: Path | None = None, **kw):
        """A started egemma.ops.tritonserver.TritonServer; kw as ServerConfig's (instances, params, repository,
        exit_timeout_secs, ports, ...). Callable from another thread (a Watchdog's restarts)."""
        from egemma.ops.tritonserver import ServerConfig, TritonServer, free_port
        d = self.root / f"server{next(self.n)}"
        d.mkdir(parents=True)
        log = self.stack.enter_context(open(d / "tritonserver.log", "w"))
        for port in ("http_port", "grpc_port", "metrics_port"):
            if port not in kw:
                kw[port] = free_port()
        kw.setdefault("ready_timeout", 300)
        try:
            s = TritonServer(ServerConfig(checkpoint or self.checkpoint, run_dir=d, **kw), log_file=log)
        except Exception as e:  # say why: the end of the server's own log
            log.flush()
            tail = "".join((d / "tritonserver.log").read_text(errors="replace").splitlines(True)[-30:])
            raise RuntimeError(f"{e}\n--- {d / 'tritonserver.log'} (last lines) ---\n{tail}") from e
        return self.stack.enter_context(s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, flags in {"eos": ["--small"], "noeos": ["--small", "--omit-eos"], "bare": ["--small", "--bare"]}.items():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(d / name), *flags],
                       check=True, stdout=subprocess.DEVNULL)
        out[name] = d / name
    return out


@pytest.fixture(scope="session")
def real_checkpoint() -> Path:
    p = os.environ.get("EMBEDDINGGEMMA_PATH")
    if not p:
        pytest.skip("EMBEDDINGGEMMA_PATH not set: get the real checkpoint with `huggingface-cli download "
                    "google/embeddinggemma-300m --local-dir DIR` (gated: accept its license, then log in or set "
                    "HF_TOKEN), then EMBEDDINGGEMMA_PATH=DIR")
    return Path(p)


@pytest.fixture(scope="session")
def server(checkpoints, tmp_path_factory):
    """The tritonserver most tests share, on the small generated checkpoint (its Matryoshka dims 48/32/16)."""
    with Servers(tmp_path_factory.mktemp("server"), checkpoints["eos"]) as start:
        yield start(params={"matryoshka_dims": "48,32,16"})


@pytest.fixture
def start_server(checkpoints, tmp_path):
    """start_server(**kw): a test's own tritonserver (default: the generated "eos" checkpoint), stopped at the
    test's end with every other one it started."""
    with Servers(tmp_path / "servers", checkpoints["eos"]) as start:
        yield start


@pytest.fixture(scope="module")
def real_server(real_checkpoint, tmp_path_factory):
    with Servers(tmp_path_factory.mktemp("real"), real_checkpoint) as start:
        yield start(ready_timeout=600)


@pytest.fixture(scope="session")
def good_ref(checkpoints):
    return reference(checkpoints["eos"], GOOD)


@pytest.fixture
def still_serving(server, good_ref):
    """For tests of the shared server (pytestmark = pytest.mark.usefixtures("still_serving")): whatever the test
    sent, the server is afterwards alive, ready and exact."""
    yield
    assert server.proc.poll() is None, "tritonserver died"
    c = grpcclient.InferenceServerClient(server.grpc_url)
    assert c.is_server_live() and c.is_server_ready()
    got = c.infer("embeddinggemma", [text_input(GOOD[:4])], client_timeout=60).as_numpy("EMBEDDING")
    assert_close(got, good_ref[:4])


@pytest.fixture(scope="session")
def api_gateway(server, tmp_path_factory):
    """The real gateway process (python -m egemma.gateway.app, 2 workers) in front of the shared server, as
    the OpenAI and TEI tests drive it: one alias, a 1 MiB body limit (so that 413 is cheap to reach)."""
    from rawhttp import start_front
    max_body, aliases = 1 << 20, ("embeddinggemma",)
    f = start_front(server, tmp_path_factory.mktemp("gateway") / "gateway.log", "--workers=2",
                    f"--triton-metrics={server.host}:{server.metrics_port}", f"--max-request-bytes={max_body}",
                    *(f"--alias={a}" for a in aliases))
    f.aliases, f.max_body = aliases, max_body
    yield f
    f.stop()
