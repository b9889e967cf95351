"""The deployment's cache directory as the launcher prepares it (--cache-dir, default
egemma.engine.process.cache_dir()): exported to every process it starts as $EGEMMA_CACHE_DIR (the tuning file, the
fused weights in the dtype served: egemma.engine.weights), with Triton-lang's compiled kernels under it
($TRITON_CACHE_DIR = <dir>/triton).

A directory that cannot be written (read-only, full, not a directory) serves without caching, with a warning: what
is there is still read (an image's pre-warmed cache), and Triton-lang, which must write what it compiles, gets a
fresh directory in the run directory instead. Triton-lang trusts its cache's files (a truncated or overwritten
binary would be loaded as it is), so the launcher seals the kernel cache once the server is ready and when it stops
(MANIFEST: every file's size and SHA-256), and the next start checks it: a kernel entry (one directory per kernel
hash) holding a file that differs from the manifest, or an unreadable group file, is removed with a warning and
compiled again."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from egemma.engine.process import ENV, unwritable

MANIFEST = "triton-manifest.json"


def _digest(p: Path) -> list:
    return [p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()]


def _entries(kernels: Path) -> list[Path]:
    try:
        return sorted(d for d in kernels.iterdir() if d.is_dir())
    except OSError:
        return []


def corrupt_entries(kernels: Path, manifest: dict) -> dict[Path, str]:
    """{kernel entry directory: why} for the entries a start must not use."""
    bad = {}
    for d in _entries(kernels):
        for f in sorted(d.iterdir()):
            rel = str(f.relative_to(kernels))
            try:
                if f.name.startswith("__grp__"):
                    json.loads(f.read_text())
                if rel in manifest and _digest(f) != manifest[rel]:
                    bad[d] = f"{f.name} differs from the sealed copy"
            except (OSError, ValueError) as e:
                bad[d] = f"{f.name} is unreadable ({type(e).__name__})"
            if d in bad:
                break
    return bad


def prepare(d: Path, run_dir: Path, log=print) -> dict[str, str]:
    """The environment every process gets (also set in os.environ, for the processes started later): the cache
    directory checked, its corrupt kernel entries removed."""
    d = d.expanduser().resolve()
    kernels = d / "triton"
    env = {ENV: str(d), "TRITON_CACHE_DIR": str(kernels)}
    if why := unwritable(kernels):
        env["TRITON_CACHE_DIR"] = str(run_dir / "triton-cache")
        log(f"egemma: WARNING: the cache directory cannot be written ({why}): serving without caching (what it "
            f"holds is still read; Triton-lang compiles into {env['TRITON_CACHE_DIR']}, dropped at the next start)")
        shutil.rmtree(env["TRITON_CACHE_DIR"], ignore_errors=True)
    else:
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except (OSError, ValueError):
            manifest = {}
        for entry, why in corrupt_entries(kernels, manifest).items():
            log(f"egemma: WARNING: kernel cache entry {entry} is corrupt ({why}): removed, compiled again")
            shutil.rmtree(entry, ignore_errors=True)
    os.environ.update(env)
    return env


def seal(d: Path):
    """Record every file of the kernel cache (MANIFEST), for the next start's check; nothing if unwritable."""
    d = d.expanduser().resolve()
    kernels = d / "triton"
    if unwritable(d):
        return
    manifest = {}
    for entry in _entries(kernels):
        for f in entry.iterdir():
            try:
                manifest[str(f.relative_to(kernels))] = _digest(f)
            except OSError:  # removed meanwhile
                pass
    tmp = d / f".{MANIFEST}.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, d / MANIFEST)
    except OSError:  # full: the next start checks the group files only
        tmp.unlink(missing_ok=True)
