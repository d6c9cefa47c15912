"""Partitioned log vs unpartitioned log, same run (decision 70, docs/scaling.md).

``python -m benchmarks.partitioning [--tasks N] [--events M]`` starts an embedded
PostgreSQL (or borrows ``--admin-dsn``), creates two databases holding the same history:
``part_flat`` (the prefix is ``--database-prefix``) with the log's per-task tables
unpartitioned (schema version 4's layout, the version row moved to 5 so that today's code
runs on it) and ``part_month`` with schema 5 (range partitions of task ids, one month
each). Both are filled by COPY with the same
tasks (time-ordered ids, created over the last ``--months`` months, valid chains) and a
1,000-step task created 90 days ago, then measured interleaved round by round:

* ``append_new`` / ``append_old``: one tool step's two appends on a task created now and
  on the old task;
* ``read_old``: the first page (100 events) of the old task's log;
* ``resume_1000``: the read and fold of the old task (no snapshot);
* ``verify``: the verification of the old task;
* ``statement_last_event`` / ``statement_observe``: one statement alone (READ_LAST_EVENT,
  OBSERVE_ONE on the old task, prepared as the store prepares them) in blocks of 100, the
  per-statement cost of the partitions (plan-cache locks on every partition, pruning);
* ``retention_month``: what removing the oldest month's tasks costs each layout: deleting
  their rows from every per-task table (triggers off, in a transaction rolled back) against
  dropping that month's four partitions (likewise rolled back), with the rows and bytes;
* ``observe_by_partitions``: OBSERVE_ONE alone on empty databases, unpartitioned and with
  5 and 29 partitions per table (``--months-back``): what grows with their number.

Each measure's p50 and p99 on both layouts and their ratio (month/flat) are printed and
written to ``benchmarks/results/partitioning_<tasks>.json`` with the machine header and the
load average. Not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import asyncpg

from benchmarks import harness, scale
from wal_engine.embedded import EmbeddedPostgres
from wal_engine.engine import Engine, connect
from wal_engine.ids import new_task_id
from wal_engine.runtime.resume import read_state
from wal_engine.store import queries
from wal_engine.store.connection import apply_schema, schema_checksum, schema_sql

REPO: Final = Path(__file__).resolve().parents[1]
MEASURES: Final = ("append_new", "append_old", "read_old", "resume_1000", "verify")
READ_PAGE: Final = 100


def _month_starts(now: dt.datetime, months: int) -> list[dt.datetime]:
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    starts = [first]
    for _ in range(months - 1):
        starts.append((starts[-1] - dt.timedelta(days=1)).replace(day=1))
    return sorted(starts)


def flat_schema() -> str:
    """Version 5's schema with the per-task tables left unpartitioned: the same columns,
    statements and functions (decision 71's row included), so the two layouts differ only
    by partitioning. wal_ensure_partitions, which the engine's owner connections call,
    finds nothing to do there."""
    text = schema_sql().replace("PARTITION BY RANGE (task_id);", ";")
    start = text.index("DO $partitioned$")
    end = text.index("$partitioned$;", start + len("DO $partitioned$")) + len("$partitioned$;")
    text = text[:start] + text[end:]
    text = text.replace("SELECT count(*) FROM wal_ensure_partitions();", "")
    return text + """
CREATE OR REPLACE FUNCTION wal_ensure_partitions(p_months_ahead integer DEFAULT 3,
                                                 p_from timestamptz DEFAULT now())
RETURNS TABLE (partition text, rows_moved bigint)
LANGUAGE sql AS $flat$ SELECT NULL::text, 0::bigint WHERE false $flat$;
"""


async def create(admin_dsn: str, name: str, partitioned: bool,
                 months: list[dt.datetime]) -> str:
    """A new database ``name``: schema 5, partitioned or flat (``flat_schema``)."""
    dsn = await scale.new_database(admin_dsn, name)
    connection = await asyncpg.connect(dsn, server_settings={"wal.tenant": scale.TENANT})
    try:
        if partitioned:
            await apply_schema(connection)
            for start in months:
                await connection.fetch("SELECT * FROM wal_ensure_partitions(0, $1)", start)
        else:
            await connection.execute(flat_schema())
            await connection.execute(
                "UPDATE wal_schema_version SET checksum = $1 WHERE version = 5",
                schema_checksum())
    finally:
        await connection.close()
    return dsn


async def fill(dsn: str, tasks: int, events: int, now: dt.datetime, span_s: float,
               seed_ids: Sequence[str]) -> dict[str, Any]:
    """The same finished tasks in each database (ids given), and the old running task."""
    started = time.monotonic()
    filler = scale.Filler(now)
    steps = max(0, (events // max(1, tasks) - 3) // 2)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute("SET session_replication_role = replica")
        old_created = now - dt.timedelta(days=90)
        filler.task(seed_ids[0], old_created, "running", scale.OLD_STEPS)
        for index, task_id in enumerate(seed_ids[1:]):
            created = now - dt.timedelta(seconds=span_s * (1 - index / max(1, tasks)))
            filler.task(task_id, created, "done", steps)
            await filler.flush(connection)
        await filler.flush(connection, force=True)
        await connection.execute("RESET session_replication_role")
        await connection.execute("VACUUM ANALYZE")
        sizes = await connection.fetchrow(
            "SELECT pg_database_size(current_database()) AS database,"
            " (SELECT count(*) FROM wal_events) AS event_rows,"
            " (SELECT count(*) FROM wal_tasks) AS task_rows")
    finally:
        await connection.close()
    return {"fill_s": round(time.monotonic() - started, 1), "task_rows": sizes["task_rows"],
            "event_rows": sizes["event_rows"], "database_bytes": sizes["database"]}


class Layout:
    """One database under measurement."""

    def __init__(self, label: str, engine: Engine, old_task: str) -> None:
        self.label, self.engine, self.store = label, engine, engine.store
        self.old_task = old_task
        self.new_head: harness.LocalHead | None = None
        self.old_head: harness.LocalHead | None = None

    async def prepare(self) -> None:
        (self.new_head,) = await harness.create_claimed_tasks(
            self.store, [new_task_id()], worker="partitioning")
        row = await self.store.database.fetchrow(
            "SELECT seq, hash, epoch FROM wal_events WHERE tenant = $1 AND task_id = $2"
            " ORDER BY seq DESC LIMIT 1", scale.TENANT, self.old_task)
        self.old_head = harness.LocalHead(self.old_task, row["epoch"], row["seq"], row["hash"])

    async def step(self, head: harness.LocalHead, samples: list[int]) -> None:
        await scale.Side.step(self, head, samples)  # type: ignore[arg-type]

    async def measure(self, measure: str, ops: int) -> list[int]:
        samples: list[int] = []
        if measure in ("append_new", "append_old"):
            head = self.new_head if measure == "append_new" else self.old_head
            assert head is not None
            for _ in range(max(1, ops // 2)):
                await self.step(head, samples)
            return samples
        for _ in range(ops):
            start = time.perf_counter_ns()
            if measure == "read_old":
                rows = await self.store.read_events(self.old_task, limit=READ_PAGE)
                assert len(rows) == READ_PAGE
            elif measure == "resume_1000":
                await read_state(self.store, self.old_task, use_snapshot=False)
            elif measure == "verify":
                report = await self.store.verify_task(self.old_task)
                assert report.ok, report
            else:
                raise ValueError(measure)
            samples.append(time.perf_counter_ns() - start)
        return samples


async def statements(dsns: dict[str, str], old_task: str, blocks: int) -> dict[str, Any]:
    """READ_LAST_EVENT and OBSERVE_ONE alone on each layout, blocks of 100 interleaved."""
    connections = {label: await asyncpg.connect(dsn, server_settings={"wal.tenant": scale.TENANT})
                   for label, dsn in dsns.items()}
    try:
        heads: dict[str, list[Any]] = {}
        for label, connection in connections.items():
            row = await connection.fetchrow(queries.READ_LAST_EVENT, old_task)
            hashed = await connection.fetchval(
                "SELECT hash FROM wal_events WHERE task_id = $1 AND seq = $2", old_task,
                row["seq"])
            heads[label] = [int(row["epoch"]), int(row["seq"]), bytes(hashed)]
        payload = b'{"content":"' + b"x" * 400 + b'"}'
        out: dict[str, Any] = {}
        for name in ("statement_last_event", "statement_observe"):
            medians: dict[str, list[float]] = {label: [] for label in connections}
            for block in range(blocks):
                order = list(connections.items())
                for label, connection in order[block % 2:] + order[:block % 2]:
                    samples = []
                    if name == "statement_last_event":
                        prepared = await connection.prepare(queries.READ_LAST_EVENT)
                        for _ in range(100):
                            start = time.perf_counter_ns()
                            await prepared.fetch(old_task)
                            samples.append(time.perf_counter_ns() - start)
                    else:
                        prepared = await connection.prepare(queries.OBSERVE_ONE)
                        head = heads[label]
                        for _ in range(100):
                            digest = os.urandom(32)  # Not a chain: this task is not verified after.
                            start = time.perf_counter_ns()
                            rows = await prepared.fetch(
                                old_task, head[0], head[1], head[2], "message_appended", 1,
                                payload, None, digest, dt.datetime.now(dt.UTC))
                            samples.append(time.perf_counter_ns() - start)
                            assert rows, label
                            head[1], head[2] = head[1] + 1, digest
                    if block >= 2:  # The first two blocks warm the plan caches.
                        medians[label].append(statistics.median(samples) / 1000)
            figures: dict[str, Any] = {
                label: {"p50_us": round(statistics.median(values), 1),
                        "block_p50_min_us": round(min(values), 1),
                        "block_p50_max_us": round(max(values), 1)}
                for label, values in medians.items()}
            figures["p50_ratio"] = round(figures["month"]["p50_us"] / figures["flat"]["p50_us"], 3)
            out[name] = figures
            print(f"  {name}: flat p50 {figures['flat']['p50_us']} µs (blocks "
                  f"{figures['flat']['block_p50_min_us']}-{figures['flat']['block_p50_max_us']})"
                  f" | month p50 {figures['month']['p50_us']} µs (blocks "
                  f"{figures['month']['block_p50_min_us']}-{figures['month']['block_p50_max_us']})"
                  f" | month/flat {figures['p50_ratio']:.2f}x", flush=True)
        return out
    finally:
        for connection in connections.values():
            await connection.close()


async def retention_month(dsns: dict[str, str], month: dt.datetime) -> dict[str, Any]:
    """Removing one month's tasks: rows deleted (flat) against partitions dropped (month),
    each in a transaction rolled back."""
    name = month.strftime("%Y%m")
    out: dict[str, Any] = {}
    for label, dsn in dsns.items():
        connection = await asyncpg.connect(dsn, server_settings={"wal.tenant": scale.TENANT})
        try:
            bounds = (await connection.fetchval("SELECT wal_partition_bound($1)", name)
                      if label == "month" else
                      "t-" + f"{int(month.timestamp() * 1000):012x}")
            following = (month + dt.timedelta(days=32)).replace(day=1)
            upper = "t-" + f"{int(following.timestamp() * 1000):012x}"
            rows = await connection.fetchval(
                "SELECT count(*) FROM wal_events WHERE task_id >= $1 AND task_id < $2",
                bounds, upper)
            transaction = connection.transaction()
            await transaction.start()
            start = time.perf_counter()
            if label == "flat":
                await connection.execute("SET LOCAL session_replication_role = replica")
                for table in ("wal_blobs", "wal_snapshot_segments", "wal_snapshots",
                              "wal_events"):
                    await connection.execute(
                        f"DELETE FROM {table} WHERE task_id >= $1 AND task_id < $2",
                        bounds, upper)
            else:
                for table in ("wal_blobs", "wal_snapshot_segments", "wal_snapshots",
                              "wal_events"):
                    await connection.execute(f"DROP TABLE {table}_p{name}")
            elapsed = time.perf_counter() - start
            await transaction.rollback()
        finally:
            await connection.close()
        out[label] = {"events": rows, "seconds": round(elapsed, 3)}
    out["ratio"] = round(out["month"]["seconds"] / max(1e-6, out["flat"]["seconds"]), 4)
    print(f"  retention_month {name}: flat deletes {out['flat']['events']:,} events' rows in"
          f" {out['flat']['seconds']} s | month drops its partitions in"
          f" {out['month']['seconds']} s", flush=True)
    return out


async def partition_counts(admin_dsn: str, prefix: str, months_back: list[int],
                           blocks: int) -> dict[str, Any]:
    """OBSERVE_ONE alone (blocks of 100, interleaved) on a fresh task of an empty database
    of each layout: unpartitioned, and partitioned with the default partitions and this
    month and the three after it plus ``months_back`` past months: whether the append's
    cost grows with the number of partitions."""
    now = dt.datetime.now(dt.UTC)
    sides: dict[str, tuple[asyncpg.Connection, list[Any]]] = {}
    try:
        for back in [-1, *months_back]:
            months = _month_starts(now, back + 1) if back >= 0 else []
            label = "flat" if back < 0 else f"partitions_{len(months) + 4}"
            dsn = await create(admin_dsn, f"{prefix}_{label}", back >= 0, months)
            engine = await connect(dsn, migrate=False, development=True)
            try:
                (claimed,) = await harness.create_claimed_tasks(
                    engine.store, [new_task_id()], worker="partitioning")
            finally:
                await engine.close()
            connection = await asyncpg.connect(dsn, server_settings={"wal.tenant": scale.TENANT})
            sides[label] = (connection, [claimed.task_id, claimed.epoch, claimed.seq,
                                         claimed.hash])
        payload = b'{"content":"' + b"x" * 400 + b'"}'
        medians: dict[str, list[float]] = {label: [] for label in sides}
        for block in range(blocks):
            order = list(sides.items())
            shift = block % len(order)
            for label, (connection, head) in order[shift:] + order[:shift]:
                prepared = await connection.prepare(queries.OBSERVE_ONE)
                samples = []
                for _ in range(100):
                    digest = os.urandom(32)
                    start = time.perf_counter_ns()
                    rows = await prepared.fetch(head[0], head[1], head[2], head[3],
                                                "message_appended", 1, payload, None, digest,
                                                dt.datetime.now(dt.UTC))
                    samples.append(time.perf_counter_ns() - start)
                    assert rows, label
                    head[2], head[3] = head[2] + 1, digest
                if block >= len(order):  # The first round of blocks warms the plans.
                    medians[label].append(statistics.median(samples) / 1000)
    finally:
        for connection, _ in sides.values():
            await connection.close()
    flat = statistics.median(medians["flat"])
    out: dict[str, Any] = {}
    for label, values in medians.items():
        out[label] = {"p50_us": round(statistics.median(values), 1),
                      "block_p50_min_us": round(min(values), 1),
                      "block_p50_max_us": round(max(values), 1),
                      "vs_flat": round(statistics.median(values) / flat, 3)}
        print(f"  observe_one {label}: p50 {out[label]['p50_us']} µs (blocks "
              f"{out[label]['block_p50_min_us']}-{out[label]['block_p50_max_us']}),"
              f" {out[label]['vs_flat']:.2f}x flat", flush=True)
    return out


def _stats(samples: list[int]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50_us": round(statistics.median(ordered) / 1000, 1),
            "p99_us": round(harness.percentile(ordered, 99) / 1000, 1)}


async def measure_all(layouts: list[Layout], rounds: int, ops: int) -> dict[str, Any]:
    """Every measure on both layouts, interleaved; round r starts with layout r mod 2."""
    out: dict[str, Any] = {}
    for measure in MEASURES:
        per: dict[str, list[int]] = {layout.label: [] for layout in layouts}
        rounds_p50: dict[str, list[float]] = {layout.label: [] for layout in layouts}
        count = max(3, ops // 10) if measure in ("resume_1000", "verify") else ops
        for index in range(rounds):
            for layout in layouts[index % 2:] + layouts[:index % 2]:
                await layout.measure(measure, 2)
                samples = await layout.measure(measure, count)
                per[layout.label].extend(samples)
                rounds_p50[layout.label].append(statistics.median(samples) / 1000)
        figures: dict[str, Any] = {label: _stats(samples) for label, samples in per.items()}
        for label, values in rounds_p50.items():
            figures[label]["round_p50_us"] = [round(value, 1) for value in values]
        figures["p50_ratio"] = round(figures["month"]["p50_us"] / figures["flat"]["p50_us"], 3)
        out[measure] = figures
        print(f"  {measure}: flat p50 {figures['flat']['p50_us']:,.0f} µs p99 "
              f"{figures['flat']['p99_us']:,.0f} µs (rounds {figures['flat']['round_p50_us']})"
              f" | month p50 {figures['month']['p50_us']:,.0f} µs p99 "
              f"{figures['month']['p99_us']:,.0f} µs (rounds {figures['month']['round_p50_us']})"
              f" | month/flat p50 {figures['p50_ratio']:.2f}x", flush=True)
    return out


async def run(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC)
    months = _month_starts(now, args.months)
    span_s = (now - months[0]).total_seconds()
    ids = [new_task_id(int((now - dt.timedelta(days=90)).timestamp() * 1000))]
    ids += [new_task_id(int((now - dt.timedelta(seconds=span_s * (1 - i / args.tasks)))
                            .timestamp() * 1000)) for i in range(args.tasks)]
    print(f"filling two databases: {args.tasks:,} finished tasks over {args.months} months,"
          f" ~{args.events:,} events, and a {scale.OLD_STEPS}-step task", flush=True)
    fills: dict[str, Any] = {}
    dsns: dict[str, str] = {}
    for label, partitioned in (("flat", False), ("month", True)):
        dsns[label] = await create(admin_dsn, f"{args.database_prefix}_{label}", partitioned,
                                   months)
        fills[label] = await fill(dsns[label], args.tasks, args.events, now, span_s, ids)
        print(f"  {label}: {fills[label]}", flush=True)
    machine = await harness.describe_machine(dsns["flat"])
    engines = [await connect(dsns[label], migrate=False, development=True)
               for label in ("flat", "month")]
    try:
        layouts = [Layout(label, engine, ids[0])
                   for label, engine in zip(("flat", "month"), engines, strict=True)]
        for layout in layouts:
            await layout.prepare()
        print(f"measures ({args.rounds} rounds, {args.ops} ops per round and layout), load"
              f" average {os.getloadavg()}:", flush=True)
        results = await measure_all(layouts, args.rounds, args.ops)
    finally:
        for engine in engines:
            await engine.close()
    results.update(await statements(dsns, ids[0], args.blocks))
    results["retention_month"] = await retention_month(dsns, months[0])
    if args.months_back:
        print(f"observe_one by number of partitions ({args.blocks} blocks of 100), load"
              f" average {os.getloadavg()}:", flush=True)
        results["observe_by_partitions"] = await partition_counts(
            admin_dsn, f"{args.database_prefix}_count", args.months_back, args.blocks)
    return {"benchmark": "partitioning", "machine": machine, "settings": vars(args),
            "load_average_after": os.getloadavg(), "fill": fills, "latencies": results}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.partitioning",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=150_000)
    parser.add_argument("--events", type=int, default=1_500_000)
    parser.add_argument("--months", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=30, help="statement blocks of 100")
    parser.add_argument("--admin-dsn", default=None)
    parser.add_argument("--months-back", type=lambda text: [int(x) for x in text.split(",")],
                        default=[0, 24], help="past months of the partition-count study"
                        " (comma-separated; empty databases), '' to skip it")
    parser.add_argument("--database-prefix", default="part",
                        help="the databases are <prefix>_flat and <prefix>_month")
    parser.add_argument("--json", dest="json_path", default=None)
    return parser.parse_args(argv)


async def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Both databases filled and measured, on ``--admin-dsn`` or a server of its own."""
    if args.admin_dsn:
        return await run(args, args.admin_dsn)
    with tempfile.TemporaryDirectory(prefix="wal-part-", dir="/tmp") as root:
        server = EmbeddedPostgres(Path(root) / "pgdata", fsync=False)
        try:
            return await run(args, await asyncio.to_thread(server.ensure_running))
        finally:
            server.stop()


def main(args: argparse.Namespace) -> int:
    document = asyncio.run(collect(args))
    path = Path(args.json_path or REPO / "benchmarks" / "results"
                / f"partitioning_{args.tasks}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(parse()))
