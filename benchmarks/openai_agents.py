"""OpenAI Agents SDK: a durable run (``DurableRunner``) against the SDK's own in-memory
``Runner.run``, with the same scripted model and tool, interleaved in rounds.

The agent calls one tool per model turn for S steps, then answers: a run of S steps is
S + 1 model calls and S tool calls. The model is a real implementation of the SDK's
``Model`` interface that answers at once (no network), so what is measured is each
runner's own cost. Workloads (``Runner.run`` in memory is the reference of each ratio):

* ``run@1`` / ``run@S``: one whole run of 1 / S steps (for wal-engine: submitted, claimed
  by a worker in this process, run, completed, and seen completed by ``engine.wait``);
* the report adds the per-step cost, ``(p50 of run@S - p50 of run@1) / (S - 1)``: what one
  more model turn and tool call costs, without the fixed cost of submitting and claiming a
  task. wal-engine's step is a checkpoint, an LLM call and a tool call written ahead: five
  fenced, hash-chained appends, each one commit.

DBOS's integration of the SDK (``dbos-openai-agents``' ``DBOSRunner``) is a contender of the
suite's ``openai-agents`` row (``python -m benchmarks --only openai-agents``,
:mod:`benchmarks.peers_openai_agents`), which runs this module's agent in a child process
with DBOS launched there. The SDK's Temporal integration is measured nowhere: its test
server is a binary downloaded at run time, which this machine cannot fetch.

Usage: ``python -m benchmarks.openai_agents [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import asyncio
import json
from importlib import metadata
from typing import Any, Final

from agents import Agent, ModelResponse, RunConfig, Runner, Usage, function_tool
from agents.models.interface import Model
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from benchmarks import harness
from wal_engine.engine import Engine, connect
from wal_engine.integrations.openai_agents import DurableRunner
from wal_engine.runtime.context import AgentContext

NAME: Final = "openai_agents"
SDK: Final = "SDK Runner.run (in memory)"
WAL: Final = "wal-engine DurableRunner"
STEPS: Final = 20
QUICK_STEPS: Final = 5
CONFIG: Final = RunConfig(tracing_disabled=True)
WAIT_POLL_S: Final = 0.002


class StepModel(Model):
    """Calls the tool ``step`` until it was told of ``steps`` results, then answers."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    async def get_response(self, system_instructions: str | None, input: Any,
                           *args: Any, **kwargs: Any) -> ModelResponse:
        """The next turn of the script."""
        done = 0 if isinstance(input, str) else sum(
            1 for item in input if item.get("type") == "function_call_output")
        output: list[Any]
        if done < self.steps:
            output = [ResponseFunctionToolCall(
                type="function_call", name="step", call_id=f"c{done}",
                arguments=json.dumps({"n": done}))]
        else:
            output = [ResponseOutputMessage(
                type="message", id="m", role="assistant", status="completed",
                content=[ResponseOutputText(type="output_text", text=f"{done} steps",
                                            annotations=[])])]
        usage = Usage(requests=1, input_tokens=100, output_tokens=20, total_tokens=120)
        return ModelResponse(output=output, usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        """Not used (the runs are not streamed)."""
        raise NotImplementedError


def step_done(n: int) -> str:
    """The tool's answer for step ``n``."""
    return f"step {n} done"


@function_tool
def step(n: int) -> str:
    """One step of work."""
    return step_done(n)


def agent(steps: int, tool: Any = step) -> Agent[Any]:
    """The agent of a run of ``steps`` steps (``tool`` is the ``step`` tool it calls)."""
    return Agent(name="stepper", instructions="step", model=StepModel(steps), tools=[tool])


def register(engine: Engine, steps: tuple[int, ...]) -> None:
    """One wal-engine agent per run length."""
    for count in steps:
        def make(count: int) -> Any:
            async def run(ctx: AgentContext, _: Any) -> Any:
                result = await DurableRunner(ctx).run(agent(count), "go", max_turns=count + 2,
                                                      run_config=CONFIG)
                return result.final_output
            return run
        engine.register(f"bench-openai-agents-{count}", make(count))


def contenders(engine: Engine, steps: int) -> list[harness.Contender]:
    """The SDK in memory (the reference) and wal-engine, for runs of ``steps`` steps."""
    expected = f"{steps} steps"

    async def in_memory() -> None:
        result = await Runner.run(agent(steps), "go", max_turns=steps + 2, run_config=CONFIG)
        assert result.final_output == expected

    async def durable() -> None:
        task_id = await engine.submit(f"bench-openai-agents-{steps}")
        state = await engine.wait(task_id, timeout_s=60, poll_s=WAIT_POLL_S)
        assert state.output == expected, state.failure

    return [harness.Contender(name=SDK, operation=in_memory, reference=True),
            harness.Contender(name=WAL, operation=durable)]


def per_step_us(results: list[harness.WorkloadResult], steps: int,
                names: tuple[str, ...] = (SDK, WAL)) -> dict[str, float]:
    """Each contender's marginal cost of one step, from the two run lengths' medians."""
    short, long = results
    return {name: (long.contender(name).p50_us - short.contender(name).p50_us) / (steps - 1)
            for name in names}


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=10, ops=10)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=2, quick_ops=3)
    steps = QUICK_STEPS if settings.quick else STEPS
    dsn = await harness.resolve_bench_dsn(args.dsn)
    machine = await harness.describe_machine(dsn)
    engine = await connect(dsn)
    try:
        register(engine, (1, steps))
        worker = engine.worker(concurrency=4, poll_ms=5)
        running = asyncio.create_task(worker.run())
        try:
            results = [await harness.run_workload(harness.Workload(
                f"run@{count}", f"one run of {count} model-and-tool steps",
                contenders(engine, count), settings.ops), rounds=settings.rounds)
                for count in (1, steps)]
        finally:
            worker.stop()
            await running
    finally:
        await engine.close()
    print(harness.format_report(NAME, machine, results, settings))
    marginal = per_step_us(results, steps)
    print(f"openai-agents {metadata.version('openai-agents')}. Per step (one model turn and"
          f" one tool call), from run@1 and run@{steps}: {SDK} {marginal[SDK]:.0f} us,"
          f" {WAL} {marginal[WAL]:.0f} us ({marginal[WAL] / marginal[SDK]:.1f}x).")
    if not args.no_json:
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path,
                                  extra={"per_step_us": marginal, "steps": steps,
                                         "openai_agents": metadata.version("openai-agents")})
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
