"""The container image, as far as this machine (no Docker, no nvcr.io) can check it: its install step
(scripts/setup.sh --system, what deploy/Dockerfile runs) into a fresh interpreter; its build-time check, which must
pass where the GPU modules are installed but cannot be imported (no driver while building); the user, paths and
entrypoint that let it run as uid 10001 on a read-only root; and the hub refusing the gated model being a clear
error, never the random demo checkpoint."""
import http.server
import os
import re
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from helpers import ROOT
from manifests import DEPLOY, entrypoint, option

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()
RUNS = [r.replace("\\\n", "") for r in re.findall(r"^RUN ((?:.*\\\n)*.*)$", DOCKERFILE, re.M)]  # continued lines


def test_setup_system_mode_installs_into_an_existing_interpreter(tmp_path):
    """deploy/Dockerfile's RUN step, `PYTHON=python3 scripts/setup.sh --system`, into a fresh interpreter that is
    not setup.sh's venv (it stands for the image's python3; its packages are those of this test environment,
    so nothing is downloaded but the build backend): the project then imports there, from this checkout."""
    assert any(re.match(r"PYTHON=python3 .*EGEMMA_EXTRAS=client,gpu scripts/setup\.sh --system", r) for r in RUNS)
    target = tmp_path / "image-python"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(target)], check=True, timeout=120)
    py = target / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = [py, "-c", "import egemma.ops.launcher, sys; print(egemma.ops.launcher.__file__, sys.prefix)"]
    assert subprocess.run(probe, cwd=tmp_path, capture_output=True).returncode != 0  # not there before
    env = {**os.environ, "PYTHON": str(py)}
    run = subprocess.run([ROOT / "scripts" / "setup.sh", "--system"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"[setup] installing packages into {target}" in run.stdout and "[setup] done" in run.stdout
    assert "kubectl" not in run.stdout + run.stderr  # the image gets no test tools
    where, prefix = subprocess.run(probe, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert Path(where) == ROOT / "egemma" / "ops" / "launcher.py" and Path(prefix) == target
    assert not (ROOT / ".venv").samefile(target)
    bad = subprocess.run([ROOT / "scripts" / "setup.sh"], env={**env, "EGEMMA_SETUP": "nope"}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown mode" in bad.stderr


def _build_check() -> str:
    """The Python of the RUN step's `python3 -c "..."` check."""
    (code,) = [m[1] for r in RUNS if (m := re.search(r'python3 -c "([^"]*)"', r)) and "setup.sh" in r]
    return code


def test_the_build_time_check_passes_without_a_gpu_driver(tmp_path):
    """During `docker build` there is no driver: `import sgl_kernel` fails for want of libcuda.so.1. The check
    finds the GPU modules without importing them (here: stand-ins that fail on import as sgl_kernel does there),
    and still fails when one is missing."""
    for name in ("sgl_kernel", "flash_attn_interface"):
        (tmp_path / f"{name}.py").write_text('raise ImportError("libcuda.so.1: cannot open shared object file")\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    ok = subprocess.run([sys.executable, "-c", _build_check()], env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "flash_attn_interface.py").unlink()
    missing = subprocess.run([sys.executable, "-c", _build_check()], env=env, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode != 0 and "flash_attn_interface" in missing.stderr


def test_the_image_runs_as_its_user_whatever_cmd_says():
    """tini is PID 1 (it reaps what the launcher's restarts leave and forwards SIGTERM); the run directory is in the
    ENTRYPOINT, on /tmp, so that a replaced CMD (deploy/README.md's `docker run ... IMAGE --model ...`) still
    writes only where uid 10001 may; HF_HOME is that user's; the README's example serves on every address."""
    entry = entrypoint()
    assert entry[:2] == ["tini", "--"] and entry[2:5] == ["python3", "-m", "egemma.ops.launcher"]
    assert option(entry, "--run-dir").startswith("/tmp/")
    assert any("--no-install-recommends" in r and re.search(r"\bgcc\b.*\btini\b", r) for r in RUNS)
    assert "USER 10001:10001" in DOCKERFILE and "HF_HOME=/var/cache/huggingface" in DOCKERFILE
    assert any("install -d -o 10001 -g 10001 /var/cache/huggingface" in r for r in RUNS)
    readme = (DEPLOY / "README.md").read_text()
    (example,) = re.findall(r"^docker run ((?:.*\\\n)*.*)$", readme, re.M)
    args = example.replace("\\\n", " ").split()
    image = next(i for i, a in enumerate(args) if a.startswith("REGISTRY/"))
    docker, cmd = args[:image], args[image + 1:]
    assert "--shm-size=2g" in docker  # the Python backend's tensors travel through /dev/shm (Docker's: 64 MB)
    assert option(cmd, "--host") == "0.0.0.0" and "--run-dir" not in cmd


# ---------------------------------------------------------------------------------------------- the gated hub

class Refusing(http.server.BaseHTTPRequestHandler):
    """The hub as a gated model answers without access."""
    status, gated = 401, True

    def do_GET(self):
        self.send_response(self.status)
        if self.gated:
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", "Access to model google/embeddinggemma-300m is restricted.")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "restricted"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "EMBEDDINGGEMMA"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{srv.server_address[1]}", HF_HOME=str(tmp_path / "hf"))
    yield env
    srv.shutdown()


@pytest.mark.parametrize("status, gated, args, extra", [
    (401, True, ["--model", "google/embeddinggemma-300m"], {}),
    (403, False, [], {"HF_TOKEN": "hf_not_a_real_token"}),
])
def test_a_hub_refusal_is_a_clear_error_never_the_demo(hub, tmp_path, monkeypatch, status, gated, args, extra):
    monkeypatch.setattr(Refusing, "status", status)
    monkeypatch.setattr(Refusing, "gated", gated)
    run = subprocess.run([sys.executable, "-m", "egemma.ops.launcher", *args, "--run-dir", str(tmp_path / "run"),
                          "--http-port", "1", "--grpc-port", "2", "--metrics-port", "3"],
                         env={**hub, **extra}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    err = run.stderr
    assert f"HTTP {status}" in err and "gated" in err and "HF_TOKEN" in err and "Not falling back" in err, err
    assert ("the token given was refused" in err) == bool(extra), err
    assert "DEMO" not in err and "starting tritonserver" not in run.stdout


def test_without_a_model_asked_for_the_demo_checkpoint_serves(hub, tmp_path):
    code = "from egemma.ops.repository import resolve_checkpoint; print(resolve_checkpoint(None))"
    run = subprocess.run([sys.executable, "-c", code], env=hub, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "DEMO checkpoint with RANDOM weights" in run.stderr and run.stdout.strip().endswith("demo-checkpoint")
