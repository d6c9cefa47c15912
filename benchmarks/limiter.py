"""Rate limiters (issue 24): what a limiter adds to an LLM call, and how close a token
limiter holds its limit under 64 concurrent tasks.

Two parts, on one database, in one run:

* **overhead**: one task of ``--calls`` sequential LLM calls with a fake LLM that answers at
  once, without a limiter (the reference) and with one whose limits are never reached,
  interleaved in ``--rounds`` rounds. Each call is timed in the agent around ``ctx.llm``
  (wall clock: the grant and the settlement are two statements, one before the intent and
  one after the result). Reported: p50 per call over every call of a contender, its spread
  (p10-p90), and the difference of the p50s (the overhead).
* **hold**: 64 tasks run at once under one token limiter of ``--tokens`` tokens per
  ``--period`` seconds (both the input and output tokens count); each makes calls to a fake
  LLM that takes 50 ms and reports a usage drawn uniformly in 300..700 tokens (seeded by
  the request), against an estimate of 500 (``--estimate``: 700, the bound, reserves what
  a call can use at most, as a provider counting ``max_tokens`` does). Every start is
  written to a ledger with the usage reported. Over the steady state (from one period
  after the first start to the last start), the tokens of the calls started in every
  sliding window of one period, sampled every 100 ms, are reported as a fraction of the
  limit: min, median, max. The issue asks for a minute; ``--period 60`` runs it (about
  four minutes); the default is 10 s. Waits stay in process here (``durable_after_s``
  above the period).

Usage: ``python -m benchmarks.limiter [--dsn DSN] [--quick] [--rounds N] [--calls N]
[--tokens N] [--period S] [--estimate N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Final

from benchmarks import harness
from wal_engine.engine import Engine, connect
from wal_engine.retries import RetryPolicy
from wal_engine.runtime.context import LlmResponse

NAME: Final = "limiter"
TASKS: Final = 64
CALL_S: Final = 0.05
ESTIMATE: Final = 500
IN_PROCESS: Final = RetryPolicy(durable_after_s=3600.0)
"""The hold's calls wait in process (a worker run ``until_idle`` would stop at the first
task parked on a durable timer; parking is measured by the integration tests instead)."""


def _percentile(ordered: list[float], q: float) -> float:
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def _instant(request: Any) -> LlmResponse:
    return LlmResponse(content="ok", input_tokens=10, output_tokens=10)


async def _overhead(engine: Engine, rounds: int, calls: int, run_id: str) -> dict[str, Any]:
    limiter = f"bench-overhead-{run_id}"
    await engine.limiter(limiter, requests_per_period=10**12, tokens_per_period=10**12,
                         period_s=1.0)
    timings: dict[str, list[float]] = {"plain": [], "limited": []}

    @engine.agent(f"overhead-{run_id}")
    async def agent(ctx: Any, kind: str) -> int:
        for i in range(calls):
            started = time.perf_counter()
            if kind == "plain":
                await ctx.llm("fake", _instant, i)
            else:
                await ctx.llm("fake", _instant, i, limiter=limiter, estimate_tokens=20)
            timings[kind].append((time.perf_counter() - started) * 1e6)
        return calls

    for round_ in range(rounds):
        for kind in (("plain", "limited") if round_ % 2 == 0 else ("limited", "plain")):
            await engine.submit(f"overhead-{run_id}", kind)
            worker = engine.worker(concurrency=1, poll_ms=10)
            await worker.run(until_idle=True)
    result: dict[str, Any] = {}
    for kind, values in timings.items():
        ordered = sorted(values)
        result[kind] = {"calls": len(ordered), "p50_us": _percentile(ordered, 0.5),
                        "p10_us": _percentile(ordered, 0.1), "p90_us": _percentile(ordered, 0.9)}
    result["overhead_p50_us"] = result["limited"]["p50_us"] - result["plain"]["p50_us"]
    return result


def _usage(request: str) -> int:
    digest = hashlib.sha256(request.encode()).digest()
    return 300 + int.from_bytes(digest[:4], "big") % 401


async def _hold(engine: Engine, tokens: int, period_s: float, run_id: str,
                estimate: int = ESTIMATE) -> dict[str, Any]:
    limiter = f"bench-hold-{run_id}"
    await engine.limiter(limiter, tokens_per_period=tokens, period_s=period_s)
    # Enough calls for about three periods at the limit.
    calls_per_task = max(2, round(3 * tokens / ESTIMATE / TASKS))  # ESTIMATE: the mean
    ledger: list[tuple[float, int]] = []

    async def fake(request: str) -> LlmResponse:
        used = _usage(request)
        ledger.append((time.monotonic(), used))
        await asyncio.sleep(CALL_S)
        return LlmResponse(content="ok", input_tokens=used // 2, output_tokens=used - used // 2)

    @engine.agent(f"hold-{run_id}")
    async def agent(ctx: Any, n: int) -> int:
        for i in range(calls_per_task):
            await ctx.llm("fake", fake, f"{run_id}-{n}-{i}", limiter=limiter,
                          estimate_tokens=estimate, retry=IN_PROCESS)
        return n

    for n in range(TASKS):
        await engine.submit(f"hold-{run_id}", n)
    started = time.monotonic()
    worker = engine.worker(concurrency=TASKS, poll_ms=20)
    await worker.run(until_idle=True)
    elapsed = time.monotonic() - started
    ledger.sort()
    first, last = ledger[0][0], ledger[-1][0]
    fractions = []
    t = first + period_s
    while t <= last:
        used = sum(u for at, u in ledger if t - period_s <= at < t)
        fractions.append(used / tokens)
        t += 0.1
    fractions.sort()
    return {"tasks": TASKS, "calls": len(ledger), "limit_tokens": tokens, "period_s": period_s,
            "estimate_tokens": estimate,
            "elapsed_s": elapsed, "windows": len(fractions),
            "min": fractions[0] if fractions else None,
            "median": statistics.median(fractions) if fractions else None,
            "max": fractions[-1] if fractions else None}


async def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.limiter")
    parser.add_argument("--dsn", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--period", type=float, default=None)
    parser.add_argument("--estimate", type=int, default=ESTIMATE,
                        help="tokens reserved per call before it (the fake's usage is "
                             "300..700: 500 is its mean, 700 its bound, as a provider that "
                             "counts max_tokens at the request)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 6)
    calls = args.calls or (50 if args.quick else 200)
    period_s = args.period or (2.0 if args.quick else 10.0)
    tokens = args.tokens or round(ESTIMATE * 20 * period_s)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    engine = await connect(dsn, pool_size_max=20)
    run_id = hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:10]
    try:
        overhead = await _overhead(engine, rounds, calls, run_id)
        hold = await _hold(engine, tokens, period_s, run_id, args.estimate)
    finally:
        await engine.close()
    plain, limited = overhead["plain"], overhead["limited"]
    print(f"limiter overhead per LLM call ({rounds} rounds x {calls} calls, interleaved):")
    print("| contender | calls | p50 us | p10-p90 us |")
    print("|---|---|---|---|")
    for label, row in (("no limiter (ref)", plain), ("limiter", limited)):
        print(f"| {label} | {row['calls']} | {row['p50_us']:.0f} | "
              f"{row['p10_us']:.0f}-{row['p90_us']:.0f} |")
    print(f"overhead p50: {overhead['overhead_p50_us']:.0f} us per call")
    print(f"token limiter hold: {hold['tasks']} tasks, {hold['calls']} calls, limit "
          f"{hold['limit_tokens']} tokens per {hold['period_s']:g} s, estimate "
          f"{hold['estimate_tokens']} per call, {hold['elapsed_s']:.1f} s; "
          f"tokens started per sliding window / limit over {hold['windows']} windows: "
          f"min {hold['min']:.4f}, median {hold['median']:.4f}, max {hold['max']:.4f}")
    if args.json:
        document = json.dumps({"name": NAME, "overhead": overhead, "hold": hold}, indent=2)
        await asyncio.to_thread(Path(args.json).write_text, document)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
