"""Agents driven by the runtime benchmark, and a worker process for the takeover figure.

``python -m benchmarks.runtime_agents DSN WORKER_ID LEASE_TTL_MS`` runs a worker whose
``hold`` agent records one step and then blocks, so the benchmark can SIGKILL it while it
holds a lease and time how long another worker takes to resume the task.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Final

from wal_engine.engine import Engine, connect
from wal_engine.runtime.context import AgentContext

MESSAGE_BYTES: Final = 500
RESULT_BYTES: Final = 1000
ARGS: Final = {"message": "m" * MESSAGE_BYTES}
RESULT: Final = {"result": "r" * RESULT_BYTES}


class Driver:
    """Hands step tokens to the ``driven`` agent of each task and awaits each step's end."""

    def __init__(self) -> None:
        self.go: dict[str, asyncio.Queue[bool]] = {}
        self.done: dict[str, asyncio.Queue[None]] = {}

    def add(self, task_id: str) -> None:
        """Prepare the queues of a task before it is submitted."""
        self.go[task_id] = asyncio.Queue()
        self.done[task_id] = asyncio.Queue()

    async def step(self, task_id: str) -> None:
        """Let the task make one tool step and wait until its result is durable."""
        self.go[task_id].put_nowait(True)
        await self.done[task_id].get()

    async def stop(self, task_id: str) -> None:
        """Let the task return (it completes)."""
        self.go[task_id].put_nowait(False)


def tool(args: Any) -> Any:
    """The benchmark's tool: returns a ~1 KB result at once (the cost measured is ours)."""
    return RESULT


def register(engine: Engine, driver: Driver | None = None) -> None:
    """Register ``driven`` (benchmark steps) and ``hold`` (the takeover subject)."""
    if driver is not None:
        @engine.agent("driven")
        async def driven(ctx: AgentContext, task_input: Any) -> Any:
            steps = 0
            while await driver.go[ctx.task_id].get():
                await ctx.tool("work", tool, ARGS)
                steps += 1
                driver.done[ctx.task_id].put_nowait(None)
            return steps

    @engine.agent("hold")
    async def hold(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.tool("work", tool, ARGS)
        await asyncio.Event().wait()  # Hold the lease until killed (or cancelled).


async def hold_worker(dsn: str, worker_id: str, lease_ttl_ms: int) -> None:
    """A worker process holding ``hold`` tasks until it is killed."""
    engine = await connect(dsn, migrate=False)
    register(engine)
    worker = engine.worker(concurrency=4, worker_id=worker_id, lease_ttl_ms=lease_ttl_ms,
                           heartbeat_ms=lease_ttl_ms // 4, poll_ms=100, sweep_ms=1000)
    print("ready", flush=True)
    await worker.run(install_signal_handlers=True)


if __name__ == "__main__":
    asyncio.run(hold_worker(sys.argv[1], sys.argv[2], int(sys.argv[3])))
