"""The cache directory of one deployment (`--cache-dir`, default ~/.cache/egemma), shared by every model instance,
every restart and the launcher: the tuning file (egemma.engine.tuning), Triton-lang's compiled kernels, the
weights in the dtype served. The launcher exports it as $EGEMMA_CACHE_DIR to every process it starts."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

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
