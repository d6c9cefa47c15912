"""Probe: what reaches a caller of each public Engine method while the database is away.

``python -m tests.fault.outage_probe`` starts an embedded server of its own, connects an
engine through a multi-host DSN (a closed port first, then the server, with
``target_session_attrs=read-write``), calls every method in a loop of its own, stops the
server (``immediate``) for 3 s and starts it again, and prints, per method, how many calls
returned and which exception (with its ``__cause__``) each failed call raised. ``RAW``
marks an exception that is not a WalError. Not a test: a measurement to compare revisions.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tests.fault.standby import with_hosts
from wal_engine.engine import connect
from wal_engine.errors import WalError
from wal_engine.testing.postgres import DatabaseFactory, start_embedded_server


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _describe(error: BaseException) -> str:
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    sent = getattr(error, "sent", None)
    extra = "" if sent is None else f"(sent={sent})"
    cause = error.__cause__
    from_text = "" if cause is None else f" <- {type(cause).__qualname__}"
    raw = "" if isinstance(error, WalError) else "RAW "
    return f"{raw}{name}{extra}{from_text}"


async def main(down_s: float = 3.0) -> None:
    server = start_embedded_server()
    factory = DatabaseFactory(server)
    await factory.prepare()
    try:
        dsn = await factory.create()
        assert server.embedded is not None and server.embedded.port is not None
        multi = with_hosts(dsn, [_closed_port(), server.embedded.port],
                           target_session_attrs="read-write")
        engine = await connect(multi, migrate=False, development=True)

        @engine.agent("probe")
        async def probe(ctx: Any, args: Any) -> Any:
            return await ctx.wait_for_signal("go")

        task_id = await engine.submit("probe", {"n": 0})
        counter = [0]
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "submit(task_id)": lambda: engine.submit("probe", {"n": 1},
                                                     task_id=f"p-{counter[0]}"),
            "submit()": lambda: engine.submit("probe", {"n": 1}),
            "signal(dedup)": lambda: engine.signal(task_id, "go", 1, dedup_key=f"d{counter[0]}"),
            "signal()": lambda: engine.signal(task_id, "other", 1),
            "approve(args_hash)": lambda: engine.approve(task_id, "c1", approver="a",
                                                         args_hash="h"),
            "state": lambda: engine.state(task_id),
            "head": lambda: engine.head(task_id),
            "history": lambda: engine.history(task_id),
            "fork": lambda: engine.fork(task_id, 1),
            "wait": lambda: engine.wait(task_id, timeout_s=0.5),
        }
        seen: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        stop = asyncio.Event()

        async def loop(name: str, call: Callable[[], Awaitable[Any]]) -> None:
            while not stop.is_set():
                counter[0] += 1
                try:
                    await asyncio.wait_for(call(), 60)
                    seen[name]["ok"] += 1
                except Exception as error:
                    seen[name][_describe(error)] += 1
                await asyncio.sleep(0.05)

        loops = asyncio.gather(*(loop(name, call) for name, call in calls.items()))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await asyncio.to_thread(server.embedded.stop, "immediate")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(server.embedded.start)
        print(f"outage {time.monotonic() - started:.1f} s", flush=True)
        await asyncio.sleep(3.0)
        stop.set()
        await asyncio.wait_for(loops, 120)
        for name, counts in seen.items():
            print(f"  {name:20s} {dict(counts)}", flush=True)
        await asyncio.wait_for(engine.close(), 20)
    finally:
        server.close()


if __name__ == "__main__":
    asyncio.run(main())
