"""Serving an aiohttp app the way the gateway runs: on sockets bound once and shared by forked worker processes,
at most max_connections open per worker (a 503 past it), header and idle limits, SIGUSR1 announcing a stop,
SIGTERM draining each worker, a worker's death stopping all (the launcher restarts the group), and uvloop where
installed."""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket

from aiohttp import web

from egemma.gateway import metrics
from egemma.gateway.errors import GatewayError, Kind, Protocol, raw

# Refused before a request is read, so before its protocol is known: KServe's shape, {"error": ...}, which TEI's
# and most clients' error readers take too.
_BUSY = raw(GatewayError(Kind.OVERLOADED, "too many connections to this server; retry later"), Protocol.KSERVE,
            close=True)


SHUTDOWN_TIMEOUT = 10.0  # s for in-flight requests to finish on SIGTERM


class _Refuse(asyncio.Protocol):
    """A connection over max_connections: a 503 and closed, without a request handler."""

    def connection_made(self, transport):
        metrics.METRICS.refused(Kind.OVERLOADED)
        transport.write(_BUSY)
        transport.close()


async def serve(app: web.Application, socks: list[socket.socket], max_connections=1024, idle_timeout=60.0,
                workers=(), lanes=None, drain=None):
    """Serve app on listening sockets until SIGTERM / SIGINT, then drain (in-flight requests finish).
    workers: pids of sibling processes this one started; when one dies, all stop (the launcher restarts them).
    lanes: an egemma.gateway.fastlane.Lanes that takes every connection first (handing it to app when it must).
    drain: called on SIGUSR1 (the server behind is about to stop)."""
    loop = asyncio.get_running_loop()
    stop, failed = asyncio.Event(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if drain is not None:
        loop.add_signal_handler(signal.SIGUSR1, drain)
    def exited(pid: int, fd: int):
        loop.remove_reader(fd)
        os.close(fd)
        try:
            status = os.waitpid(pid, os.WNOHANG)[1]
        except ChildProcessError:  # reaped already
            status = 0
        if not stop.is_set():
            failed.append(f"gateway worker {pid} died ({os.waitstatus_to_exitcode(status)})")
            stop.set()
    for pid in workers:  # a worker's exit wakes this loop through a pidfd (uvloop keeps SIGCHLD to itself)
        fd = os.pidfd_open(pid)
        loop.add_reader(fd, exited, pid, fd)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=idle_timeout, shutdown_timeout=SHUTDOWN_TIMEOUT,
                           max_line_size=8190, max_field_size=8190, max_headers=128)
    await runner.setup()
    handlers = runner.server
    first = handlers
    if lanes is not None:
        lanes.handlers, first = handlers, lanes.protocol

    def connection():
        n = len(handlers.connections) + (len(lanes.open) if lanes is not None else 0)
        return first() if n < max_connections else _Refuse()
    servers = [await loop.create_server(connection, sock=s, backlog=1024) for s in socks]
    await stop.wait()
    for s in servers:
        s.close()
    for pid in workers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    await asyncio.gather(runner.cleanup(), *([lanes.drain(SHUTDOWN_TIMEOUT)] if lanes is not None else []))
    if failed:
        raise SystemExit("; ".join(failed))


def listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(addr)
    s.listen(1024)
    s.setblocking(False)
    return s


_LIBC = ctypes.CDLL(None, use_errno=True)  # resolved before any fork: exit_with_parent also runs as a preexec_fn


def exit_with_parent(parent: int, sig: int = signal.SIGTERM):
    """sig to this process when its parent dies (Linux prctl PR_SET_PDEATHSIG). Also a Popen preexec_fn (the
    tritonserver's); then the signal comes when the thread that started the process ends: start it from a thread
    that outlives it."""
    _LIBC.prctl(1, sig)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        raise SystemExit(f"parent {parent} is gone")


def event_loop_runner():
    """uvloop where installed (a server dependency; ~15% less CPU per proxied request), else asyncio's loop; the
    start line says which."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run, "asyncio's event loop (uvloop not installed)"
    return uvloop.run, f"uvloop {uvloop.__version__}"
