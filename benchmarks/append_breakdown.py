"""Where a single append's time goes: statement variants and pool settings, interleaved.

Not a contest but a profile: each contender adds or removes one ingredient of
``Store.append_events`` so that the difference between two rows of the table is the cost of
that ingredient, measured in the same run. One event of 500 bytes per operation, one commit
each, sequential.

* direct connection (no pool), prepared statements: the raw INSERT (reference); the event row
  alone (scalar VALUES, then ``unnest`` arrays; then into a copy of the table with the CHECK
  constraints it had before decision 28 of ``docs/architecture.md``); the fence alone (the
  predecessor probe of an observation, as a read); the store's one-observation statement
  (``OBSERVE_ONE``) without and with its ``RETURNING``;
* through a pool: the raw INSERT, ``Store.append_events``, and ``Store.append_events`` on a
  pool whose reset-on-release is a no-op (asyncpg's default reset runs one more statement,
  ``RESET ALL`` and friends, after every release: a second round trip per append).

It writes rows that bypass the task head, so it runs in its own scratch database
(``wal_bench_breakdown`` on the server of ``--dsn``, ``WAL_ENGINE_DSN`` or the embedded server).

Usage: ``python -m benchmarks.append_breakdown [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import asyncpg

from benchmarks import append, harness
from wal_engine import events as vocabulary
from wal_engine import limits
from wal_engine.store import Database, Store, queries
from wal_engine.store.connection import (
    DSN_ENV,
    ensure_database,
    resolve_dsn,
    session_settings,
    with_database,
)

# Connections opened here are bound to the default tenant, like an engine's (the tables
# take the tenant from the session).
TENANT_SETTINGS: Final = session_settings("default", "bench:breakdown")

NAME: Final = "append_breakdown"
SCRATCH_DATABASE: Final = "wal_bench_breakdown"

CREATE_HEAD: Final = """
INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash, lease_epoch)
VALUES ($1, 'bench', 'RUNNING', 0, $2, 1)
"""

EVENT_VALUES: Final = """
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key, hash)
VALUES ($1, $2 + 1, $3, $4, $5, $6, $7, $8)
"""

EVENT_UNNEST: Final = """
INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, idempotency_key, hash)
SELECT $1, $2 + e.ord, e.type, e.version, $3, e.payload, e.idempotency_key, e.hash
  FROM unnest($4::text[], $5::int2[], $6::bytea[], $7::text[], $8::bytea[])
       WITH ORDINALITY AS e(type, version, payload, idempotency_key, hash, ord)
"""

# A copy of wal_events with six of the seven CHECK constraints it had before decision 28 of
# docs/architecture.md: what they cost per insert (PostgreSQL rebuilds check expressions
# at each inserting statement).
CHECKED_TABLE: Final = "bench_events_checked"
CREATE_CHECKED: Final = f"""
CREATE TABLE IF NOT EXISTS {CHECKED_TABLE} (
    LIKE wal_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES,
    CHECK (length(tenant) BETWEEN 1 AND 64), CHECK (seq >= 1),
    CHECK (length(type) BETWEEN 1 AND 64), CHECK (version >= 1), CHECK (epoch >= 0),
    CHECK (octet_length(hash) = 32)
)
"""
CHECKED_VALUES: Final = EVENT_VALUES.replace("INSERT INTO wal_events",
                                             f"INSERT INTO {CHECKED_TABLE}")

# A copy of wal_events without its one CHECK (wal_events_bounds, decision 39): what that
# check costs per insert.
UNCHECKED_TABLE: Final = "bench_events_unchecked"
CREATE_UNCHECKED: Final = f"""
CREATE TABLE IF NOT EXISTS {UNCHECKED_TABLE} (
    LIKE wal_events INCLUDING DEFAULTS INCLUDING INDEXES
)
"""
UNCHECKED_VALUES: Final = EVENT_VALUES.replace("INSERT INTO wal_events",
                                               f"INSERT INTO {UNCHECKED_TABLE}")

# The store's observation statement (queries.OBSERVE_ONE) without RETURNING: what reading
# back the inserted row costs.
OBSERVE_ONE_NO_RETURNING: Final = queries.OBSERVE_ONE.replace("RETURNING seq", "")

# The fence alone: the predecessor probe of queries.OBSERVE_ONE, as a read.
FENCE_PROBE: Final = f"SELECT EXISTS ({queries.PREVIOUS_OK_LEASED})"

EVENT_TYPE: Final = "message_appended"

# The database-side append that issue 16 asked to measure (docs/architecture.md, decision
# 30): one task's observations, fenced on the task row (lease epoch, leased status) and on
# the event they follow (seq, hash, epoch, not terminal, lease not dropped), capped (events
# per task, payload bytes, payloads that are UTF-8 JSON objects) and hashed in SQL (chain
# version 2, database clock). Created in the scratch database only, SECURITY DEFINER with
# a fixed search_path as security.sql would make it, so a call pays what it would pay.
DATABASE_APPEND_FUNCTION: Final = """CREATE OR REPLACE FUNCTION bench_append_observations(
    p_task_id text, p_epoch bigint, p_expected_seq bigint, p_prev_hash bytea,
    p_types text[], p_versions smallint[], p_payloads bytea[], p_keys text[]
) RETURNS TABLE (seq bigint, hash bytea)
LANGUAGE plpgsql AS $$
DECLARE
    my_tenant text := current_setting('wal.tenant', true);
    task record;
    previous record;
    total integer := cardinality(p_types);
    stamp timestamptz := now();
    hashes bytea[] := ARRAY[]::bytea[];
    link bytea := p_prev_hash;
    i integer;
BEGIN
    SELECT t.status, t.lease_epoch INTO task FROM wal_tasks t
     WHERE t.tenant = my_tenant AND t.task_id = p_task_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'unknown task %', p_task_id USING ERRCODE = 'WE004';
    END IF;
    IF task.lease_epoch <> p_epoch OR task.status NOT IN ('RUNNING', 'CHECKPOINTED') THEN
        RAISE EXCEPTION 'task % is not leased at epoch %', p_task_id, p_epoch
            USING ERRCODE = 'WE006';
    END IF;
    SELECT p.hash, p.type, p.epoch INTO previous FROM wal_events p
     WHERE p.tenant = my_tenant AND p.task_id = p_task_id AND p.seq = p_expected_seq;
    IF NOT FOUND OR previous.hash <> p_prev_hash OR previous.epoch <> p_epoch THEN
        RAISE EXCEPTION 'task % head is not seq %', p_task_id, p_expected_seq
            USING ERRCODE = 'WE007';
    END IF;
    IF previous.type IN ('task_completed', 'task_failed', 'task_cancelled',
                         'signal_awaited', 'timer_started', 'task_released') THEN
        RAISE EXCEPTION 'task % takes no observation after %', p_task_id, previous.type
            USING ERRCODE = 'WE006';
    END IF;
    IF total < 1 OR total > 1000 OR p_expected_seq + total > 10000000 THEN
        RAISE EXCEPTION 'task % would exceed its events', p_task_id USING ERRCODE = 'WE008';
    END IF;
    FOR i IN 1 .. total LOOP
        IF octet_length(p_payloads[i]) > 16777216
           OR jsonb_typeof(convert_from(p_payloads[i], 'UTF8')::jsonb) <> 'object' THEN
            RAISE EXCEPTION 'event % of task % refused', i, p_task_id USING ERRCODE = 'WE008';
        END IF;
        -- wal_event_hash_v2 written out: a SQL function called from PL/pgSQL is planned
        -- again in every transaction (measured: about 100 µs per call).
        link := sha256(link
                       || convert_to('2' || E'\n' || octet_length(p_task_id) || ':'
                                     || p_task_id || E'\n' || (p_expected_seq + i) || E'\n'
                                     || octet_length(p_types[i]) || ':' || p_types[i]
                                     || E'\n' || p_versions[i] || E'\n' || p_epoch || E'\n'
                                     || (extract(epoch FROM stamp) * 1000000)::bigint
                                     || E'\n' || coalesce(octet_length(p_keys[i]) || ':'
                                                          || p_keys[i], '-')
                                     || E'\n', 'UTF8')
                       || p_payloads[i]);
        hashes := hashes || link;
    END LOOP;
    RETURN QUERY
    INSERT INTO wal_events AS w (task_id, seq, type, version, epoch, payload, idempotency_key,
                                 hash, recorded_at, chain_version)
    SELECT p_task_id, p_expected_seq + e.ord, e.type, e.version, p_epoch, e.payload, e.key,
           e.hash, stamp, 2
      FROM unnest(p_types, p_versions, p_payloads, p_keys, hashes)
               WITH ORDINALITY AS e(type, version, payload, key, hash, ord)
    RETURNING w.seq, w.hash;
END;
$$"""
DEFINER_SETUP: Final = """
ALTER FUNCTION bench_append_observations(text, bigint, bigint, bytea, text[], smallint[],
                                         bytea[], text[])
    SECURITY DEFINER SET search_path = public, pg_temp
"""
DATABASE_APPEND: Final = """
SELECT * FROM bench_append_observations($1, $2, $3, $4, $5::text[], $6::int2[], $7::bytea[],
                                        $8::text[])
"""


class Chain:
    """A task (or raw stream) head kept locally; hashes are cheap stand-ins (sha256 of prev)."""

    __slots__ = ("hash", "seq", "task_id")

    def __init__(self, task_id: str) -> None:
        self.task_id, self.seq, self.hash = task_id, 0, bytes(32)

    def advance(self) -> tuple[int, bytes, bytes]:
        """Return (seq before, prev hash, new hash) and move the head by one."""
        seq, previous = self.seq, self.hash
        self.seq, self.hash = seq + 1, hashlib.sha256(previous).digest()
        return seq, previous, self.hash


Arguments = Callable[[Chain, bytes], tuple[Any, ...]]


def _event_values(c: Chain, payload: bytes) -> tuple[Any, ...]:
    seq, _previous, new = c.advance()
    return (c.task_id, seq, EVENT_TYPE, 1, 1, payload, None, new)


def _event_unnest(c: Chain, payload: bytes) -> tuple[Any, ...]:
    seq, _previous, new = c.advance()
    return (c.task_id, seq, 1, [EVENT_TYPE], [1], [payload], [None], [new])


def _observe_one(c: Chain, payload: bytes) -> tuple[Any, ...]:
    seq, previous, new = c.advance()
    return (c.task_id, 1, seq, previous, EVENT_TYPE, 1, payload, None, new,
            dt.datetime.now(dt.UTC))


def database_append(connection: asyncpg.Connection, chain: Chain,
                    payload: bytes) -> Callable[[], Awaitable[None]]:
    """One call of the database-side append; the chain keeps the hash the database made."""

    async def operation() -> None:
        rows = await connection.fetch(DATABASE_APPEND, chain.task_id, 1, chain.seq, chain.hash,
                                      [EVENT_TYPE], [1], [payload], [None])
        if len(rows) != 1:
            raise RuntimeError(f"the database-side append returned {len(rows)} rows")
        chain.seq, chain.hash = rows[0]["seq"], rows[0]["hash"]

    return operation


def _fence_probe(c: Chain, payload: bytes) -> tuple[Any, ...]:
    return (c.task_id, 1, c.seq, c.hash)


def direct(
    connection: asyncpg.Connection, query: str, chain: Chain, arguments: Arguments,
    payload: bytes, *, rows: int,
) -> Callable[[], Awaitable[None]]:
    """One prepared statement on a dedicated connection; checks it wrote ``rows`` rows."""

    async def operation() -> None:
        status = await connection.execute(query, *arguments(chain, payload))
        if not status.endswith(f" {rows}"):
            raise RuntimeError(f"{query.split()[0]} wrote {status!r}, expected {rows} row(s)")

    return operation


async def _noop_reset(connection: asyncpg.Connection) -> None:
    """A pool reset that sends nothing (the store's connections carry no session state)."""


async def scratch_dsn(dsn: str | None) -> str:
    """The scratch database on the server of ``dsn``, ``WAL_ENGINE_DSN`` or the embedded one."""
    server_dsn = dsn or os.environ.get(DSN_ENV) or await resolve_dsn()
    await ensure_database(server_dsn, SCRATCH_DATABASE)
    return with_database(server_dsn, SCRATCH_DATABASE)


async def direct_contenders(
    dsn: str, run_id: str, payload: bytes, raw_payload: bytes, opened: list[Any]
) -> list[harness.Contender]:
    """The statement variants, each on its own connection and its own task."""
    variants: list[tuple[str, str, Arguments, bool, int]] = [
        ("wal_events INSERT (its one CHECK), scalar VALUES (no fence)", EVENT_VALUES,
         _event_values, False, 1),
        ("same INSERT, table with the former CHECKs", CHECKED_VALUES, _event_values, False,
         1),
        ("same INSERT, table without wal_events_bounds", UNCHECKED_VALUES, _event_values,
         False, 1),
        ("wal_events INSERT from unnest (no fence)", EVENT_UNNEST, _event_unnest, False, 1),
        ("fence probe alone (SELECT EXISTS)", FENCE_PROBE, _fence_probe, True, 1),
        ("store OBSERVE_ONE without RETURNING", OBSERVE_ONE_NO_RETURNING, _observe_one, True,
         1),
        ("store OBSERVE_ONE statement", queries.OBSERVE_ONE, _observe_one, True, 1),
    ]
    contenders: list[harness.Contender] = []
    raw_connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s,
                                           server_settings=TENANT_SETTINGS)
    opened.append(raw_connection)
    await raw_connection.execute(CREATE_CHECKED)
    await raw_connection.execute(CREATE_UNCHECKED)
    raw = Chain(f"raw-direct-{run_id}")
    contenders.append(harness.Contender(
        "raw INSERT (direct)",
        direct(raw_connection, append.RAW_INSERT_ONE, raw,
               lambda c, p: (c.task_id, c.advance()[0] + 1, EVENT_TYPE, p, c.hash),
               raw_payload, rows=1),
        reference=True,
    ))
    for index, (name, query, arguments, seeded, rows) in enumerate(variants):
        connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s,
                                           server_settings=TENANT_SETTINGS)
        opened.append(connection)
        chain = Chain(f"var{index}-{run_id}")
        if seeded:
            # A task row and its first event (epoch 1): the fence's predecessor.
            await connection.execute(CREATE_HEAD, chain.task_id, chain.hash)
            await connection.execute(EVENT_VALUES, *_event_values(chain, payload))
        contenders.append(harness.Contender(
            name, direct(connection, query, chain, arguments, payload, rows=rows)
        ))
    connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s,
                                       server_settings=TENANT_SETTINGS)
    opened.append(connection)
    await connection.execute(DATABASE_APPEND_FUNCTION)
    await connection.execute(DEFINER_SETUP)
    chain = Chain(f"definer-{run_id}")
    await connection.execute(CREATE_HEAD, chain.task_id, chain.hash)
    await connection.execute(EVENT_VALUES, *_event_values(chain, payload))
    contenders.append(harness.Contender(
        "database-side append (SECURITY DEFINER function)",
        database_append(connection, chain, payload)))
    return contenders


async def pooled_contenders(
    dsn: str, run_id: str, opened: list[Any]
) -> list[harness.Contender]:
    """The raw INSERT and Store.append_events through pools, default and no-op reset."""
    database = await Database.open(dsn, application_name="bench:breakdown")
    opened.append(database)
    raw_pool = await asyncpg.create_pool(
        dsn, min_size=limits.pool_size_min, max_size=limits.pool_size_max,
        timeout=limits.connect_timeout_s, command_timeout=limits.command_timeout_s,
        server_settings=TENANT_SETTINGS,
    )
    opened.append(raw_pool)
    quiet_pool = await asyncpg.create_pool(
        dsn, min_size=limits.pool_size_min, max_size=limits.pool_size_max,
        timeout=limits.connect_timeout_s, command_timeout=limits.command_timeout_s,
        reset=_noop_reset, server_settings=TENANT_SETTINGS,
    )
    opened.append(quiet_pool)
    async with raw_pool.acquire() as connection:
        await connection.execute(append.CREATE_RAW_TABLE)
    bench = append.Bench(Store(database), raw_pool, run_id=run_id)
    quiet = append.Bench(Store(Database(quiet_pool, dsn)), raw_pool, run_id=run_id)
    head, quiet_head = await bench.create_heads(
        [bench.task_id("wal", "pool"), bench.task_id("wal", "noop")]
    )
    return [
        harness.Contender(
            "raw INSERT via pool",
            bench.raw_insert(bench.stream("pool"), append.RAW_INSERT_ONE, 1),
        ),
        harness.Contender("Store.append_events via pool", bench.append_events(head, 1)),
        harness.Contender("Store.append_events, pool reset=noop",
                          quiet.append_events(quiet_head, 1)),
    ]


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=30, ops=50)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=8)
    dsn = await scratch_dsn(args.dsn)
    run_id = f"{time.strftime('%m%d%H%M%S')}-{os.getpid()}"
    content = append.message_content()
    payload = vocabulary.encode_event(vocabulary.MessageAppended(role="assistant",
                                                                 content=content))[2]
    raw_payload = payload + b"p" * append.RAW_PADDING_BYTES
    opened: list[Any] = []
    try:
        pooled = await pooled_contenders(dsn, run_id, opened)  # Database.open migrates first.
        contenders = await direct_contenders(dsn, run_id, payload, raw_payload, opened)
        machine = await harness.describe_machine(dsn)
        workload = harness.Workload(
            name="single", description="one 500-byte event, one commit, sequential",
            contenders=contenders + pooled, ops_per_round=settings.ops,
        )
        result = await harness.run_workload(workload, rounds=settings.rounds)
    finally:
        for resource in reversed(opened):
            await resource.close()
    print(harness.format_report(NAME, machine, [result], settings))
    if not args.no_json:
        path = harness.write_json(NAME, machine, [result], settings, path=args.json_path)
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
