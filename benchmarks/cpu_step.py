"""Client CPU per tool step: process time over sequential steps, wal-engine and raw asyncpg.

Wall-clock latency on a shared machine moves with every commit's fsync; the CPU the client
process spends per step does not wait on the server, so it shows what the engine's own code
costs. Both contenders run in this process, interleaved, on the same database:

* wal-engine: one task of ``--steps`` ``ctx.tool`` calls (a ~400 B result each) run by one
  worker (``concurrency=1``) through the public API; process time includes the worker's
  lease-keeper thread, as a deployment's would.
* raw asyncpg (the reference): the suite's step, two one-row ``INSERT`` commits per step, on
  one connection.

It uses only the public API of ``wal_engine``, so :mod:`benchmarks.compare` runs it against
older revisions too (``PYTHONPATH`` naming their checkout).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any, Final

import asyncpg
import orjson

NAME: Final = "cpu_step"
RAW_TABLE: Final = "bench_cpu_raw_steps"
PADDING: Final = "x" * 400


async def _engine_cpu_us(engine: Any, steps: int) -> float:
    task_id = await engine.submit("bench_cpu_steps", {"n": steps})
    worker = engine.worker(concurrency=1)
    started = time.process_time()
    await worker.run(until_idle=True)
    spent = time.process_time() - started
    state = await engine.state(task_id)
    if not str(state.status).endswith("COMPLETED"):
        raise SystemExit(f"the benchmark task ended {state.status}: {state.failure}")
    return spent / steps * 1e6


async def _raw_cpu_us(connection: asyncpg.Connection, steps: int) -> float:
    task_id = uuid.uuid4().hex
    intent = orjson.dumps({"tool": "t", "args": {"i": 0}, "pad": PADDING})
    done = orjson.dumps({"result": {"ok": 0, "pad": PADDING}})
    insert = f"INSERT INTO {RAW_TABLE} (task_id, seq, payload) VALUES ($1, $2, $3)"
    started = time.process_time()
    for step in range(steps):
        await connection.execute(insert, task_id, 2 * step + 1, intent)
        await connection.execute(insert, task_id, 2 * step + 2, done)
    return (time.process_time() - started) / steps * 1e6


async def measure(steps: int, rounds: int, dsn: str | None = None) -> dict[str, Any]:
    """``rounds`` interleaved rounds of ``steps`` steps of each contender, on ``dsn`` (else
    ``WAL_ENGINE_DSN``, else the embedded server)."""
    import wal_engine

    engine = await wal_engine.connect(dsn, development=True)

    async def tool(args: Any) -> Any:
        return {"ok": args["i"], "pad": PADDING}

    @engine.agent("bench_cpu_steps")
    async def agent(ctx: Any, task_input: Any) -> Any:
        for i in range(task_input["n"]):
            await ctx.tool("t", tool, {"i": i})
        return "done"

    connection = await asyncpg.connect(engine.database.dsn)
    try:
        await connection.execute(f"CREATE TABLE IF NOT EXISTS {RAW_TABLE} (task_id text, "
                                 "seq bigint, payload bytea, PRIMARY KEY (task_id, seq))")
        await _engine_cpu_us(engine, 50)  # Warm-up: imports, prepared statements.
        await _raw_cpu_us(connection, 50)
        wal, raw = [], []
        for _ in range(rounds):
            wal.append(await _engine_cpu_us(engine, steps))
            raw.append(await _raw_cpu_us(connection, steps))
        await connection.execute(f"DROP TABLE {RAW_TABLE}")
    finally:
        await connection.close()
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
    parser.add_argument("--steps", type=int, default=2000, help="steps per round (2000)")
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
    for label, key in (("raw asyncpg: 2 INSERT commits (ref)", "raw_cpu_us"),
                       ("wal-engine tool step", "wal_cpu_us")):
        values = figures[key]
        print(f"  {label}: {statistics.median(values):,.0f} µs "
              f"({min(values):,.0f}-{max(values):,.0f})")
    print(f"  ratio (each round's own reference): {figures['ratio_median']:.2f}x")


if __name__ == "__main__":
    main()
