"""What the OS says about the server's processes, through psutil: children and their argv, state, start time,
resident memory, CPU time, connections to a port. And waiting for a process to exit (wait_exit, end_group) or to
come up (wait_up), which a stop asked for meanwhile cancels."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil

STUB = "triton_python_backend_stub"


class Cancelled(Exception):
    """A stop was asked for while waiting for a process to come up (wait_up's cancel)."""


def _status(pid: int) -> str | None:
    """pid's psutil status (psutil.STATUS_*), None if it is gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def argv(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def children(pid: int) -> dict[int, list[str]]:
    """{child pid: argv} for the live (not zombie) children of pid."""
    try:
        kids = psutil.Process(pid).children()
    except psutil.Error:
        return {}
    return {k.pid: a for k in kids if _status(k.pid) not in (None, psutil.STATUS_ZOMBIE) and (a := argv(k.pid))}


def stub_pids(server_pid: int) -> dict[int, str]:
    """{pid: model.py path} of the Python backend stubs of a tritonserver process."""
    return {p: a[1] if len(a) > 1 else "" for p, a in children(server_pid).items() if os.path.basename(a[0]) == STUB}


def group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group pgid (psutil has no process groups: os.getpgid names each's)."""
    out = []
    for p in psutil.pids():
        try:
            if os.getpgid(p) == pgid and _status(p) not in (None, psutil.STATUS_ZOMBIE):
                out.append(p)
        except OSError:  # gone meanwhile
            pass
    return out


def kill_group(pgid: int, timeout: float) -> list[int]:
    """SIGKILL every process of group pgid and wait (polling, up to timeout) until none is left; the pids that
    outlived it. The caller reaps its own child, the group's leader (psutil.wait_procs would reap it here)."""
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


def identity(pid: int) -> tuple[int, float] | None:
    """(pid, its start time): names one process even after its pid is reused; None if pid is gone or a zombie."""
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else (pid, p.create_time())
    except psutil.Error:
        return None


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
    return sum(1 for c in psutil.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED and c.raddr
               and c.raddr.port == port)


def stopped(pid: int) -> bool:
    """Whether pid is stopped by a signal (not a tracer's brief pause such as py-spy's, psutil's tracing-stop)."""
    return _status(pid) == psutil.STATUS_STOPPED


def gone(pid: int) -> bool:
    """Exited: reaped, or a zombie waiting for its parent."""
    return _status(pid) in (None, psutil.STATUS_ZOMBIE)


def rss_kb(pid: int) -> int:
    """Resident memory of pid in kB, -1 if it is gone."""
    try:
        return psutil.Process(pid).memory_info().rss // 1024
    except psutil.Error:
        return -1


def cpu_seconds(pid: int, with_children: bool = True) -> float | None:
    """CPU time used so far by pid (all its threads) and, with_children, its live children (the stubs); None if
    pid is gone."""
    def used(p: int) -> float:
        t = psutil.Process(p).cpu_times()
        return t.user + t.system
    try:
        total = used(pid)
    except psutil.Error:
        return None
    for p in children(pid) if with_children else ():
        try:
            total += used(p)
        except psutil.Error:  # exited meanwhile
            pass
    return total


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
