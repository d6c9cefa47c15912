"""Loop stall benchmark: the worst lag of a worker's event loop while its tasks run plain
``def`` tools that block, through the public API only (so that the same script measures
any revision: run it with ``PYTHONPATH`` set to another checkout to get its figure).

The workload is the blocking part of the effect model (``wal_engine.testing.effects``):
tasks whose ``def`` tools block their thread (``time.sleep``) for 1.3 s (longer than the
model's lease), answer 0.4 s late, or answer at once. A probe coroutine on the worker's loop
wakes every 5 ms and records how late it woke: the loop's lag. Before sync tools ran on a
thread pool, a blocking ``def`` tool stalled the loop for as long as it blocked.

Prints the worst and the median lag, and writes ``benchmarks/results/loop_stall.json``
(``--json`` elsewhere, ``--label`` to name the revision measured).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from wal_engine.engine import connect

AGENT: Final = "bench-loop-stall"
DATABASE: Final = "wal_bench_loop_stall"
PROBE_S: Final = 0.005
BLOCK_S: Final = 1.3
LATE_S: Final = 0.4
PLAN: Final = [BLOCK_S, 0.0, LATE_S, 0.0, 0.0, BLOCK_S, 0.0, LATE_S]
"""Seconds each tool call of a task blocks its thread."""
RESULTS: Final = Path(__file__).resolve().parent / "results" / "loop_stall.json"


def blocking_tool(args: Any) -> Any:
    """A plain def tool (a requests or boto3 call): blocks its thread, then answers."""
    time.sleep(args["block_s"])
    return {"ok": args["i"]}


class Probe:
    """Wakes every ``PROBE_S`` on the loop and records how late it woke (ms)."""

    def __init__(self) -> None:
        self.lags_ms: list[float] = []

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(PROBE_S)
            self.lags_ms.append((time.perf_counter() - started - PROBE_S) * 1000)


async def measure(dsn: str, tasks: int) -> dict[str, Any]:
    """Run ``tasks`` tasks of the blocking plan in one worker; return the probe's figures."""
    engine = await connect(dsn)
    try:
        @engine.agent(AGENT)
        async def agent(ctx: Any, task_input: Any) -> Any:
            for i, block_s in enumerate(task_input["plan"]):
                await ctx.tool(f"block-{i}", blocking_tool, {"i": i, "block_s": block_s})
            return {"calls": len(task_input["plan"])}

        for _ in range(tasks):
            await engine.submit(AGENT, {"plan": PLAN})
        probe = Probe()
        probing = asyncio.ensure_future(probe.run())
        started = time.monotonic()
        # A lease long enough that even a blocked loop keeps it: only the stall is measured.
        worker = engine.worker(concurrency=tasks, lease_ttl_ms=30_000, heartbeat_ms=250,
                               poll_ms=20)
        await worker.run(until_idle=True)
        elapsed_s = time.monotonic() - started
        probing.cancel()
        lags = sorted(probe.lags_ms)
        return {"tasks": tasks, "calls": tasks * len(PLAN), "elapsed_s": round(elapsed_s, 2),
                "probes": len(lags), "worst_lag_ms": round(lags[-1], 1),
                "p50_lag_ms": round(statistics.median(lags), 2),
                "p99_lag_ms": round(lags[int(len(lags) * 0.99)], 1)}
    finally:
        await engine.close()


async def bench_dsn(dsn: str | None) -> str:
    """``--dsn`` as given, else a database of its own on the default server, one per
    revision measured (revisions may differ in schema)."""
    if dsn:
        return dsn
    from wal_engine.store.connection import DSN_ENV, ensure_database, resolve_dsn, with_database

    server = os.environ.get(DSN_ENV) or await resolve_dsn()
    name = f"{DATABASE}_{revision()}"
    await ensure_database(server, name)
    return with_database(server, name)


def revision() -> str:
    """The git revision of the wal_engine measured."""
    import wal_engine

    where = Path(wal_engine.__file__).resolve().parent
    found = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, check=False)
    return found.stdout.strip() or "unknown"


async def main() -> int:
    """Parse the options, measure, print and write the figures."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loop_stall",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", help="PostgreSQL DSN used as given")
    parser.add_argument("--tasks", type=int, default=4, help="tasks run at once (default 4)")
    parser.add_argument("--label", default="", help="name of the revision measured")
    parser.add_argument("--json", type=Path, dest="json_path", default=RESULTS)
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args()
    figures = await measure(await bench_dsn(args.dsn), args.tasks)
    figures.update(revision=revision(), label=args.label, cores=os.cpu_count(),
                   load_average=[round(x, 2) for x in os.getloadavg()])
    print(json.dumps(figures))
    if not args.no_json:
        document = json.loads(args.json_path.read_text()) if args.json_path.exists() else {}
        document[args.label or figures["revision"]] = figures
        args.json_path.parent.mkdir(parents=True, exist_ok=True)
        args.json_path.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
