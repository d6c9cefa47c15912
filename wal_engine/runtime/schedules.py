"""Schedules on the log: define, list, pause, resume and delete them, and fire their ticks.

A schedule is a row of ``wal_schedules`` (``schema.sql``, section "schedules"); when it is
due and which ticks a worker fires is :mod:`wal_engine.runtime.ticks`. Every worker fires
its tenant's due schedules from a loop of its own (:class:`ScheduleTicker`, started by
:meth:`wal_engine.runtime.worker.Worker.run`, on a dedicated connection), one schedule per
transaction: the row is locked (``FOR UPDATE SKIP LOCKED``: another worker passes it by),
the tick's tasks are inserted with ids ``sched:<name>:<tick UTC>``, and ``next_tick``
moves on, all in that one commit. A worker killed before it commits leaves nothing; the
next worker fires the same tick, under the same task id. So each tick submits exactly one
task however many workers and hosts run, and a task's id names its tick.

Times are the database's (``now()``), as for leases and durable timers, so every host
agrees on when a tick is due. The statements live here, beside their code, like the
gateway's and the roles'.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Final

import asyncpg
import msgspec

from wal_engine import events as vocabulary
from wal_engine import failpoints
from wal_engine.errors import (
    DatabaseUnavailable,
    InvalidSchedule,
    ScheduleExists,
    UnknownSchedule,
    WalError,
)
from wal_engine.failpoints import SimulatedCrash
from wal_engine.observability.logs import get_logger
from wal_engine.payloads import decode_payload, encode_payload
from wal_engine.runtime.ticks import (
    ScheduleSpec,
    TickPlan,
    next_tick_after,
    plan_ticks,
    schedule_name_pattern,
    task_id_for,
)
from wal_engine.security.redaction import Redactor, redact_bounded
from wal_engine.store import Database, Store

log = get_logger(__name__)

fire_batch_max: Final = 100
"""Schedules one worker fires per turn of its loop (each in its own transaction)."""
contended_wait_s: Final = 0.05
"""How long a worker waits when the due schedules are another worker's to fire (locked)."""
unavailable_wait_s: Final = 60.0
"""How long a worker waits before it looks again for a schedules table it could not use."""
list_rows_max: Final = 10_000
input_bytes_max: Final = 1024 * 1024
"""A schedule's input is kept in its row and copied into every tick's task: at most 1 MiB
encoded (larger inputs belong in the agent's own store, referred to by the input)."""
error_chars_max: Final = 500

_COLUMNS: Final = """name, agent, cron, every_s, time_zone, input, catch_up, catch_up_max,
    paused, next_tick, last_tick, last_task_id, last_error, ticks_fired, created_at,
    updated_at"""
_MINE: Final = "tenant = current_setting('wal.tenant', true)"

DATABASE_NOW: Final = "SELECT now()"
INSERT_SCHEDULE: Final = f"""
INSERT INTO wal_schedules (name, agent, cron, every_s, time_zone, input, catch_up,
                           catch_up_max, next_tick)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (tenant, name) DO NOTHING
RETURNING {_COLUMNS}
"""
LOCK_SCHEDULE: Final = f"""
SELECT {_COLUMNS} FROM wal_schedules WHERE {_MINE} AND name = $1 FOR UPDATE
"""
REPLACE_SCHEDULE: Final = f"""
UPDATE wal_schedules
   SET agent = $2, cron = $3, every_s = $4, time_zone = $5, input = $6, catch_up = $7,
       catch_up_max = $8, next_tick = $9, last_error = NULL, updated_at = now()
 WHERE {_MINE} AND name = $1
RETURNING {_COLUMNS}
"""
PAUSE_SCHEDULE: Final = f"""
UPDATE wal_schedules SET paused = true, updated_at = now()
 WHERE {_MINE} AND name = $1
RETURNING {_COLUMNS}
"""
RESUME_SCHEDULE: Final = f"""
UPDATE wal_schedules SET paused = false, next_tick = $2, updated_at = now()
 WHERE {_MINE} AND name = $1
RETURNING {_COLUMNS}
"""
READ_SCHEDULE: Final = f"SELECT {_COLUMNS} FROM wal_schedules WHERE {_MINE} AND name = $1"
LIST_SCHEDULES: Final = f"""
SELECT {_COLUMNS} FROM wal_schedules WHERE {_MINE} AND name > $1 ORDER BY name LIMIT $2
"""
DELETE_SCHEDULE: Final = "SELECT wal_delete_schedule($1)"
# The due schedule with the earliest tick that no other worker is firing now; $1 is a
# test's "now" (NULL: the database's clock).
CLAIM_DUE_SCHEDULE: Final = f"""
SELECT {_COLUMNS}, coalesce($1::timestamptz, now()) AS now FROM wal_schedules
 WHERE {_MINE} AND NOT paused AND next_tick <= coalesce($1::timestamptz, now())
 ORDER BY next_tick
 LIMIT 1
   FOR UPDATE SKIP LOCKED
"""
ADVANCE_SCHEDULE: Final = f"""
UPDATE wal_schedules
   SET next_tick = $2, last_tick = coalesce($3, last_tick),
       last_task_id = coalesce($4, last_task_id), last_error = $5,
       ticks_fired = ticks_fired + $6, updated_at = now()
 WHERE {_MINE} AND name = $1
"""
NEXT_DUE_MS: Final = f"""
SELECT extract(epoch FROM min(next_tick) - now()) * 1000 FROM wal_schedules
 WHERE {_MINE} AND NOT paused
"""
# Whether any schedule is due ($1 as in CLAIM_DUE_SCHEDULE): one statement outside a
# transaction, so that a worker with nothing due opens none (a session idle in a
# transaction between statements is what D7 looks for, and three round trips a poll).
ANY_DUE: Final = f"""
SELECT EXISTS (SELECT 1 FROM wal_schedules
                WHERE {_MINE} AND NOT paused AND next_tick <= coalesce($1::timestamptz, now()))
"""


class ScheduleInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A schedule as stored: its definition, state and last tick (times in UTC).

    ``next_tick`` is the earliest tick not yet fired (None: the cron expression matches no
    later time); ``ticks_fired`` counts the ticks that submitted a task, ``last_task_id``
    is the latest of those tasks, ``last_error`` why the last tick submitted nothing (a
    tenant's task cap, say), else None.
    """

    name: str
    agent: str
    cron: str | None
    every_s: int | None
    time_zone: str
    input: Any
    catch_up: str
    catch_up_max: int
    paused: bool
    next_tick: dt.datetime | None
    last_tick: dt.datetime | None
    last_task_id: str | None
    last_error: str | None
    ticks_fired: int
    created_at: dt.datetime
    updated_at: dt.datetime


class TickFired(msgspec.Struct, frozen=True, kw_only=True):
    """What one firing of a due schedule did: the task ids it submitted (or found), the next
    tick, whether due ticks went unfired (``missed``) or past the cap (``capped``), and the
    error that kept its tasks from being written."""

    name: str
    task_ids: tuple[str, ...]
    next_tick: dt.datetime | None
    missed: bool
    capped: bool
    error: str | None


# ------------------------------------------------------------------ the API's statements


def encode_input(spec: ScheduleSpec, value: Any, *, redactor: Redactor,
                 payload_bytes_max: int) -> bytes:
    """The input every tick's task gets, as stored: redacted, plain JSON, at most
    :data:`input_bytes_max`, and fit for a ``task_submitted`` event (checked now, so a tick
    never fails on it later)."""
    bytes_max = min(payload_bytes_max, input_bytes_max)
    redacted = redact_bounded(redactor, value, bytes_max)
    vocabulary.encode_event(vocabulary.TaskSubmitted(agent=spec.agent, input=redacted),
                            payload_bytes_max=payload_bytes_max)
    return encode_payload(redacted, payload_bytes_max=bytes_max)


async def add_schedule(database: Database, spec: ScheduleSpec, stored_input: bytes, *,
                       replace: bool) -> ScheduleInfo:
    """Create ``spec`` (first tick: the first after the database's now); the same definition
    again changes nothing; another one raises :class:`ScheduleExists` unless ``replace``,
    which rewrites it (a paused schedule stays paused) and starts it at its next tick."""
    values = (spec.agent, spec.cron, spec.every_s, spec.time_zone, stored_input,
              spec.catch_up, spec.catch_up_max)
    async with database.acquire() as connection, connection.transaction():
        now = await connection.fetchval(DATABASE_NOW)
        first = next_tick_after(spec, now)
        row = await connection.fetchrow(INSERT_SCHEDULE, spec.name, *values, first)
        if row is not None:
            return _info(row)
        existing = await connection.fetchrow(LOCK_SCHEDULE, spec.name)
        if existing is None:  # Deleted since the insert found it: once more, plainly.
            row = await connection.fetchrow(INSERT_SCHEDULE, spec.name, *values, first)
            if row is None:
                raise ScheduleExists(spec.name)
            return _info(row)
        if _definition(existing) == values:
            return _info(existing)
        if not replace:
            raise ScheduleExists(spec.name)
        return _info(await connection.fetchrow(REPLACE_SCHEDULE, spec.name, *values, first))


async def list_schedules(database: Database, *, after: str = "",
                         limit: int = list_rows_max) -> list[ScheduleInfo]:
    """This tenant's schedules by name, at most ``limit`` (page with ``after``)."""
    rows = await database.fetch(LIST_SCHEDULES, after, max(1, min(limit, list_rows_max)))
    return [_info(row) for row in rows]


async def read_schedule(database: Database, name: str) -> ScheduleInfo:
    """One schedule; :class:`UnknownSchedule` when there is none of that name."""
    row = await database.fetchrow(READ_SCHEDULE, checked_name(name))
    if row is None:
        raise UnknownSchedule(name)
    return _info(row)


async def pause_schedule(database: Database, name: str) -> ScheduleInfo:
    """Stop firing ``name`` until it is resumed (pausing a paused schedule is a no-op)."""
    row = await database.fetchrow(PAUSE_SCHEDULE, checked_name(name))
    if row is None:
        raise UnknownSchedule(name)
    return _info(row)


async def resume_schedule(database: Database, name: str) -> ScheduleInfo:
    """Fire ``name`` again from its next tick after now: the ticks that came while it was
    paused were paused on purpose, not missed, and are never fired. Resuming a schedule
    that is not paused changes nothing."""
    checked_name(name)
    async with database.acquire() as connection, connection.transaction():
        row = await connection.fetchrow(LOCK_SCHEDULE, name)
        if row is None:
            raise UnknownSchedule(name)
        if not row["paused"]:
            return _info(row)
        now = await connection.fetchval(DATABASE_NOW)
        following = next_tick_after(spec_of(row), now)
        return _info(await connection.fetchrow(RESUME_SCHEDULE, name, following))


async def delete_schedule(database: Database, name: str) -> None:
    """Delete ``name``; the tasks it submitted are kept. :class:`UnknownSchedule` when there
    is none."""
    row = await database.fetchrow(DELETE_SCHEDULE, checked_name(name))
    if row is None or not row[0]:
        raise UnknownSchedule(name)


def checked_name(name: object) -> str:
    """``name`` if it can be a schedule's name, else :class:`InvalidSchedule` (a name that
    cannot exist is refused, not looked up)."""
    if not isinstance(name, str) or not schedule_name_pattern.fullmatch(name):
        raise InvalidSchedule(name, "name", "must be 1..100 letters, digits, '_', '.' or '-'")
    return name


def spec_of(row: Any) -> ScheduleSpec:
    """The definition a stored row holds (trusted as written by :func:`add_schedule`)."""
    return ScheduleSpec(name=row["name"], agent=row["agent"], cron=row["cron"],
                        every_s=row["every_s"], time_zone=row["time_zone"],
                        catch_up=row["catch_up"], catch_up_max=row["catch_up_max"])


def _definition(row: Any) -> tuple[Any, ...]:
    return (row["agent"], row["cron"], row["every_s"], row["time_zone"], bytes(row["input"]),
            row["catch_up"], row["catch_up_max"])


def _info(row: Any) -> ScheduleInfo:
    return ScheduleInfo(
        name=row["name"], agent=row["agent"], cron=row["cron"], every_s=row["every_s"],
        time_zone=row["time_zone"], input=decode_payload(bytes(row["input"])),
        catch_up=row["catch_up"], catch_up_max=row["catch_up_max"], paused=row["paused"],
        next_tick=row["next_tick"], last_tick=row["last_tick"],
        last_task_id=row["last_task_id"], last_error=row["last_error"],
        ticks_fired=row["ticks_fired"], created_at=row["created_at"],
        updated_at=row["updated_at"])


# ------------------------------------------------------------------ firing ticks


class ScheduleTicker:
    """Fires its tenant's due schedules: a worker runs :meth:`step` in a loop on a
    connection of its own, sleeping what it returns (until the next tick is due, at most
    ``idle_s``, so schedules added by others are seen)."""

    def __init__(self, store: Store, *, idle_s: float, log: Any) -> None:
        self.store = store
        self.idle_s = idle_s
        self.log = log

    async def step(self, connection: asyncpg.Connection) -> float:
        """Fire what is due; the seconds to wait before the next step."""
        try:
            fired = await fire_due(connection, self.store, log=self.log)
            wait_ms = (None if len(fired) >= fire_batch_max
                       else await connection.fetchval(NEXT_DUE_MS))
        except SimulatedCrash as crash:
            # The worker 'died' mid-tick: the transaction is rolled back, as in a crash.
            self.log.warning("simulated_crash", point=str(crash))
            return self.idle_s
        except (asyncpg.UndefinedTableError, asyncpg.UndefinedFunctionError,
                asyncpg.InsufficientPrivilegeError) as error:
            # A database not yet migrated to schedules (a runtime role runs on the schema
            # it finds), or its grants not re-applied: the worker runs on, without
            # schedules, and looks again now and then (not in a tight reconnect loop).
            self.log.warning("schedules_unavailable", error=repr(error),
                             retry_in_s=unavailable_wait_s,
                             hint="run `wal-engine setup` (or migrate) as the owner")
            return unavailable_wait_s
        if len(fired) >= fire_batch_max:
            return 0.0  # More may be due: go on at once.
        if wait_ms is None:
            return float(self.idle_s)
        # Still due after this step: another worker holds it (or it failed); look again soon.
        floor_s = contended_wait_s if wait_ms <= 0 else 0.001
        return max(floor_s, min(self.idle_s, float(wait_ms) / 1000 + 0.001))


async def fire_due(connection: asyncpg.Connection, store: Store, *,
                   now: dt.datetime | None = None, batch: int = fire_batch_max,
                   log: Any = None) -> list[TickFired]:
    """Fire up to ``batch`` due schedules that no other worker is firing, each in its own
    transaction on ``connection``; what each did. ``now`` replaces the database's clock
    (tests: a tick due in the past or across a DST change, at no wait)."""
    fired: list[TickFired] = []
    if not await connection.fetchval(ANY_DUE, now):
        return fired
    for _ in range(batch):
        one = await _fire_one(connection, store, now, log)
        if one is None:
            break
        fired.append(one)
    return fired


async def _fire_one(connection: asyncpg.Connection, store: Store, now: dt.datetime | None,
                    log: Any) -> TickFired | None:
    async with connection.transaction():
        row = await connection.fetchrow(CLAIM_DUE_SCHEDULE, now)
        if row is None:
            return None
        name = row["name"]
        try:
            spec = spec_of(row)
            plan = plan_ticks(spec, row["next_tick"], row["now"])
            value = decode_payload(bytes(row["input"]))
        except Exception as error:  # A row written around the engine: stop it, say why.
            reason = f"the stored schedule cannot be read: {type(error).__name__}: {error}"
            _log(log, "error", "schedule_unreadable", schedule=name, error=reason)
            await connection.execute(ADVANCE_SCHEDULE, name, None, None, None,
                                     reason[:error_chars_max], 0)
            return TickFired(name=name, task_ids=(), next_tick=None, missed=False,
                             capped=False, error=reason)
        task_ids = tuple(task_id_for(name, tick) for tick in plan.fire)
        error_text = await _submit_ticks(connection, store, spec, task_ids, value, log)
        _log_plan(log, spec, plan, row["next_tick"])
        failpoints.hit("schedule_tick_before_commit")
        written = () if error_text is not None else task_ids
        await connection.execute(ADVANCE_SCHEDULE, name, plan.next_tick,
                                 plan.fire[-1] if written else None,
                                 written[-1] if written else None, error_text, len(written))
        return TickFired(name=name, task_ids=written, next_tick=plan.next_tick,
                         missed=plan.missed, capped=plan.capped, error=error_text)


async def _submit_ticks(connection: asyncpg.Connection, store: Store, spec: ScheduleSpec,
                        task_ids: tuple[str, ...], value: Any, log: Any) -> str | None:
    """Insert the ticks' tasks under a savepoint; why they could not be, else None. A
    refusal (the tenant's task cap, say) drops these ticks with the reason kept on the
    schedule, so that one refused schedule does not stop the others; a lost connection
    undoes the whole firing (the next worker fires it again)."""
    try:
        async with connection.transaction():
            for task_id in task_ids:
                await store.insert_task(task_id, spec.agent, input=value,
                                        connection=connection)
    except DatabaseUnavailable:
        raise
    except WalError as error:
        _log(log, "error", "schedule_tick_failed", schedule=spec.name, task_ids=task_ids,
             error=repr(error))
        return f"{type(error).__name__}: {error}"[:error_chars_max]
    return None


def _log_plan(log: Any, spec: ScheduleSpec, plan: TickPlan, first_due: dt.datetime) -> None:
    if plan.capped:
        _log(log, "warning", "schedule_catch_up_capped", schedule=spec.name,
             catch_up_max=spec.catch_up_max, first_missed=first_due.isoformat(),
             first_fired=plan.fire[0].isoformat(),
             note="the due ticks before first_fired were dropped")
    elif plan.missed:
        _log(log, "warning", "schedule_ticks_missed", schedule=spec.name,
             catch_up=spec.catch_up, first_missed=first_due.isoformat(),
             fired=[tick.isoformat() for tick in plan.fire])
    elif plan.fire:
        _log(log, "debug", "schedule_ticked", schedule=spec.name,
             ticks=[tick.isoformat() for tick in plan.fire])


def _log(logger: Any, level: str, event: str, **fields: Any) -> None:
    getattr(log if logger is None else logger, level)(event, **fields)
