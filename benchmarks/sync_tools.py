"""Sync tools benchmark: a plain ``def`` tool run on the worker's thread pool vs an ``async``
tool run on the event loop (issue 15 moved sync tools off the loop; this is what it costs).

Workloads (the async tool is the reference of the same run):

* ``dispatch``: one call of the tool function as the runtime makes it
  (``wal_engine.runtime.context.call_function``): an ``async def`` awaited on the loop, against a
  ``def`` handed to a thread pool like the worker's and awaited. Nothing else is timed:
  this is the executor hop alone.
* ``tool_step``: one ``ctx.tool`` call inside a running agent, through a real worker (its
  intent and result appended and committed), the tool an ``async def`` or a ``def``. The
  agent times each call; a round is one task making the round's calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

from benchmarks import harness
from wal_engine.engine import Engine, connect
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.steps import call_function

AGENT: Final = "bench-sync-tools"
ARGUMENT: Final = {"order": 42, "items": ["a", "b", "c"]}
RESULT: Final = {"ok": True, "id": "r-42"}
DATABASE: Final = "wal_bench_sync_tools"
THREADS: Final = 12
"""Like a worker of the default concurrency (8) plus 4."""


def sync_tool(args: Any) -> Any:
    """A plain def tool that answers at once."""
    return RESULT


async def async_tool(args: Any) -> Any:
    """An async tool that answers at once."""
    return RESULT


def dispatch(executor: ThreadPoolExecutor, ops: int) -> harness.Workload:
    """The executor hop alone."""

    async def on_loop() -> None:
        await call_function(async_tool, ARGUMENT, None, executor)

    async def on_thread() -> None:
        await call_function(sync_tool, ARGUMENT, None, executor)

    return harness.Workload(
        name="dispatch",
        description="one tool function call as the runtime makes it: async on the loop vs "
                    "def on the worker's thread pool",
        contenders=[harness.Contender("async tool on the loop", on_loop, reference=True),
                    harness.Contender("def tool on the thread pool", on_thread)],
        ops_per_round=ops)


class Steps:
    """Per-call latencies measured inside an agent, handed to the harness one by one."""

    def __init__(self, engine: Engine, calls: int) -> None:
        self.engine = engine
        self.calls = calls
        self.pending: list[int] = []

    def contender(self, name: str, kind: str, *, reference: bool = False) -> harness.Contender:
        """A contender whose round runs one task of ``calls`` calls of the ``kind`` tool."""

        async def before_round(round_index: int) -> None:
            task_id = await self.engine.submit(AGENT, {"kind": kind, "calls": self.calls})
            worker = self.engine.worker(concurrency=1, poll_ms=20)
            await worker.run(until_idle=True)
            state = await self.engine.state(task_id)
            if state.output is None:
                raise RuntimeError(f"the benchmark task did not complete: {state.status} "
                                   f"{state.failure}")
            self.pending = list(state.output["ns"])

        async def next_measured() -> int:
            return self.pending.pop(0)

        return harness.Contender(name, next_measured, reference=reference,
                                 before_round=before_round)


def register(engine: Engine) -> None:
    """The agent: ``calls`` tool calls of one kind, each timed in agent code."""
    tools: dict[str, Callable[[Any], Any]] = {"def": sync_tool, "async": async_tool}

    @engine.agent(AGENT)
    async def agent(ctx: AgentContext, task_input: Any) -> Any:
        tool = tools[task_input["kind"]]
        timings = []
        for i in range(task_input["calls"]):
            started = time.perf_counter_ns()
            await ctx.tool(f"work-{i}", tool, {**ARGUMENT, "i": i})
            timings.append(time.perf_counter_ns() - started)
        return {"ns": timings}


async def main() -> int:
    """Run the workloads, print the table, write ``benchmarks/results/sync_tools.json``."""
    parser = harness.argument_parser("sync_tools", __doc__, rounds=20, ops=200)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=20)
    names = harness.selected(["dispatch", "tool_step"], args)
    # A database of its own: its tasks must not meet other benchmarks' (or their schema).
    dsn = await harness.resolve_bench_dsn(args.dsn, database=DATABASE)
    machine = await harness.describe_machine(dsn)
    results = []
    with ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="bench-sync") as executor:
        if "dispatch" in names:
            results.append(await harness.run_workload(dispatch(executor, settings.ops * 10),
                                                      rounds=settings.rounds))
    if "tool_step" in names:
        engine = await connect(dsn)
        try:
            register(engine)
            steps = Steps(engine, settings.ops + 2)
            workload = harness.Workload(
                name="tool_step",
                description="one ctx.tool call in a running agent (intent and result "
                            "committed): async tool vs def tool",
                contenders=[steps.contender("async tool step", "async", reference=True),
                            steps.contender("def tool step", "def")],
                ops_per_round=settings.ops)
            results.append(await harness.run_workload(workload, rounds=settings.rounds))
        finally:
            await engine.close()
    print(harness.format_report("sync_tools", machine, results, settings))
    if not args.no_json:
        path = harness.write_json("sync_tools", machine, results, settings,
                                  path=args.json_path)
        print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
