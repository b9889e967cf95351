"""What a process of this deployment knows about its place on the host, read by every process of it (a model
instance's stub, the launcher, the tools): the CPU cores it may use, the deployment's cache directory, and a model
instance's boot timeline in the server's log. Each is read from the process's surroundings (affinity and cgroup,
environment, clock) and none of them knows the model: one module, below everything that sizes, caches or boots.

**Cores.** usable_cores(): the cores this process may use, as a Kubernetes pod sees them; the tokenizer's thread
pool and the instance counts (egemma.ops.host) are sized by it.

**Cache directory.** One per deployment (`--cache-dir`, default ~/.cache/egemma), shared by every model instance,
every restart and the launcher: the tuning file (egemma.engine.tuning), Triton-lang's compiled kernels, the compiled
bpe.c, the weights in the dtype served. The launcher exports it as $EGEMMA_CACHE_DIR (ENV) to every process it starts.

**Boot timeline.** One log line per phase of a model instance's boot, all with PREFIX, that perf/serving/boot.py
reads back from the server's log. A phase line says when the phase ended (wall clock, comparable across the host's
processes) and how long it took:

  egemma boot: pid=123 instance=embeddinggemma_encoder_0_0 phase=weights end=1733331091.512 seconds=4.210 source=cache

Phases, in order: `import` (from the stub process's start to its model's initialize: the interpreter, torch,
the adapter), `tokenizer` or `weights` (read, fused, on the device; `source`: checkpoint, checkpoint-cached or
cache), `kernels` (Triton-lang JIT and the timed kernel choices at load), `capture` (CUDA graphs), `ready` (the end
of initialize).
begin() names the instance; a phase logged before it (the weights, read inside the engine) carries the pid only."""
from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

# --- cores -----------------------------------------------------------------------------------------------------------


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity, capped by a cgroup v2 (cpu.max) or v1 CPU quota."""
    cores = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            fields = Path(quota_file).read_text().split()
            quota, period = fields[0], (fields[1] if period_file is None else Path(period_file).read_text().strip())
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1"):
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
        break
    return cores


# --- cache directory -------------------------------------------------------------------------------------------------

ENV = "EGEMMA_CACHE_DIR"


def configured() -> Path | None:
    """$EGEMMA_CACHE_DIR (the launcher exports it), or None: a process started without it caches nothing."""
    d = os.environ.get(ENV)
    return Path(d).expanduser() if d else None


def cache_dir() -> Path:
    """$EGEMMA_CACHE_DIR, else $XDG_CACHE_HOME/egemma, else ~/.cache/egemma."""
    return configured() or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "egemma"


def unwritable(d: Path) -> str | None:
    """Why files cannot be written under d (made if missing), or None: read-only, full, not a directory."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".probe-") as f:
            f.write(b"\0" * 65536)  # an empty file fits a full disk: a block or sixteen do not
            f.flush()
    except OSError as e:
        return f"{d}: {e.strerror or e}"
    return None


# --- boot timeline ---------------------------------------------------------------------------------------------------

PREFIX = "egemma boot:"
log = logging.getLogger("egemma")
_instance = "-"
_last: float | None = None


def process_start() -> float:
    """This process's start, as a Unix time."""
    return psutil.Process().create_time()


def begin(instance: str):
    """Name this process's instance and log the `import` phase: everything until now. From here `kill -USR1` on the
    process prints every thread's stack to the server's log: a boot or a request that hangs shows where."""
    global _instance
    _instance = instance
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    phase("import", since=process_start())


def phase(name: str, since: float | None = None, end: float | None = None, **info):
    """Log a phase that ended at `end` (default now) and began at `since` (default: where the last one ended)."""
    global _last
    end = time.time() if end is None else end
    start = since if since is not None else (_last if _last is not None else process_start())
    extra = "".join(f" {k}={v}" for k, v in info.items())
    log.info("%s pid=%d instance=%s phase=%s end=%.3f seconds=%.3f%s", PREFIX, os.getpid(), _instance, name, end,
             end - start, extra)
    _last = end
