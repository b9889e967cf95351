"""The floor under the gateway's fast lane: a byte pipe in Python on uvloop, one upstream connection per client
connection, nothing parsed. perf/serving/bench_front.py times it beside the lane on the same server, so what the
lane's own work adds over a bare Python hop shows apart from the hop (perf/RESULTS.md, HTTP front).

  python -m perf.serving.proxy_floor PORT UPSTREAM_HOST:PORT      prints `listening` once it accepts connections"""
import asyncio
import sys

import uvloop


class _Pipe(asyncio.Protocol):
    """One side of a pipe: what it receives goes out of its peer's transport as it came."""

    def __init__(self, peer: "_Pipe | None" = None):
        self.peer, self.transport = peer, None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.peer.transport.write(data)

    def connection_lost(self, exc):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _Client(_Pipe):
    """The client's side: what comes before its upstream connection is open waits in early."""

    def __init__(self, host: str, port: int):
        super().__init__()
        self.host, self.port, self.early = host, port, bytearray()

    def connection_made(self, transport):
        super().connection_made(transport)
        asyncio.ensure_future(self._connect())

    def data_received(self, data):
        if self.peer is None:
            self.early += data
        else:
            self.peer.transport.write(data)

    async def _connect(self):
        _, peer = await asyncio.get_running_loop().create_connection(lambda: _Pipe(self), self.host, self.port)
        if self.early:
            peer.transport.write(bytes(self.early))
        self.peer = peer


async def main(port: int, upstream: str):
    host, up_port = upstream.rsplit(":", 1)
    server = await asyncio.get_running_loop().create_server(lambda: _Client(host, int(up_port)), "127.0.0.1", port)
    print("listening", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), sys.argv[2]))
