"""A TCP delay proxy: the latency half of `bench wan`'s emulated WAN (this kernel has no netem).

    python -m node.bench.wan_proxy --delay-ms 100 --jitter-ms 20 20000:21000 20001:21001 ...

Each LISTEN:TARGET pair accepts on 127.0.0.1:LISTEN and forwards to 127.0.0.1:TARGET (one
node's p2pd). A node announces its proxy's port, so every connection another node opens to
it crosses exactly one proxy. Each chunk read from either side is held gauss(delay, jitter)
ms (never less than 0) before it is written on, and never overtakes the chunk before it, so
a stream stays in order, as TCP's would. A new connection first waits two delays (the SYN
and SYN-ACK a real handshake costs) before the proxy dials the target.

Prints one line `ready` once every port listens; on SIGTERM/SIGINT prints one JSON line of
what it carried ({"connections", "bytes", "chunks"}) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import time

__all__ = ["DelayLink", "main"]

_CHUNK = 64 << 10


class DelayLink:
    """Delay settings and traffic counters shared by every proxied connection."""

    def __init__(self, delay_ms: float, jitter_ms: float, seed: int | None = None) -> None:
        self.delay_s, self.jitter_s = delay_ms / 1000, jitter_ms / 1000
        self.rng = random.Random(seed)
        self.connections = self.bytes = self.chunks = 0

    def hold(self) -> float:
        return max(0.0, self.rng.gauss(self.delay_s, self.jitter_s))

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction, each chunk released at (arrival + hold), in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def release() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        sender = asyncio.create_task(release())
        last = 0.0
        try:
            while data := await reader.read(_CHUNK):
                last = max(last, time.monotonic() + self.hold())  # order kept: never before the previous chunk
                self.bytes += len(data)
                self.chunks += 1
                queue.put_nowait((last, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((last, b""))
        try:
            await sender
        except (ConnectionError, OSError):
            pass

    async def handle(self, target: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        await asyncio.sleep(self.hold() + self.hold())  # the handshake's round trip
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(self.pipe(client_r, up_w), self.pipe(up_r, client_w))
        finally:
            for w in (client_w, up_w):
                w.close()


async def _serve(link: DelayLink, pairs: list[tuple[int, int]]) -> None:
    servers = []
    for listen, target in pairs:

        async def on_connect(r, w, target=target):
            await link.handle(target, r, w)

        servers.append(await asyncio.start_server(on_connect, "127.0.0.1", listen, reuse_address=True))
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()
    print(json.dumps({"connections": link.connections, "bytes": link.bytes, "chunks": link.chunks}), flush=True)


def _pair(text: str) -> tuple[int, int]:
    listen, _, target = text.partition(":")
    try:
        return int(listen), int(target)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LISTEN:TARGET ports, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("pairs", nargs="+", type=_pair, help="LISTEN:TARGET port pairs on 127.0.0.1")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or args.jitter_ms < 0:
        parser.error("--delay-ms and --jitter-ms must be >= 0")
    asyncio.run(_serve(DelayLink(args.delay_ms, args.jitter_ms, args.seed), args.pairs))


if __name__ == "__main__":
    main()
