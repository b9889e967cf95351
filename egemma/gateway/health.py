"""The watchdog's verdict on whether the server serves, as a small JSON file: the launcher's watchdog writes it
after every check, the gateway's health routes answer with it (Triton's own /v2/health/live stays 200 after a
model process died, so it cannot be the liveness probe)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


def write(path: str | Path, ok: bool, why: str | None = None, restarts: int = 0):
    """Atomically: a reader never sees half a file. restarts: the watchdog's so far (a metric)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"ok": ok, "why": why, "time": time.time(), "restarts": restarts}, f)
    os.replace(tmp, path)


def restarts(path: str | Path) -> int:
    """The watchdog's restarts the verdict file counts (0 while there is none)."""
    try:
        return int(json.loads(Path(path).read_text()).get("restarts", 0))
    except (OSError, ValueError):
        return 0


def read(path: str | Path, max_age: float) -> tuple[bool, str]:
    """(serving, why): False when the verdict is bad, missing, or older than max_age seconds (a watchdog that
    stopped checking vouches for nothing)."""
    try:
        v = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False, "no watchdog verdict yet"
    age = time.time() - float(v.get("time", 0))
    if age > max_age:
        return False, f"watchdog verdict is {age:.0f}s old"
    return bool(v.get("ok")), v.get("why") or "serving"
