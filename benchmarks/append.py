"""Appends: wal-engine's fenced, hash-chained append against a raw asyncpg INSERT.

Workloads (each interleaved in rounds with its raw reference, same run, same server):

* ``single``: one event per append on one task (``Store.append_events``, head kept locally
  from the AppendResult like a worker) vs one prepared ``INSERT`` of an equally sized row
  into a bare table with a primary key, one commit each. Target: p50 within 1.3x.
* ``batch10``: ten events per append vs a ten-row multi-VALUES ``INSERT``.
* ``group64``: ``Store.append_many`` of 64 tasks, one event each, one commit, vs one
  64-row ``INSERT`` (the reference), vs 64 one-row ``INSERT`` commits issued concurrently on
  64 connections, vs 64 concurrent ``append_events`` on 64 connections.

Both sides go through an asyncpg pool of the same settings and asyncpg's prepared
statement cache. Rows are equally sized (``pg_column_size`` of both is printed after the
table): the raw payload is the event's payload plus the bytes of the columns the raw table
lacks (version, epoch, prev_hash, recorded_at).

Usage: ``python -m benchmarks.append [--dsn DSN] [--quick] [--rounds N] [--ops N]
[--only single,batch10,group64]``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import asyncpg

from benchmarks import harness
from wal_engine import events as vocabulary
from wal_engine import limits
from wal_engine.store import Database, PendingAppend, Store

NAME: Final = "append"
PAYLOAD_BYTES: Final = 500
"""Encoded size of the benchmark's MessageAppended payload."""
RAW_PADDING_BYTES: Final = 67
"""Bytes the raw payload carries beyond the event's, so both rows have the same size:
version, epoch, prev_hash, recorded_at and alignment, as measured by
``pg_column_size`` (printed after each run)."""
BATCH_EVENTS: Final = 10
GROUP_TASKS: Final = 64
BENCH_WORKER: Final = "bench-append"

CREATE_RAW_TABLE: Final = """
CREATE TABLE IF NOT EXISTS bench_raw_events (
    task_id text NOT NULL,
    seq     bigint NOT NULL,
    type    text NOT NULL,
    payload bytea NOT NULL,
    hash    bytea NOT NULL,
    PRIMARY KEY (task_id, seq)
)
"""

ROW_BYTES: Final = """
SELECT (SELECT avg(pg_column_size(e.*)) FROM wal_events e
         WHERE e.task_id = ANY($1::text[]) AND e.type = 'message_appended') AS wal_events,
       (SELECT avg(pg_column_size(r.*)) FROM bench_raw_events r
         WHERE r.task_id = ANY($2::text[])) AS raw
"""


def raw_insert(rows: int) -> str:
    """A multi-VALUES INSERT of ``rows`` rows into the raw table (placeholders only)."""
    values = ", ".join(
        f"(${5 * i + 1}, ${5 * i + 2}, ${5 * i + 3}, ${5 * i + 4}, ${5 * i + 5})"
        for i in range(rows)
    )
    return f"INSERT INTO bench_raw_events (task_id, seq, type, payload, hash) VALUES {values}"


RAW_INSERT_ONE: Final = raw_insert(1)
RAW_INSERT_BATCH: Final = raw_insert(BATCH_EVENTS)
RAW_INSERT_GROUP: Final = raw_insert(GROUP_TASKS)


def message_content() -> str:
    """Deterministic prose-like text whose event payload encodes to PAYLOAD_BYTES bytes."""
    empty = vocabulary.encode_event(vocabulary.MessageAppended(role="assistant", content=""))[2]
    words = random.Random(7).choices(
        ["the", "tool", "returned", "forecast", "for", "Lisbon", "tomorrow", "with", "rain",
         "and", "wind", "of", "km/h", "so", "plan", "indoor", "visit", "museum", "at", "ten"],
        k=400,
    )
    content = " ".join(words)[: PAYLOAD_BYTES - len(empty)]
    message = vocabulary.MessageAppended(role="assistant", content=content)
    assert len(vocabulary.encode_event(message)[2]) == PAYLOAD_BYTES
    return content


class RawStream:
    """The raw side's stand-in for a task: a task id and its next seq."""

    __slots__ = ("next_seq", "task_id")

    def __init__(self, task_id: str) -> None:
        self.task_id, self.next_seq = task_id, 1

    def rows(self, count: int, payload: bytes, digest: bytes) -> list[Any]:
        """Flat INSERT arguments for the next ``count`` rows."""
        args: list[Any] = []
        for seq in range(self.next_seq, self.next_seq + count):
            args += [self.task_id, seq, "message_appended", payload, digest]
        self.next_seq += count
        return args


class Bench:
    """Everything the workloads share: pools, payloads, task ids of this run."""

    def __init__(self, store: Store, raw_pool: asyncpg.Pool, run_id: str) -> None:
        self.store = store
        self.raw_pool = raw_pool
        self.run_id = run_id
        self.content = message_content()
        payload = vocabulary.encode_event(self.message())[2]
        self.raw_payload = payload + b"p" * RAW_PADDING_BYTES
        self.raw_hash = os.urandom(32)
        self.heads: list[harness.LocalHead] = []
        self.streams: list[RawStream] = []

    def task_id(self, side: str, name: str) -> str:
        """Equal-length ids for both sides, unique to this run."""
        return f"{side}-{name}-{self.run_id}"

    def message(self) -> vocabulary.MessageAppended:
        """A fresh event, built per append like a worker builds it."""
        return vocabulary.MessageAppended(role="assistant", content=self.content)

    def stream(self, name: str) -> RawStream:
        """A raw stream of this run (its rows are measured for the row-size line)."""
        stream = RawStream(self.task_id("raw", name))
        self.streams.append(stream)
        return stream

    async def row_bytes(self) -> dict[str, float | None]:
        """Average stored row size of this run's events on both sides (pg_column_size)."""
        row = await self.store.database.fetchrow(
            ROW_BYTES, [h.task_id for h in self.heads], [s.task_id for s in self.streams]
        )
        return {name: None if row[name] is None else float(row[name])
                for name in ("wal_events", "raw")}

    async def create_heads(self, task_ids: list[str]) -> list[harness.LocalHead]:
        """Create and claim the tasks (RUNNING, epoch 1); return their heads."""
        heads = await harness.create_claimed_tasks(self.store, task_ids, worker=BENCH_WORKER)
        self.heads += heads
        return heads

    async def complete_all(self) -> None:
        """Finish this run's tasks (COMPLETED), so the benchmark database holds no live task."""
        await harness.complete_tasks(self.store, self.heads)

    # ------------------------------------------------------------------ wal-engine operations

    def append_events(self, head: harness.LocalHead, count: int) -> Callable[[], Awaitable[None]]:
        """``count`` events per fenced append on one task; the head is kept from the result."""
        store = self.store

        async def operation() -> None:
            events = [self.message() for _ in range(count)]
            result = await store.append_events(
                head.task_id, events, epoch=head.epoch, expected_seq=head.seq,
                prev_hash=head.hash,
            )
            head.seq, head.hash = result.head_seq, result.head_hash

        return operation

    def append_many(self, heads: list[harness.LocalHead]) -> Callable[[], Awaitable[None]]:
        """One group commit: one event for each of ``heads``."""

        async def operation() -> None:
            pending = [
                PendingAppend(task_id=h.task_id, epoch=h.epoch, expected_seq=h.seq,
                              prev_hash=h.hash, events=[self.message()])
                for h in heads
            ]
            results = await self.store.append_many(pending)
            for head in heads:
                result = results[head.task_id]
                if isinstance(result, Exception):
                    raise result
                head.seq, head.hash = result.head_seq, result.head_hash

        return operation

    def append_concurrently(
        self, heads: list[harness.LocalHead]
    ) -> Callable[[], Awaitable[None]]:
        """One event for each of ``heads``, as concurrent single appends on separate connections."""
        appends = [self.append_events(head, 1) for head in heads]

        async def operation() -> None:
            await asyncio.gather(*(append() for append in appends))

        return operation

    # ------------------------------------------------------------------ raw operations

    def raw_insert(
        self, stream: RawStream, query: str, count: int
    ) -> Callable[[], Awaitable[None]]:
        """One prepared INSERT of ``count`` rows (``query``), one commit."""
        pool = self.raw_pool

        async def operation() -> None:
            args = stream.rows(count, self.raw_payload, self.raw_hash)
            async with pool.acquire() as connection:
                await connection.execute(query, *args)

        return operation

    def raw_insert_group(self, streams: list[RawStream]) -> Callable[[], Awaitable[None]]:
        """One INSERT of one row for each of ``streams``, one commit."""
        pool = self.raw_pool

        async def operation() -> None:
            args: list[Any] = []
            for stream in streams:
                args += stream.rows(1, self.raw_payload, self.raw_hash)
            async with pool.acquire() as connection:
                await connection.execute(RAW_INSERT_GROUP, *args)

        return operation

    def raw_insert_concurrently(self, streams: list[RawStream]) -> Callable[[], Awaitable[None]]:
        """One-row INSERT commits for each of ``streams``, concurrent on separate connections."""
        inserts = [self.raw_insert(stream, RAW_INSERT_ONE, 1) for stream in streams]

        async def operation() -> None:
            await asyncio.gather(*(insert() for insert in inserts))

        return operation


# ----------------------------------------------------------------------------- workloads


async def single_workload(bench: Bench, ops: int) -> harness.Workload:
    (head,) = await bench.create_heads([bench.task_id("wal", "single")])
    stream = bench.stream("single")
    return harness.Workload(
        name="single",
        description=f"one {PAYLOAD_BYTES}-byte event per append, sequential, one task",
        ops_per_round=ops,
        contenders=[
            harness.Contender("raw INSERT 1 row", bench.raw_insert(stream, RAW_INSERT_ONE, 1),
                              reference=True),
            harness.Contender("wal-engine append_events", bench.append_events(head, 1)),
        ],
    )


async def batch_workload(bench: Bench, ops: int) -> harness.Workload:
    (head,) = await bench.create_heads([bench.task_id("wal", "batch")])
    stream = bench.stream("batch")
    return harness.Workload(
        name=f"batch{BATCH_EVENTS}",
        description=f"{BATCH_EVENTS} events per append (one commit), sequential, one task",
        ops_per_round=ops,
        contenders=[
            harness.Contender(
                f"raw INSERT {BATCH_EVENTS} rows",
                bench.raw_insert(stream, RAW_INSERT_BATCH, BATCH_EVENTS),
                events_per_op=BATCH_EVENTS, reference=True,
            ),
            harness.Contender(
                "wal-engine append_events", bench.append_events(head, BATCH_EVENTS),
                events_per_op=BATCH_EVENTS,
            ),
        ],
    )


async def group_workload(bench: Bench, ops: int) -> harness.Workload:
    many = await bench.create_heads(
        [bench.task_id("wal", f"gm{i:02d}") for i in range(GROUP_TASKS)]
    )
    concurrent = await bench.create_heads(
        [bench.task_id("wal", f"gc{i:02d}") for i in range(GROUP_TASKS)]
    )
    group_streams = [bench.stream(f"gm{i:02d}") for i in range(GROUP_TASKS)]
    concurrent_streams = [bench.stream(f"gc{i:02d}") for i in range(GROUP_TASKS)]
    n = GROUP_TASKS
    return harness.Workload(
        name=f"group{n}",
        description=f"{n} tasks x one event, per operation (events/s counts all {n})",
        ops_per_round=ops,
        contenders=[
            harness.Contender(f"raw INSERT {n} rows, 1 commit",
                              bench.raw_insert_group(group_streams),
                              events_per_op=n, reference=True),
            harness.Contender(f"wal-engine append_many ({n} tasks)", bench.append_many(many),
                              events_per_op=n),
            harness.Contender(f"raw INSERT x{n} concurrent commits",
                              bench.raw_insert_concurrently(concurrent_streams),
                              events_per_op=n),
            harness.Contender(f"wal-engine append_events x{n} concurrent",
                              bench.append_concurrently(concurrent), events_per_op=n),
        ],
    )


# ----------------------------------------------------------------------------- main


async def open_pools(dsn: str) -> tuple[Store, asyncpg.Pool]:
    """The store (schema applied) and a raw pool with the same settings."""
    database = await Database.open(dsn, max_size=GROUP_TASKS, application_name="bench:wal")
    raw_pool = await asyncpg.create_pool(
        dsn, min_size=limits.pool_size_min, max_size=GROUP_TASKS,
        timeout=limits.connect_timeout_s, command_timeout=limits.command_timeout_s,
        server_settings={"application_name": "bench:raw"}, reset=harness.no_session_reset,
    )
    async with raw_pool.acquire() as connection:
        await connection.execute(CREATE_RAW_TABLE)
    return Store(database), raw_pool


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=40, ops=50)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=8)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    store, raw_pool = await open_pools(dsn)
    try:
        machine = await harness.describe_machine(dsn)
        bench = Bench(store, raw_pool, run_id=f"{time.strftime('%m%d%H%M%S')}-{os.getpid()}")
        builders = {
            "single": lambda: single_workload(bench, settings.ops),
            f"batch{BATCH_EVENTS}": lambda: batch_workload(bench, settings.ops),
            f"group{GROUP_TASKS}": lambda: group_workload(bench, max(2, settings.ops // 4)),
        }
        workloads = [await builders[name]() for name in harness.selected(list(builders), args)]
        results = [
            await harness.run_workload(workload, rounds=settings.rounds) for workload in workloads
        ]
        row_bytes = await bench.row_bytes()
        await bench.complete_all()
    finally:
        await raw_pool.close()
        await store.database.close()
    print(harness.format_report(NAME, machine, results, settings))
    print(f"Row bytes (pg_column_size, avg): wal_events {row_bytes['wal_events']:.0f}, "
          f"raw {row_bytes['raw']:.0f}. Target: single p50 vs raw <= 1.30x.")
    if not args.no_json:
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path,
                                  extra={"row_bytes": row_bytes})
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
