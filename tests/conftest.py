"""Shared fixtures: generated checkpoints (both tokenizer variants, a bare one), sentence-transformers
references, and a real tritonserver on the generated checkpoint."""
import os

if not os.path.exists("/dev/nvidiactl"):  # no GPU: Triton-lang kernels run in Triton's interpreter. Set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # anything imports triton, which reads it once.

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT



@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, flags in {"eos": [], "noeos": ["--omit-eos"], "bare": ["--bare"]}.items():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(d / name), *flags],
                       check=True, stdout=subprocess.DEVNULL)
        out[name] = d / name
    return out


@pytest.fixture(scope="session")
def real_checkpoint() -> Path:
    p = os.environ.get("EMBEDDINGGEMMA_PATH")
    if not p:
        pytest.skip("EMBEDDINGGEMMA_PATH not set (CI sets it with ../shared/models/fetch-embeddinggemma.sh)")
    return Path(p)




@pytest.fixture(scope="session")
def server(checkpoints, tmp_path_factory):
    from egemma.ops.tritonserver import TritonServer, free_port
    d = tmp_path_factory.mktemp("server")
    with open(d / "tritonserver.log", "w") as log, \
            TritonServer(checkpoints["eos"], http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), run_dir=d, log_file=log, ready_timeout=300,
                         params={"matryoshka_dims": "48,32,16"}) as s:
        yield s
