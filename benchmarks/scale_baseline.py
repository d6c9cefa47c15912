"""Before and after a schema change, in the same run (issue 23, decision 74).

``python -m benchmarks.scale_baseline --ref REF`` starts its own embedded PostgreSQL (or
borrows ``--admin-dsn``), creates two databases filled alike by :func:`benchmarks.scale.fill`
(``--tasks``, ``--events``), ``<prefix>_after`` with this checkout's schema and
``<prefix>_before`` with the schema of git revision ``REF`` applied over it (its indexes
and functions put back), and measures, interleaved round by round with the order swapped
each round: the heartbeat statement for 1, 100 and 1,000 leases, the sweeper's idle
statement, a claim, a page of the task listing (finished tasks; running tasks), and the
wake-up of ``--timers`` timers with 4 worker processes (:func:`benchmarks.scale.timers`,
three times per side: before, after, after, before, before, after; with the CPU seconds
the server and the workers spent on it, steadier than its time on a shared machine). The
measures of the 'before' side run ``REF``'s text of the statements they time
(``STATEMENTS``, from its ``wal_engine/store/queries.py``); the timers' worker processes
run this checkout's code on both sides (their claim is ``wal_claim_tasks``, the
schema's). Results go to
``benchmarks/results/scale_baseline_<tasks>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import asyncpg

from benchmarks import harness, scale
from wal_engine.embedded import EmbeddedPostgres
from wal_engine.engine import connect
from wal_engine.store import queries

STATEMENTS: Final = ("RENEW_LEASES", "LIST_TASKS", "CLAIM_TASKS", "BREAK_LEASES")
MEASURES: Final = ("heartbeat_1", "heartbeat_100", "heartbeat_1000", "sweep_idle", "claim",
                   "claim_other", "list_page", "list_running")


def file_at(ref: str, path: str) -> str:
    """A file of the repository as of git revision ``ref``."""
    return subprocess.run(["git", "show", f"{ref}:{path}"], cwd=scale.REPO, check=True,
                          capture_output=True, text=True).stdout


def statements_at(ref: str) -> dict[str, Any]:
    """``STATEMENTS`` as ``ref``'s queries module defines them (it imports only typing)."""
    namespace: dict[str, Any] = {"__name__": "queries_at_ref"}
    exec(compile(file_at(ref, "wal_engine/store/queries.py"), "queries_at_ref", "exec"),
         namespace)
    return {name: namespace[name] for name in STATEMENTS}


async def measure_with(statements: dict[str, Any], side: scale.Side, measure: str,
                       ops: int) -> list[int]:
    """:func:`benchmarks.scale.measure_side` with ``statements`` in place of the module's."""
    saved = {name: getattr(queries, name) for name in statements}
    for name, text in statements.items():
        setattr(queries, name, text)
    try:
        return await scale.measure_side(side, measure, ops)
    finally:
        for name, text in saved.items():
            setattr(queries, name, text)


async def run(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    labels = ("before", "after")
    dsns = {label: await scale.create_database(admin_dsn, f"{args.database_prefix}_{label}")
            for label in labels}
    claims = args.rounds * (args.ops + 2) + 10
    fills = {}
    for label in labels:
        fills[label] = await scale.fill(dsns[label], args.tasks, args.events,
                                        queued=max(claims, min(100_000, args.tasks // 10)))
        print(f"  {label}: {fills[label]['task_rows']:,} tasks,"
              f" {fills[label]['event_rows']:,} events, fill {fills[label]['fill_s']} s",
              flush=True)
    connection = await asyncpg.connect(dsns["before"])
    try:
        before_schema = file_at(args.ref, "schema.sql")
        await connection.execute(before_schema)
        # The indexes this checkout added, which REF's text does not drop: without them the
        # 'before' database writes the indexes REF's does, no more.
        kept = set(re.findall(r"CREATE (?:UNIQUE )?INDEX IF NOT EXISTS (\w+)", before_schema))
        extra = [row["name"] for row in await connection.fetch(
            "SELECT c.relname AS name FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_class t ON t.oid = i.indrelid WHERE t.relname LIKE 'wal\\_%'"
            " AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid)")
            if row["name"] not in kept]
        for name in extra:
            await connection.execute(f'DROP INDEX "{name}"')
        print(f"  before: {args.ref}'s schema applied, indexes it lacks dropped: {extra}",
              flush=True)
    finally:
        await connection.close()
    engines = {label: await connect(dsns[label], migrate=False, development=True)
               for label in labels}
    document: dict[str, Any] = {"benchmark": "scale_baseline", "ref": args.ref,
                                "machine": await harness.describe_machine(dsns["after"]),
                                "settings": {k: v for k, v in vars(args).items()},
                                "fill": fills}
    try:
        sides = [scale.Side(label, dsns[label], engines[label]) for label in labels]
        for engine in engines.values():
            scale.register(engine)
        for side in sides:
            await side.prepare()
        document["settle_s"] = await scale.settle(
            admin_dsn, [f"{args.database_prefix}_{label}" for label in labels], args.timeout)
        document["latencies"] = {}
        before_statements = statements_at(args.ref)
        for measure in MEASURES:
            samples: dict[str, list[int]] = {label: [] for label in labels}
            for round_index in range(args.rounds):
                order = sides if round_index % 2 == 0 else sides[::-1]
                for side in order:
                    texts = before_statements if side.label == "before" else {}
                    await measure_with(texts, side, measure, 2)
                    samples[side.label].extend(await measure_with(texts, side, measure,
                                                                  args.ops))
            figures: dict[str, Any] = {label: scale._stats(samples[label]) for label in labels}
            figures["after_over_before"] = round(
                figures["after"]["p50_us"] / max(0.1, figures["before"]["p50_us"]), 2)
            document["latencies"][measure] = figures
            print(f"  {measure}: before p50 {figures['before']['p50_us']:,.0f} µs, after"
                  f" {figures['after']['p50_us']:,.0f} µs ({figures['after_over_before']}x)",
                  flush=True)
        document["load_average_after_latencies"] = [round(x, 2) for x in os.getloadavg()]
        if args.timers:
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
            for side in (sides[0], sides[1], sides[1], sides[0], sides[0], sides[1]):
                figures = await scale.timers(side, args.timers, args.timeout)
                figures["load_average"] = [round(x, 2) for x in os.getloadavg()]
                runs[side.label].append(figures)
                print(f"  timers {side.label}: {figures}", flush=True)
            document["timers"] = runs
    finally:
        for engine in engines.values():
            await engine.close()
    return document


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_baseline",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ref", default="main", help="git revision of the 'before' schema")
    parser.add_argument("--tasks", type=int, default=200_000)
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ops", type=int, default=100)
    parser.add_argument("--timers", type=int, default=10_000, help="0 skips the timers")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--admin-dsn", help="use this server instead of starting one")
    parser.add_argument("--database-prefix", default="scale_baseline")
    parser.add_argument("--json", type=Path, dest="json_path")
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    root: Path | None = None
    server: EmbeddedPostgres | None = None
    try:
        if args.admin_dsn:
            admin_dsn = args.admin_dsn
        else:
            root = Path(tempfile.mkdtemp(prefix="wal-scale-baseline-", dir="/var/tmp"))
            server = EmbeddedPostgres(root / "pgdata", fsync=False)
            admin_dsn = await asyncio.to_thread(server.ensure_running)
        document = await run(args, admin_dsn)
    finally:
        if server is not None:
            server.stop("fast")
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    target = args.json_path or harness.RESULTS_DIR / f"scale_baseline_{args.tasks}.json"
    target.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    arguments = parse()
    started = time.monotonic()
    harness.run_main(lambda: main(arguments))
