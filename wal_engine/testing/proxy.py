"""A small TCP proxy on 127.0.0.1 between workers and PostgreSQL, for network faults.

Point the engine's DSN at :attr:`FaultProxy.port` (:meth:`FaultProxy.dsn`) and switch the
mode while it runs:

* ``pass``: bytes flow both ways;
* ``blackhole``: nothing flows either way, sockets stay open (a partition);
* ``drop_s2c``: the server's bytes are dropped (the client never hears the answer, e.g. to
  a COMMIT that happened: the ambiguous commit, RELIABILITY.md P12);
* ``drop_c2s``: the client's bytes are dropped (the server never hears the request);
* ``latency``: every chunk waits ``latency_s`` before it is forwarded;
* ``jitter``: every chunk waits a random 0 to ``latency_s`` and is forwarded in slices of
  1 to 7 bytes (latency, jitter and fragmentation, RELIABILITY.md N4).

:meth:`FaultProxy.clog` stops one open connection (both directions, its sockets open) and
:meth:`FaultProxy.unclog` lets it flow again: clogging connections one by one and
unclogging them in another order is the "swizzle-clog" of N5.

:meth:`FaultProxy.reset` closes every open connection at once (a reset). Bytes dropped are
gone: the protocol stream of that connection is broken for good, as on a real network
where a middlebox lost state, so the client's next use fails and it must reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import urllib.parse
from typing import Final, Literal

Mode = Literal["pass", "blackhole", "drop_s2c", "drop_c2s", "latency", "jitter"]
MODES: Final = ("pass", "blackhole", "drop_s2c", "drop_c2s", "latency", "jitter")
chunk_bytes: Final = 65536


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` under a test's control."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.mode: Mode = "pass"
        self.latency_s = 0.0
        self.port = 0
        self.connections = 0
        self.bytes_dropped = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._open: dict[int, asyncio.Event] = {}
        """Open connections by number, each with its own flow (cleared: clogged)."""
        self._random = random.Random(0)

    @classmethod
    def for_dsn(cls, dsn: str) -> FaultProxy:
        """A proxy in front of the server a DSN names."""
        parts = urllib.parse.urlsplit(dsn)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432)

    def dsn(self, dsn: str) -> str:
        """``dsn`` rewritten to go through the proxy."""
        parts = urllib.parse.urlsplit(dsn)
        user = "" if parts.username is None else parts.username
        if parts.password is not None:
            user += f":{parts.password}"
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    async def start(self) -> FaultProxy:
        """Listen on a free port of 127.0.0.1."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def set(self, mode: Mode, *, latency_s: float = 0.0) -> None:
        """Switch the mode for every connection, open and new."""
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}")
        if self.mode in ("drop_s2c", "drop_c2s") and mode not in ("drop_s2c", "drop_c2s"):
            # Bytes were lost mid-stream: those protocol streams are broken for good. A
            # middlebox that dropped them would reset them; so do we, on healing.
            self.reset()
        self.mode = mode
        self.latency_s = latency_s
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()

    def open_connections(self) -> list[int]:
        """The numbers of the connections open now, oldest first."""
        return sorted(self._open)

    def clog(self, connection: int) -> None:
        """Stop one connection both ways (its sockets stay open); no-op once it closed."""
        flow = self._open.get(connection)
        if flow is not None:
            flow.clear()

    def unclog(self, connection: int) -> None:
        """Let a clogged connection flow again."""
        flow = self._open.get(connection)
        if flow is not None:
            flow.set()

    def seed(self, seed: int) -> None:
        """Seed the delays and slices of ``jitter`` (a failure can be replayed)."""
        self._random.seed(seed)

    def reset(self) -> int:
        """Close every open connection (both sides); return how many were closed."""
        writers = list(self._writers)
        for writer in writers:
            with contextlib.suppress(Exception):
                transport = writer.transport
                transport.abort()
        self._writers.clear()
        return len(writers) // 2

    async def close(self) -> None:
        """Stop listening and close everything."""
        self.reset()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _accept(self, client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(
                self.target_host, self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        self.connections += 1
        number = self.connections
        flow = asyncio.Event()
        flow.set()
        self._open[number] = flow
        self._writers.update((client_writer, server_writer))
        pumps = []
        for reader, writer, direction in ((client_reader, server_writer, "c2s"),
                                          (server_reader, client_writer, "s2c")):
            task = asyncio.get_running_loop().create_task(
                self._pump(reader, writer, direction, flow))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            pumps.append(task)
        done = asyncio.gather(*pumps, return_exceptions=True)
        done.add_done_callback(lambda _: self._open.pop(number, None))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str, flow: asyncio.Event) -> None:
        try:
            while True:
                chunk = await reader.read(chunk_bytes)
                if not chunk:
                    break
                await self._flowing.wait()
                await flow.wait()
                if self.mode == f"drop_{direction}":
                    self.bytes_dropped += len(chunk)
                    continue
                if self.mode == "latency" and self.latency_s > 0:
                    await asyncio.sleep(self.latency_s)
                if self.mode == "jitter":
                    await asyncio.sleep(self._random.uniform(0, self.latency_s))
                    start = 0
                    while start < len(chunk):
                        end = start + self._random.randint(1, 7)
                        writer.write(chunk[start:end])
                        await writer.drain()
                        start = end
                    continue
                writer.write(chunk)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, RuntimeError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()
