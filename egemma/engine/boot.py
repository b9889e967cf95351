"""A model instance's boot timeline: one log line per phase, all with PREFIX, that perf/serving/boot.py reads back from
the server's log. A phase line says when the phase ended (wall clock, comparable across the host's processes) and
how long it took:

  egemma boot: pid=123 instance=embeddinggemma_encoder_0_0 phase=weights end=1733331091.512 seconds=4.210 source=cache

Phases, in order: `import` (from the stub process's start to its model's initialize: the interpreter, torch,
the adapter), `tokenizer` or `weights` (read, fused, on the device; `source`: checkpoint, checkpoint-cached or
cache), `kernels` (Triton-lang JIT and the timed kernel choices at load), `capture` (CUDA graphs), `ready` (the end
of initialize).
begin() names the instance; a phase logged before it (the weights, read inside the engine) carries the pid only."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time

import psutil

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
