"""The Python backend's shared memory of one tritonserver, and leaving none of it behind.

Each stub maps a region /dev/shm/<prefix><uuid> that only a graceful stop removes: a killed server, a killed stub,
the watchdog's restart (SIGKILL) or a killed launcher leave theirs, and the k8s manifests mount /dev/shm as a
memory-backed volume that outlives restarts. So every server gets a prefix of its own
(`--backend-config python,shm-region-prefix-name=PREFIX`), and once its process group is gone the regions with
that prefix are removed: never another server's. A record in the run directory (RECORD: the server's and its
owner's identities, the prefix) lets the next start in that directory clean up after an owner killed with
SIGKILL: a server left running without its owner is ended, and its regions removed once it is gone. And a guard
process beside each server (guard) does the same as soon as the server exits without its owner's stop (the server
gets SIGKILL when its owner dies: egemma.ops.tritonserver)."""
from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
from pathlib import Path

from egemma.ops.procfs import alive, identity, kill_group

SHM = Path("/dev/shm")
RECORD = "server.json"


def new_prefix() -> str:
    """A region prefix no other server uses: this process's id and random bits."""
    return f"egemma_{os.getpid()}_{secrets.token_hex(4)}_"


def prefix_arg(prefix: str) -> str:
    return f"--backend-config=python,shm-region-prefix-name={prefix}"


def regions(prefix: str) -> list[Path]:
    """The regions named with prefix (never another server's: prefixes are unique and end in '_')."""
    try:
        return sorted(p for p in SHM.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def remove(prefix: str) -> int:
    """Remove the regions with prefix; how many were removed. Call once no process of their server is left."""
    n = 0
    for p in regions(prefix):
        try:
            p.unlink()
            n += 1
        except FileNotFoundError:  # removed meanwhile (a stub's own finalize)
            pass
    return n


def guard(server_pid: int, prefix: str) -> subprocess.Popen:
    """A process beside the server (`python -m egemma.ops.shm PID PREFIX`) that, once the server exits for any
    reason (a stop, a kill, the parent-death signal when its owner died without stopping it), ends what is left
    of its process group (its stubs) and removes its regions, then exits. The owner reaps it after its own stop."""
    return subprocess.Popen([sys.executable, "-m", "egemma.ops.shm", str(server_pid), prefix], stdin=subprocess.DEVNULL)


def reap_guard(guard: subprocess.Popen, timeout: float):
    """Wait for a guard whose server is gone (it finds nothing left to do), SIGKILL it after timeout."""
    try:
        guard.wait(timeout)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def _guard_main(server_pid: int, prefix: str):
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a Ctrl-C or a stop of the owner's group: clean up
        signal.signal(sig, signal.SIG_IGN)                       # all the same, once the server is gone
    try:
        fd = os.pidfd_open(server_pid)
    except ProcessLookupError:
        pass
    else:
        select.select([fd], [], [])  # readable once the server has exited
    if not kill_group(server_pid, 30.0):  # the group's id is the server's pid (its own session)
        remove(prefix)


def record(run_dir: Path, server_pid: int, prefix: str):
    """Note in run_dir which server this process started, with which prefix (reap reads it)."""
    tmp = run_dir / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps({"server": identity(server_pid), "owner": identity(os.getpid()), "prefix": prefix}))
    os.replace(tmp, run_dir / RECORD)


def reap(run_dir: Path, log=print) -> str | None:
    """Clean up after the last server started in run_dir if its owner is gone: end that server's process group
    if it still runs (SIGKILL: nobody stops it any more, and it holds the ports), remove its regions. A server
    whose owner still runs is left alone. What was done, or None."""
    try:
        r = json.loads((run_dir / RECORD).read_text())
        prefix, server, owner = r["prefix"], r["server"], r["owner"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if alive(owner):  # its owner (this process too) stops it and removes its regions itself
        return None
    done = []
    if alive(server):
        pgid = int(server[0])
        left = kill_group(pgid, 30.0)
        done.append(f"ended tritonserver {pgid}, left running by its dead owner {owner[0]}"
                    + (f" (pids {left} outlived SIGKILL)" if left else ""))
        if left:
            log(f"egemma: {done[-1]}; its shared memory stays")
            return done[-1]
    if n := remove(prefix):
        done.append(f"removed {n} shared-memory region(s) {prefix}*")
    (run_dir / RECORD).unlink(missing_ok=True)
    if done:
        log(f"egemma: {'; '.join(done)} (owner gone)")
    return "; ".join(done) or None


if __name__ == "__main__":
    _guard_main(int(sys.argv[1]), sys.argv[2])
