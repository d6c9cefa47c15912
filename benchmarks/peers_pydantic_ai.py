"""The suite's ``pydantic-ai`` row: one agent run in memory, under wal-engine, under DBOS.

The agent is :mod:`benchmarks.pydantic_ai_agent`'s (``FunctionModel`` script, the ``lookup``
tool, ``TOOL_CALLS`` tool calls and a structured answer: ``STEPS`` model requests and tool
calls). All three contenders live in one child process (``python -m benchmarks.peers_workload
pydantic_ai serve``), stepped round by round by the suite:

* ``in_memory``: Pydantic AI's own ``agent.run`` (the reference);
* ``wal``: the agent with ``WalDurability`` in a submitted wal-engine task
  (:class:`benchmarks.pydantic_ai_agent.Runs`);
* ``dbos`` (when a DBOS system database is given and ``dbos`` is installed): the same agent
  with Pydantic AI's ``DBOSDurability`` capability, run inside a ``@DBOS.workflow`` called
  from this process (DBOS's usual way). ``DBOSDurability`` makes every model request a DBOS
  step but leaves function tools to the user, who makes one durable by making it a
  ``@DBOS.step`` (DBOS's documentation); the tool here is the same function made a step,
  so that both durable contenders record every model request and every tool call.
"""

from __future__ import annotations

import uuid
from typing import Any, Final

from pydantic_ai import Agent

from benchmarks import pydantic_ai_agent as bench

DBOS_AGENT_NAME: Final = "bench_dbos"


class _Dbos:
    """The DBOS contender: its agent, workflow and launch (DBOS is one per process)."""

    def __init__(self, system_url: str) -> None:
        from dbos import DBOS
        from pydantic_ai.durable_exec.dbos import DBOSDurability
        from pydantic_ai.models.function import FunctionModel

        from benchmarks import peers_dbos

        @DBOS.step(name="bench_lookup")
        async def lookup_step(key: str) -> str:
            return bench.lookup_answer(key)

        agent = Agent(FunctionModel(bench.model_script), name=DBOS_AGENT_NAME,
                      output_type=bench.Report, capabilities=[DBOSDurability[None]()])

        @agent.tool_plain
        async def lookup(key: str) -> str:
            """Look a key up (a ~1 KB answer at once: the cost measured is the framework's)."""
            result: str = await lookup_step(key)
            return result

        @DBOS.workflow(name="bench_pydantic_ai_run")
        async def run(prompt: str) -> dict[str, Any]:
            result = await agent.run(prompt)
            output: dict[str, Any] = result.output.model_dump(mode="json")
            return output

        self.run = run
        self.dbos = DBOS
        DBOS(config=peers_dbos.config(system_url, f"pydantic-ai-{uuid.uuid4().hex[:8]}"))
        DBOS.launch()

    async def steps_of_one_run(self) -> int:
        """How many steps DBOS records for one run of the agent."""
        from dbos import SetWorkflowID

        workflow_id = f"pa-dbos-count-{uuid.uuid4().hex}"
        with SetWorkflowID(workflow_id):
            await self.run("go")
        steps = await self.dbos.list_workflow_steps_async(workflow_id, load_output=False)
        return len(steps)


class PydanticAiPeer:
    """The row's contenders in this process (see the module's docstring)."""

    name = "pydantic-ai"

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.runs = bench.Runs(arguments["dsn"])
        self.system_url: str | None = arguments.get("system_url")
        self.dbos_steps: int | None = None
        self._dbos: _Dbos | None = None

    async def open(self) -> None:
        """Start wal-engine's worker (and record a run), launch DBOS if asked."""
        await self.runs.open()
        if self.system_url:
            self._dbos = _Dbos(self.system_url)
            self.dbos_steps = await self._dbos.steps_of_one_run()

    async def in_memory(self) -> None:
        """Pydantic AI's own in-memory run."""
        await self.runs.in_memory()

    async def wal(self) -> None:
        """The run with ``WalDurability`` in a wal-engine task."""
        await self.runs.durable_run()

    async def dbos(self) -> None:
        """The run with ``DBOSDurability`` in a DBOS workflow."""
        if self._dbos is None:
            raise RuntimeError("DBOS was not launched in this child (no system_url)")
        output = await self._dbos.run("go")
        assert output["lookups"] == bench.TOOL_CALLS

    async def extra(self) -> dict[str, Any]:
        """Steps per run, as each contender counts them."""
        return {"steps_per_run": bench.STEPS, "dbos_steps_per_run": self.dbos_steps}

    async def close(self) -> None:
        """Stop the worker, shut DBOS down."""
        await self.runs.close()
        if self._dbos is not None:
            self._dbos.dbos.destroy(destroy_registry=False)


def live_peer(arguments: dict[str, Any]) -> PydanticAiPeer:
    """(Child) The row's contenders, for ``serve``."""
    return PydanticAiPeer(arguments)
