"""Client CPU per tool step: process time over sequential steps, wal-engine and the suite's
raw two-INSERT reference, in the same process run.

Wall-clock latency on a shared machine moves with every commit's fsync; the CPU the client
process spends per step does not wait on the server, so it shows what the engine's own code
costs. This is issue 23's measure: both contenders run the suite's own step
(:mod:`benchmarks.peers_workload`: ~500 B of arguments, a ~1 KB result, different at
every step), interleaved round by round on the same database, in this process:

* wal-engine: one task of ``--steps`` steps of the suite's agent step
  (:func:`benchmarks.peers_wal.tool_step`: ``ctx.tool("work", ...)`` with
  ``{"message": message(i)}``, the result ``{"result": result(i)}``, a step boundary every
  100 steps), run by one worker (``concurrency=1``) through the public API; process time
  includes the worker's lease-keeper thread, as a deployment's would.
* raw asyncpg (the reference): the suite's raw step (:class:`benchmarks.peers_raw.RawTask`:
  the two rows' payloads encoded as the engine's two events, then two one-row ``INSERT``
  commits), a connection taken from a pool for each step as the suite does.

The figure of each round is process time per step in µs; the ratio is taken round by round
against that round's own reference. ``benchmarks.scale``'s ``cpu_step`` section calls
:func:`measure`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any, Final

import orjson

import wal_engine
from benchmarks.peers_raw import RawTask, open_pool
from benchmarks.peers_wal import tool_step

NAME: Final = "cpu_step"
AGENT: Final = "bench_cpu_steps"
WARM_UP_STEPS: Final = 200


async def _engine_cpu_us(engine: Any, steps: int) -> float:
    task_id = await engine.submit(AGENT, {"n": steps})
    worker = engine.worker(concurrency=1)
    started = time.process_time()
    await worker.run(until_idle=True)
    spent = time.process_time() - started
    state = await engine.state(task_id)
    if not str(state.status).endswith("COMPLETED"):
        raise SystemExit(f"the benchmark task ended {state.status}: {state.failure}")
    return spent / steps * 1e6


async def _raw_cpu_us(pool: Any, steps: int) -> float:
    task = RawTask(f"raw-cpu-{uuid.uuid4().hex[:12]}")
    started = time.process_time()
    for _ in range(steps):
        async with pool.acquire() as connection:
            await task.run_step(connection)
    return (time.process_time() - started) / steps * 1e6


def register(engine: wal_engine.Engine) -> None:
    """The benchmark's agent on ``engine``: ``task_input["n"]`` steps of the suite's step."""

    @engine.agent(AGENT)
    async def agent(ctx: Any, task_input: Any) -> Any:
        for step in range(task_input["n"]):
            await tool_step(ctx, step)
        return "done"


async def measure(steps: int, rounds: int, dsn: str | None = None) -> dict[str, Any]:
    """``rounds`` interleaved rounds of ``steps`` steps of each contender, on ``dsn`` (else
    ``WAL_ENGINE_DSN``, else the embedded server)."""
    engine = await wal_engine.connect(dsn, development=True)
    register(engine)
    pool = await open_pool(engine.database.dsn, 1)
    try:
        await _engine_cpu_us(engine, WARM_UP_STEPS)  # Imports, prepared statements.
        await _raw_cpu_us(pool, WARM_UP_STEPS)
        wal, raw = [], []
        for _ in range(rounds):
            wal.append(await _engine_cpu_us(engine, steps))
            raw.append(await _raw_cpu_us(pool, steps))
    finally:
        await pool.close()
        await engine.close()
    return {"steps": steps, "rounds": rounds, "wal_cpu_us": wal, "raw_cpu_us": raw,
            "wal_cpu_us_median": statistics.median(wal),
            "raw_cpu_us_median": statistics.median(raw),
            "ratio_median": statistics.median(w / r for w, r in zip(wal, raw, strict=True))}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000, help="steps per round (10,000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: WAL_ENGINE_DSN, else embedded)")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.steps, args.rounds, args.dsn))
    if args.json:
        print(orjson.dumps(figures).decode())
        return
    print(f"client CPU per tool step over {args.steps:,} sequential steps, "
          f"{args.rounds} interleaved rounds (median, min-max):")
    for label, key in (("raw asyncpg: the suite's 2 INSERT commits (ref)", "raw_cpu_us"),
                       ("wal-engine tool step", "wal_cpu_us")):
        values = figures[key]
        print(f"  {label}: {statistics.median(values):,.0f} µs "
              f"({min(values):,.0f}-{max(values):,.0f})")
    ratios = [w / r for w, r in zip(figures["wal_cpu_us"], figures["raw_cpu_us"], strict=True)]
    print(f"  ratio (each round's own reference): {figures['ratio_median']:.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
