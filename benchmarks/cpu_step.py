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

``--layers`` adds two contenders that split wal-engine's step by layer (user and system
time apiece, same rounds): ``statements``, the two one-row ``INSERT ... RETURNING``
round trips alone on a connection held for the run (rows of the same sizes, nothing
encoded: the driver's and the event loop's floor), and ``store``, the step's two events
(built as the runtime builds them: arguments hash, idempotency key) through
``Store.append_events`` on a held connection, as the group committer sends a lone append
(encoding, hash chain, the fenced statement). wal-engine's step less ``store`` is the
runtime's share (journal, redaction, fold, the call driver, the committer).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import orjson

import wal_engine
from benchmarks import harness
from benchmarks.peers_raw import INSERT, RawTask, open_pool
from benchmarks.peers_wal import tool_step
from benchmarks.peers_workload import message, result

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


async def _statements_cpu_us(connection: Any, steps: int) -> float:
    task_id = f"raw-floor-{uuid.uuid4().hex[:12]}"
    insert = INSERT + " RETURNING seq"
    intent, completed = b"i" * (len(message(0)) + 200), b"c" * (len(result(0)) + 100)
    started = time.process_time()
    for step in range(steps):
        await connection.fetch(insert, task_id, 2 * step + 1, "intent", intent, bytes(32))
        await connection.fetch(insert, task_id, 2 * step + 2, "result", completed, bytes(32))
    return (time.process_time() - started) / steps * 1e6


async def _store_cpu_us(engine: Any, connection: Any, steps: int) -> float:
    from replay.state import args_hash
    from wal_engine import events as vocabulary
    from wal_engine.ids import idempotency_key

    store = engine.store
    (head,) = await harness.create_claimed_tasks(store, [f"cpu-store-{uuid.uuid4().hex[:12]}"])
    started = time.process_time()
    for step in range(steps):
        call_id, args = f"tool-{step}", {"message": message(step)}
        for event in (vocabulary.ToolCallIntended(
                          call_id=call_id, tool="work", args=args, args_hash=args_hash(args),
                          idempotency_key=idempotency_key(head.task_id, head.seq + 1)),
                      vocabulary.ToolCallCompleted(call_id=call_id,
                                                   result={"result": result(step)})):
            appended = await store.append_events(
                head.task_id, [event], epoch=head.epoch, expected_seq=head.seq,
                prev_hash=head.hash, via=connection)
            head.seq, head.hash = appended.head_seq, appended.head_hash
    spent = time.process_time() - started
    await harness.complete_tasks(store, [head])
    return spent / steps * 1e6


async def _split(operation: Callable[[], Awaitable[float]], steps: int,
                 into: dict[str, list[float]], name: str) -> float:
    """Run ``operation``; record its user and system time per step beside its figure."""
    before = os.times()
    figure = await operation()
    after = os.times()
    into.setdefault(f"{name}_user_us", []).append((after.user - before.user) / steps * 1e6)
    into.setdefault(f"{name}_sys_us", []).append((after.system - before.system) / steps * 1e6)
    into.setdefault(f"{name}_cpu_us", []).append(figure)
    return figure


def register(engine: wal_engine.Engine) -> None:
    """The benchmark's agent on ``engine``: ``task_input["n"]`` steps of the suite's step."""

    @engine.agent(AGENT)
    async def agent(ctx: Any, task_input: Any) -> Any:
        for step in range(task_input["n"]):
            await tool_step(ctx, step)
        return "done"


async def measure(steps: int, rounds: int, dsn: str | None = None, *,
                  layers: bool = False) -> dict[str, Any]:
    """``rounds`` interleaved rounds of ``steps`` steps of each contender, on ``dsn`` (else
    ``WAL_ENGINE_DSN``, else the embedded server); with ``layers``, the ``statements`` and
    ``store`` contenders too, and every contender's user and system time."""
    engine = await wal_engine.connect(dsn, development=True)
    register(engine)
    pool = await open_pool(engine.database.dsn, 1)
    # The layers' own connections: one outside the raw pool (whose one connection the raw
    # step takes every step), one of the engine's pool (as the group committer holds one).
    held = await open_pool(engine.database.dsn, 1) if layers else None
    store_connection = await engine.database.pool.acquire() if layers else None
    split: dict[str, list[float]] = {}
    try:
        await _engine_cpu_us(engine, WARM_UP_STEPS)  # Imports, prepared statements.
        await _raw_cpu_us(pool, WARM_UP_STEPS)
        if held is not None:
            async with held.acquire() as connection:
                await _statements_cpu_us(connection, WARM_UP_STEPS)
            await _store_cpu_us(engine, store_connection, WARM_UP_STEPS)
        wal, raw = [], []
        for _ in range(rounds):
            if not layers:
                wal.append(await _engine_cpu_us(engine, steps))
                raw.append(await _raw_cpu_us(pool, steps))
                continue
            assert held is not None
            wal.append(await _split(lambda: _engine_cpu_us(engine, steps), steps, split, "wal"))
            raw.append(await _split(lambda: _raw_cpu_us(pool, steps), steps, split, "raw"))
            async with held.acquire() as connection:
                await _split(lambda: _statements_cpu_us(connection, steps), steps, split,
                             "statements")
            await _split(lambda: _store_cpu_us(engine, store_connection, steps), steps, split,
                         "store")
    finally:
        if store_connection is not None:
            await engine.database.pool.release(store_connection)
        if held is not None:
            await held.close()
        await pool.close()
        await engine.close()
    figures: dict[str, Any] = {
        "steps": steps, "rounds": rounds, "wal_cpu_us": wal, "raw_cpu_us": raw,
        "wal_cpu_us_median": statistics.median(wal),
        "raw_cpu_us_median": statistics.median(raw),
        "ratio_median": statistics.median(w / r for w, r in zip(wal, raw, strict=True))}
    if layers:
        figures["layers"] = split
    return figures


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_step",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000, help="steps per round (10,000)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: WAL_ENGINE_DSN, else embedded)")
    parser.add_argument("--layers", action="store_true",
                        help="also the statements and store layers, user and system time")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.steps, args.rounds, args.dsn, layers=args.layers))
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
    split = figures.get("layers")
    if split:
        print("  by layer, median µs per step (user + system):")
        for name in ("raw", "statements", "store", "wal"):
            user, system = (statistics.median(split[f"{name}_{part}_us"])
                            for part in ("user", "sys"))
            print(f"    {name}: {user:,.0f} + {system:,.0f}")


if __name__ == "__main__":
    main()
