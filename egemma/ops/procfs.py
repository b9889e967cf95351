"""What /proc says about the server's processes: children and their argv, state, start time, resident memory, CPU
time. One parser of /proc/PID/stat serves them all. And waiting for a started process to come up (wait_up), which
a stop asked for meanwhile cancels."""
from __future__ import annotations

import os
import signal
import subprocess
import time

STUB = "triton_python_backend_stub"


class Cancelled(Exception):
    """A stop was asked for while waiting for a process to come up (wait_up's cancel)."""


def stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after "(comm)" (which may hold spaces): state is [0], ppid [1], process group [2],
    utime [11], stime [12], starttime [19] (fields 3, 4, 5, 14, 15, 22 of proc(5)); None if pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _live(field: int, value: int) -> list[int]:
    """Live (not zombie) processes whose stat field [field] is value."""
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and (s := stat(int(d))) and int(s[field]) == value
            and s[0] != "Z"]


def children(pid: int) -> dict[int, list[str]]:
    """{child pid: argv} for the live (not zombie) children of pid."""
    return {p: a for p in _live(1, pid) if (a := argv(p))}


def stub_pids(server_pid: int) -> dict[int, str]:
    """{pid: model.py path} of the Python backend stubs of a tritonserver process."""
    return {p: a[1] if len(a) > 1 else "" for p, a in children(server_pid).items() if os.path.basename(a[0]) == STUB}


def group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group pgid."""
    return _live(2, pgid)


def kill_group(pgid: int, timeout: float) -> list[int]:
    """SIGKILL every process of group pgid and wait (polling, up to timeout) until none is left; the pids that
    outlived it. The caller reaps its own child, the group's leader."""
    deadline = time.monotonic() + timeout
    while left := group(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if time.monotonic() > deadline:
            return left
        time.sleep(0.05)  # the kernel tears them down; polled with a deadline
    return []


def identity(pid: int) -> tuple[int, int] | None:
    """(pid, its start time in clock ticks since boot): names one process even after its pid is reused; None if
    pid is gone or a zombie."""
    s = stat(pid)
    return None if s is None or s[0] == "Z" else (pid, int(s[19]))


def alive(ident) -> bool:
    """Whether the process identity() named is still running (not merely its pid, reused)."""
    return bool(ident) and identity(int(ident[0])) == tuple(ident)


def wait_exit(proc: subprocess.Popen, timeout: float, hurry=None) -> bool:
    """Whether proc exited within timeout; returns early, False, once the event hurry is set."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0 or hurry is not None and hurry.is_set():
            return False
        try:
            proc.wait(min(left, 0.05) if hurry is not None else left)
        except subprocess.TimeoutExpired:
            pass
    return True


def end_group(proc: subprocess.Popen, sig: int, grace: float, timeout: float, hurry=None) -> list[int]:
    """Send sig to proc's process group (proc leads it), give proc grace seconds to exit (less once the event
    hurry is set), then SIGKILL the group until none of it is left (kill_group); the pids that outlived that. proc
    is reaped when none did."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig != signal.SIGKILL:
        wait_exit(proc, grace, hurry)
    if left := kill_group(proc.pid, timeout):
        return left
    proc.wait()  # gone or a zombie: returns at once
    return []


def connections_to(port: int) -> int:
    """Established TCP connections of this host to a local port, counted from their client end."""
    n = 0
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(f).read().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for r in rows if (c := r.split())[3] == "01" and int(c[2].rsplit(":", 1)[1], 16) == port)
    return n


def stopped(pid: int) -> bool:
    """Whether pid is stopped by a signal (state T; not t, a tracer's brief pause such as py-spy's)."""
    s = stat(pid)
    return s is not None and s[0] == "T"


def gone(pid: int) -> bool:
    """Exited: reaped, or a zombie waiting for its parent."""
    s = stat(pid)
    return s is None or s[0] == "Z"


def rss_kb(pid: int) -> int:
    """Resident memory of pid in kB, -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except OSError:
        return -1


def cpu_seconds(pid: int, with_children: bool = True) -> float | None:
    """CPU time used so far by pid (all its threads) and, with_children, its live children (the stubs); None if
    pid is gone."""
    own = stat(pid)
    if own is None:
        return None
    kids = children(pid) if with_children else ()
    ticks = int(own[11]) + int(own[12]) + sum(int(s[11]) + int(s[12]) for p in kids if (s := stat(p)))
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_up(proc, up, timeout: float, name: str, command: str, give_up, poll: float = 0.1, cancel=None):
    """Return once up() is true. RuntimeError if proc (a Popen) exits first; past timeout, give_up() and then
    TimeoutError; once the event cancel is set (a SIGTERM during boot), give_up() and then Cancelled."""
    deadline = time.monotonic() + timeout
    while not up():
        if cancel is not None and cancel.is_set():
            give_up()
            raise Cancelled(f"stopped while waiting for {name} to come up")
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready; command: {command}")
        if time.monotonic() > deadline:
            give_up()
            raise TimeoutError(f"{name} was not ready within {timeout:.0f}s")
        if cancel is not None:
            cancel.wait(poll)  # startup polling, woken at once by a stop
        else:
            time.sleep(poll)  # startup polling; the condition itself is checked above
