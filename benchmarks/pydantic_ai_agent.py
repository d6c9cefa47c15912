"""Pydantic AI: the cost of a durable agent run (``WalDurability``) against Pydantic AI's own
in-memory run of the same agent, in the same process, interleaved in rounds.

The agent is a real Pydantic AI ``Agent`` on ``FunctionModel`` (no network, no tokens, so
the cost measured is the framework's and the log's): it calls a tool ``TOOL_CALLS`` times,
one call per model response, then answers with a structured output. A run is
``2 * TOOL_CALLS + 1`` steps (model requests and tool calls).

Contenders, one operation = one whole agent run:

* ``pydantic-ai in-memory`` (the reference): ``agent.run(...)`` of the agent without the
  capability; nothing is written anywhere.
* ``pydantic-ai + WalDurability``: a task submitted to a live in-process worker, whose agent
  function runs the durable agent with ``run_agent``: every model request and tool call is an
  intent and a result appended and committed (two round trips each). The time runs from the
  submission to the agent function's return (the completion's own commit is not counted).
* ``WalDurability replay``: the replay checker runs the same agent function against a
  recorded history of one run: every call is answered from the log, nothing is written
  (the cost of re-running the agent code on resume, without the reads).

Pydantic AI's DBOS integration (``DBOSDurability``) is a contender of the suite's
``pydantic-ai`` row (``python -m benchmarks --only pydantic-ai``,
:mod:`benchmarks.peers_pydantic_ai`), which runs this module's agent in a child process
with DBOS launched there.
Temporal's is measured nowhere: its test server is a binary downloaded at run time, which
this machine cannot fetch.

Usage: ``python -m benchmarks.pydantic_ai_agent [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import asyncio
import uuid
from importlib import metadata
from typing import Any, Final

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from benchmarks import harness
from wal_engine.engine import connect
from wal_engine.integrations.pydantic_ai import WalDurability, run_agent
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.replayer import replay_events

NAME: Final = "pydantic_ai_agent"
BENCH_DATABASE: Final = "wal_bench_pydantic_ai"
TOOL_CALLS: Final = 4
STEPS: Final = 2 * TOOL_CALLS + 1
RESULT_BYTES: Final = 1000
IN_MEMORY: Final = "pydantic-ai in-memory"
DURABLE: Final = "pydantic-ai + WalDurability"
REPLAY: Final = "WalDurability replay"


class Report(BaseModel):
    """The agent's structured output."""

    lookups: int
    last: str


def model_script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    done = sum(isinstance(part, ToolReturnPart) for message in messages
               if isinstance(message, ModelRequest) for part in message.parts)
    if done < TOOL_CALLS:
        return ModelResponse(parts=[ToolCallPart("lookup", {"key": f"k{done}"},
                                                 tool_call_id=f"call-{done}")])
    output = info.output_tools[0].name
    return ModelResponse(parts=[ToolCallPart(output, {"lookups": done, "last": f"k{done - 1}"},
                                             tool_call_id="call-final")])


def lookup_answer(key: str) -> str:
    """The tool's answer: ~1 KB at once (the cost measured is the framework's)."""
    return key + ":" + "r" * RESULT_BYTES


def build_agent(durable: bool) -> Agent[None, Report]:
    """The benchmark's agent, with or without the capability."""
    capabilities = [WalDurability[None]()] if durable else []
    agent = Agent(FunctionModel(model_script), name="bench", output_type=Report,
                  capabilities=capabilities)

    @agent.tool_plain
    def lookup(key: str) -> str:
        """Look a key up (a ~1 KB answer at once: the cost measured is the framework's)."""
        return lookup_answer(key)

    return agent


def _settle(waiter: asyncio.Future[Any], output: Any) -> None:
    if not waiter.done():
        waiter.set_result(output)


class Runs:
    """The agent run three ways, each one operation of a contender: Pydantic AI's own
    in-memory run, the durable run in a wal-engine task (a worker in this process), and the
    replay of a recorded durable run. Used by :func:`main` and by the suite's
    ``pydantic-ai`` row (:mod:`benchmarks.peers_pydantic_ai`)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.plain, self.durable = build_agent(False), build_agent(True)
        self.returned: dict[str, asyncio.Future[Any]] = {}
        self.records: list[Any] = []
        self.recorded_id = f"pa-recorded-{uuid.uuid4().hex}"
        self.engine: Any = None
        self.worker: Any = None
        self.running: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Connect, register the durable agent, start a worker; record one run."""
        self.engine = engine = await connect(self.dsn)
        loop = asyncio.get_running_loop()

        @engine.agent("bench-pydantic-ai")
        async def bench(ctx: AgentContext, prompt: str) -> dict[str, Any]:
            result = await run_agent(ctx, self.durable, prompt)
            output = result.output.model_dump(mode="json")
            waiter = self.returned.get(ctx.task_id)
            if waiter is not None:
                # Agent functions may run on another event loop than this one's.
                loop.call_soon_threadsafe(_settle, waiter, output)
            return output

        self.worker = engine.worker(concurrency=4, poll_ms=20)
        self.running = asyncio.create_task(self.worker.run())
        await self.submitted(self.recorded_id)
        await engine.wait(self.recorded_id, timeout_s=60)
        self.records = await engine.history(self.recorded_id)

    async def submitted(self, task_id: str) -> Any:
        """Submit a run and wait until the agent function returns its output."""
        waiter = self.returned[task_id] = asyncio.get_running_loop().create_future()
        try:
            await self.engine.submit("bench-pydantic-ai", "go", task_id=task_id)
            return await asyncio.wait_for(waiter, 60)
        finally:
            del self.returned[task_id]

    async def in_memory(self) -> None:
        """Pydantic AI's own run of the agent without the capability."""
        result = await self.plain.run("go")
        assert result.output.lookups == TOOL_CALLS

    async def durable_run(self) -> None:
        """The agent with ``WalDurability`` in a submitted wal-engine task."""
        output = await self.submitted(f"pa-{uuid.uuid4().hex}")
        assert output["lookups"] == TOOL_CALLS

    async def replayed(self) -> None:
        """The agent function re-run against the recorded history (nothing written)."""
        report = await replay_events(self.records, self.engine.agents,
                                     task_id=self.recorded_id)
        assert report.outcome == "completed" and report.calls_replayed == STEPS

    async def close(self) -> None:
        """Stop the worker, close the engine."""
        if self.worker is not None and self.running is not None:
            self.worker.stop()
            await asyncio.wait_for(self.running, 30)
        if self.engine is not None:
            await self.engine.close()


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=10, ops=20,
                                     database=BENCH_DATABASE)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=2, quick_ops=3)
    dsn = await harness.resolve_bench_dsn(args.dsn, database=BENCH_DATABASE)
    machine = await harness.describe_machine(dsn)
    runs = Runs(dsn)
    try:
        await runs.open()
        workload = harness.Workload(
            "run", f"one agent run: {TOOL_CALLS} tool calls, {STEPS} steps",
            [harness.Contender(IN_MEMORY, runs.in_memory, events_per_op=STEPS, reference=True),
             harness.Contender(DURABLE, runs.durable_run, events_per_op=STEPS),
             harness.Contender(REPLAY, runs.replayed, events_per_op=STEPS)],
            settings.ops)
        results = [await harness.run_workload(workload, rounds=settings.rounds)]
    finally:
        await runs.close()
    print(harness.format_report(NAME, machine, results, settings))
    version = metadata.version("pydantic-ai-slim")
    per_step = {c.name: c.p50_us / STEPS for c in results[0].contenders}
    print(f"pydantic-ai-slim {version}; p50 per step: " + ", ".join(
        f"{name} {value:.0f} us" for name, value in per_step.items()))
    if not args.no_json:
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path,
                                  extra={"steps_per_run": STEPS, "p50_us_per_step": per_step,
                                         "pydantic_ai_slim": version})
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
