"""The suite's ``openai-agents`` rows: a run of 1 and of S steps, in memory, under
wal-engine, under DBOS.

The agent is :mod:`benchmarks.openai_agents`' (a scripted ``Model`` that calls the ``step``
tool once per turn for S turns, then answers). All contenders live in one child process
(``python -m benchmarks.peers_workload openai_agents serve``), stepped round by round by
the suite; each method is one whole run:

* ``sdk_*``: the SDK's own ``Runner.run`` in memory (the reference);
* ``wal_*``: wal-engine's ``DurableRunner`` in a submitted task, run by a worker in this
  process and seen completed by ``engine.wait`` (:func:`benchmarks.openai_agents.contenders`);
* ``dbos_*`` (when a DBOS system database is given and ``dbos-openai-agents`` is installed):
  DBOS's ``DBOSRunner.run`` inside a ``@DBOS.workflow`` called from this process.
  ``DBOSRunner`` makes every model response a DBOS step and leaves function tools to the
  user, who makes one durable by making it a ``@DBOS.step`` (its documentation); the tool
  here is the same function made a step, so that both durable contenders record every model
  response and every tool call.

The per-step cost is the marginal one of :func:`benchmarks.openai_agents.per_step_us`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from benchmarks import openai_agents as bench
from wal_engine.engine import connect


class _Dbos:
    """The DBOS contender: its tool, workflow and launch (DBOS is one per process)."""

    def __init__(self, system_url: str) -> None:
        from agents import function_tool
        from dbos import DBOS
        from dbos_openai_agents import DBOSRunner

        from benchmarks import peers_dbos

        @DBOS.step(name="bench_openai_step")
        async def step_step(n: int) -> str:
            return bench.step_done(n)

        @function_tool(name_override="step")
        async def step(n: int) -> str:
            """One step of work."""
            result: str = await step_step(n)
            return result

        @DBOS.workflow(name="bench_openai_agents_run")
        async def run(steps: int) -> Any:
            result = await DBOSRunner.run(bench.agent(steps, step), "go", max_turns=steps + 2,
                                          run_config=bench.CONFIG)
            return result.final_output

        self.run = run
        self.dbos = DBOS
        DBOS(config=peers_dbos.config(system_url, f"openai-agents-{uuid.uuid4().hex[:8]}"))
        DBOS.launch()

    async def one_run(self, steps: int) -> None:
        output = await self.run(steps)
        assert output == f"{steps} steps", output

    async def steps_of_one_run(self, steps: int) -> int:
        """How many steps DBOS records for one run of ``steps`` steps."""
        from dbos import SetWorkflowID

        workflow_id = f"oa-dbos-count-{uuid.uuid4().hex}"
        with SetWorkflowID(workflow_id):
            await self.run(steps)
        return len(await self.dbos.list_workflow_steps_async(workflow_id, load_output=False))


class OpenAiAgentsPeer:
    """The rows' contenders in this process (see the module's docstring)."""

    name = "openai-agents"

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.dsn: str = arguments["dsn"]
        self.steps = int(arguments["steps"])
        self.system_url: str | None = arguments.get("system_url")
        self.engine: Any = None
        self.worker: Any = None
        self.running: asyncio.Task[None] | None = None
        self.operations: dict[tuple[str, int], Any] = {}
        self._dbos: Any = None
        self.dbos_steps: int | None = None

    async def open(self) -> None:
        """Connect and start wal-engine's worker; launch DBOS if asked."""
        self.engine = await connect(self.dsn)
        bench.register(self.engine, (1, self.steps))
        self.worker = self.engine.worker(concurrency=4, poll_ms=5)
        self.running = asyncio.create_task(self.worker.run())
        for count in (1, self.steps):
            for contender in bench.contenders(self.engine, count):
                self.operations[(contender.name, count)] = contender.operation
        if self.system_url:
            self._dbos = _Dbos(self.system_url)
            self.dbos_steps = await self._dbos.steps_of_one_run(self.steps)

    async def _dbos_run(self, steps: int) -> None:
        if self._dbos is None:
            raise RuntimeError("DBOS was not launched in this child (no system_url)")
        await self._dbos.one_run(steps)

    async def sdk_1(self) -> None:
        """``Runner.run`` of 1 step."""
        await self.operations[(bench.SDK, 1)]()

    async def sdk_n(self) -> None:
        """``Runner.run`` of S steps."""
        await self.operations[(bench.SDK, self.steps)]()

    async def wal_1(self) -> None:
        """wal-engine ``DurableRunner`` of 1 step."""
        await self.operations[(bench.WAL, 1)]()

    async def wal_n(self) -> None:
        """wal-engine ``DurableRunner`` of S steps."""
        await self.operations[(bench.WAL, self.steps)]()

    async def dbos_1(self) -> None:
        """DBOS ``DBOSRunner`` of 1 step."""
        await self._dbos_run(1)

    async def dbos_n(self) -> None:
        """DBOS ``DBOSRunner`` of S steps."""
        await self._dbos_run(self.steps)

    async def extra(self) -> dict[str, Any]:
        """DBOS's step count for one run of S steps."""
        return {"steps": self.steps, "dbos_steps_per_run": self.dbos_steps}

    async def close(self) -> None:
        """Stop the worker, close the engine, shut DBOS down."""
        if self.worker is not None and self.running is not None:
            self.worker.stop()
            await asyncio.wait_for(self.running, 30)
        if self.engine is not None:
            await self.engine.close()
        if self._dbos is not None:
            self._dbos.dbos.destroy(destroy_registry=False)


def live_peer(arguments: dict[str, Any]) -> OpenAiAgentsPeer:
    """(Child) The rows' contenders, for ``serve``."""
    return OpenAiAgentsPeer(arguments)
