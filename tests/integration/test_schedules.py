"""Schedules against real PostgreSQL: the API and CLI, bad input, DST, catch-up policies,
workers firing ticks, a tenant's runtime role, and the upgrade of an existing database."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import msgspec
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from tests.integration.test_cli_agents import cli, lines, one_error_line
from wal_engine.engine import Engine
from wal_engine.errors import (
    InvalidInput,
    InvalidSchedule,
    PayloadTooLarge,
    ScheduleExists,
    UnknownSchedule,
)
from wal_engine.runtime.schedules import TickFired, fire_due
from wal_engine.store.connection import apply_schema
from wal_engine.testing.processes import wait_until

UTC = dt.UTC
FAST: dict[str, Any] = {"poll_ms": 50, "sweep_ms": 200, "lease_ttl_ms": 3000,
                        "heartbeat_ms": 500}


class Ping(msgspec.Struct):
    """The scheduled agent's input."""

    n: int


def utc(*parts: int) -> dt.datetime:
    return dt.datetime(*parts, tzinfo=UTC)


def _register(engine: Engine) -> None:
    @engine.agent("ping")
    async def ping(ctx: Any, value: Ping) -> int:
        return value.n


@pytest_asyncio.fixture
async def scheduled(engine: Engine) -> AsyncIterator[Engine]:
    """The test's engine with the ``ping`` agent registered."""
    _register(engine)
    yield engine


async def _fire(engine: Engine, now: dt.datetime | None = None) -> list[TickFired]:
    async with engine.database.acquire() as connection:
        return await fire_due(connection, engine.store, now=now)


async def _set_next_tick(engine: Engine, name: str, tick: dt.datetime) -> None:
    await engine.database.fetch(
        "UPDATE wal_schedules SET next_tick = $2 WHERE tenant = current_setting("
        "'wal.tenant', true) AND name = $1", name, tick)


async def _task_ids(engine: Engine, name: str) -> list[str]:
    rows = await engine.database.fetch(
        "SELECT task_id FROM wal_tasks WHERE tenant = current_setting('wal.tenant', true) "
        "AND task_id LIKE $1 ORDER BY task_id", f"sched:{name}:%")
    return [row["task_id"] for row in rows]


async def _rows(engine: Engine, table: str) -> int:
    return int((await engine.database.fetch(f"SELECT count(*) AS n FROM {table}"))[0]["n"])


# ----------------------------------------------------------------------------- the API


async def test_add_list_pause_resume_delete(scheduled: Engine) -> None:
    """A schedule is saved with its first tick, listed, paused, resumed and deleted; the
    same definition again is a no-op, another one needs replace=True."""
    engine = scheduled
    before = dt.datetime.now(UTC)
    info = await engine.schedule("pings", "ping", every_s=3600, input={"n": 1})
    assert (info.name, info.agent, info.every_s, info.cron, info.catch_up) == (
        "pings", "ping", 3600, None, "one")
    assert info.input == {"n": 1} and not info.paused and info.ticks_fired == 0
    assert info.next_tick is not None and info.next_tick > before
    assert info.next_tick.timestamp() % 3600 == 0
    again = await engine.schedule("pings", "ping", every_s=3600, input={"n": 1})
    assert again == info
    with pytest.raises(ScheduleExists):
        await engine.schedule("pings", "ping", every_s=60, input={"n": 1})
    replaced = await engine.schedule("pings", "ping", cron="0 3 * * *", tz="Europe/Riga",
                                     input={"n": 2}, catch_up="all", replace=True)
    assert (replaced.cron, replaced.every_s, replaced.time_zone, replaced.input) == (
        "0 3 * * *", None, "Europe/Riga", {"n": 2})
    await engine.schedule("other", "ping", cron="@hourly", input={"n": 3})
    assert [s.name for s in await engine.schedules()] == ["other", "pings"]
    paused = await engine.pause_schedule("pings")
    assert paused.paused and (await engine.pause_schedule("pings")).paused
    resumed = await engine.resume_schedule("pings")
    assert not resumed.paused and resumed.next_tick is not None
    assert await engine.resume_schedule("pings") == resumed  # Not paused: unchanged.
    await engine.delete_schedule("pings")
    assert [s.name for s in await engine.schedules()] == ["other"]
    for act in (engine.pause_schedule, engine.resume_schedule, engine.delete_schedule,
                engine.schedule_info):
        with pytest.raises(UnknownSchedule) as raised:
            await act("pings")
        assert raised.value.name == "pings"


@pytest.mark.parametrize(("arguments", "field"), [
    ({"cron": "0 25 * * *"}, "cron"),
    ({"cron": "0 0 31 2 *"}, "cron"),
    ({"cron": "0 3 * * *", "tz": "Europe/Atlantis"}, "tz"),
    ({"every_s": 0}, "every_s"),
    ({"every_s": -1}, "every_s"),
    ({"every_s": 60, "catch_up": "twice"}, "catch_up"),
    ({"every_s": 60, "catch_up_max": -3}, "catch_up_max"),
    ({"every_s": 60, "cron": "* * * * *"}, "cron"),
])
async def test_bad_definitions_raise_typed_errors_and_write_nothing(
        scheduled: Engine, arguments: dict[str, Any], field: str) -> None:
    """Each bad argument is InvalidSchedule naming it, at the call; no row is written, and
    an existing schedule of that name is left as it was."""
    engine = scheduled
    kept = await engine.schedule("kept", "ping", every_s=60, input={"n": 1})
    for name in ("fresh", "kept"):
        with pytest.raises(InvalidSchedule) as raised:
            await engine.schedule(name, "ping", input={"n": 1}, replace=True, **arguments)
        assert raised.value.field == field
    assert await engine.schedules() == [kept]


async def test_bad_input_and_names_are_refused_before_anything_is_written(
        scheduled: Engine) -> None:
    """Input of the wrong type, input too large, an unusable name: typed errors, no row."""
    engine = scheduled
    with pytest.raises(InvalidInput):
        await engine.schedule("typed", "ping", every_s=60, input={"n": "one"})
    with pytest.raises(PayloadTooLarge):
        await engine.schedule("big", "elsewhere", every_s=60, input={"pad": "x" * 2_000_000})
    with pytest.raises(InvalidSchedule):
        await engine.schedule("with:colon", "ping", every_s=60, input={"n": 1})
    with pytest.raises(InvalidSchedule):
        await engine.pause_schedule("bad\x00name")
    assert await engine.schedules() == []
    assert await _rows(engine, "wal_tasks") == 0


# ----------------------------------------------------------------------------- firing


async def test_catch_up_policies_on_missed_ticks(scheduled: Engine) -> None:
    """Ten five-minute ticks missed (the latest 150 s late): skip submits nothing, one the
    latest tick, all each tick, all with a cap the latest three and a warning naming the
    drop."""
    engine = scheduled
    for policy, cap in (("skip", 100), ("one", 100), ("all", 100), ("all", 3)):
        await engine.schedule(f"{policy}-{cap}", "ping", every_s=300, input={"n": 1},
                              catch_up=policy, catch_up_max=cap)  # type: ignore[arg-type]
        await _set_next_tick(engine, f"{policy}-{cap}", utc(2024, 1, 1, 12, 0))
    with capture_logs() as logs:
        fired = {f.name: f for f in await _fire(engine, utc(2024, 1, 1, 12, 47, 30))}
    stamps = [f"sched:%s:20240101T12{m:02d}00Z" for m in range(0, 50, 5)]
    assert fired["skip-100"].task_ids == () and fired["skip-100"].missed
    assert await _task_ids(engine, "skip-100") == []
    assert await _task_ids(engine, "one-100") == [stamps[-1] % "one-100"]
    assert await _task_ids(engine, "all-100") == [s % "all-100" for s in stamps]
    assert await _task_ids(engine, "all-3") == [s % "all-3" for s in stamps[-3:]]
    assert fired["all-3"].capped
    capped = [e for e in logs if e["event"] == "schedule_catch_up_capped"]
    assert [(e["schedule"], e["catch_up_max"]) for e in capped] == [("all-3", 3)]
    for info in await engine.schedules():
        assert info.next_tick == utc(2024, 1, 1, 12, 50), info.name
    assert {i.name: i.ticks_fired for i in await engine.schedules()} == {
        "skip-100": 0, "one-100": 1, "all-100": 10, "all-3": 3}
    # Nothing is due any more at that time: firing again submits nothing.
    assert await _fire(engine, utc(2024, 1, 1, 12, 47, 30)) == []


async def test_dst_changes_fire_each_daily_tick_once(scheduled: Engine) -> None:
    """02:30 New York daily fires at 03:00 EDT on the spring-forward day; 01:30 daily fires
    once on the fall-back day, also when a worker looks again in the repeated hour."""
    engine = scheduled
    await engine.schedule("spring", "ping", cron="30 2 * * *", tz="America/New_York",
                          input={"n": 1})
    await engine.schedule("fall", "ping", cron="30 1 * * *", tz="America/New_York",
                          input={"n": 1})
    await _set_next_tick(engine, "spring", utc(2024, 3, 9, 7, 30))
    await _set_next_tick(engine, "fall", utc(2024, 11, 2, 5, 30))
    for now in (utc(2024, 3, 9, 7, 30, 2), utc(2024, 3, 10, 7, 0, 2),
                utc(2024, 3, 11, 6, 30, 2)):
        await _fire(engine, now)
    assert await _task_ids(engine, "spring") == [
        "sched:spring:20240309T073000Z", "sched:spring:20240310T070000Z",
        "sched:spring:20240311T063000Z"]
    # 01:30 EDT, then every 20 minutes through the repeated hour (01:xx EST) and beyond.
    await _fire(engine, utc(2024, 11, 2, 5, 30, 1))
    moment = utc(2024, 11, 3, 5, 30, 1)
    while moment < utc(2024, 11, 3, 8):
        await _fire(engine, moment)
        moment += dt.timedelta(minutes=20)
    await _fire(engine, utc(2024, 11, 4, 6, 30, 1))
    assert await _task_ids(engine, "fall") == [
        "sched:fall:20241102T053000Z", "sched:fall:20241103T053000Z",
        "sched:fall:20241104T063000Z"]


async def test_paused_schedules_do_not_fire_and_resume_skips_the_pause(
        scheduled: Engine) -> None:
    """A paused schedule is passed by; resumed, it starts at its next tick after now."""
    engine = scheduled
    await engine.schedule("held", "ping", every_s=60, input={"n": 1}, catch_up="all")
    await _set_next_tick(engine, "held", utc(2024, 1, 1))
    await engine.pause_schedule("held")
    assert await _fire(engine, utc(2024, 1, 1, 1)) == []
    resumed = await engine.resume_schedule("held")
    assert resumed.next_tick is not None
    assert resumed.next_tick > dt.datetime.now(UTC) - dt.timedelta(seconds=60)
    assert await _task_ids(engine, "held") == []


async def test_a_refused_tick_is_recorded_and_does_not_stop_other_schedules(
        database_dsn: str) -> None:
    """At the tenant's task cap, a tick's task is refused: the schedule keeps the reason,
    moves on, and the other due schedules still fire (none of it half-written)."""
    from wal_engine.engine import connect

    engine = await connect(database_dsn, migrate=False, pool_size_max=4, tasks_max=2)
    try:
        _register(engine)
        await engine.submit("ping", {"n": 0}, task_id="filler")
        for name in ("a", "b"):
            await engine.schedule(name, "ping", every_s=60, input={"n": 1}, catch_up="all")
            await _set_next_tick(engine, name, utc(2024, 1, 1))
        fired = {f.name: f for f in await _fire(engine, utc(2024, 1, 1, 0, 0, 5))}
        assert fired["a"].task_ids == ("sched:a:20240101T000000Z",)
        assert fired["b"].task_ids == () and "TaskQuotaExceeded" in (fired["b"].error or "")
        info = await engine.schedule_info("b")
        assert info.last_error == fired["b"].error and info.ticks_fired == 0
        assert info.next_tick == utc(2024, 1, 1, 0, 1)
        assert await _rows(engine, "wal_tasks") == 2
    finally:
        await engine.close()


async def test_workers_fire_interval_ticks_once_each_and_run_them(scheduled: Engine) -> None:
    """Two in-process workers on a one-second schedule: consecutive ticks, one task each,
    every task run to completion; ticks_fired equals the tasks."""
    engine = scheduled
    await engine.schedule("beat", "ping", every_s=1, input={"n": 7}, catch_up="all")
    workers = [engine.worker(concurrency=2, **FAST) for _ in range(2)]
    running = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        async def three_done() -> bool:
            ids = await _task_ids(engine, "beat")
            if len(ids) < 3:
                return False
            heads = [await engine.head(task_id) for task_id in ids[:3]]
            return all(str(head.status) == "COMPLETED" for head in heads)

        await wait_until(three_done, "three ticks run", 20, 0.05)
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*running)
    ids = await _task_ids(engine, "beat")
    stamps = [dt.datetime.strptime(i.rsplit(":", 1)[1], "%Y%m%dT%H%M%SZ") for i in ids]
    assert [(b - a).total_seconds() for a, b in itertools.pairwise(stamps)] == [
        1.0] * (len(stamps) - 1)
    assert (await engine.schedule_info("beat")).ticks_fired == len(ids)
    assert (await engine.state(ids[0])).output == 7


async def test_a_tenants_runtime_role_manages_and_fires_schedules(app_engine: Engine,
                                                                  engine: Engine) -> None:
    """As a tenant's login role (grants only: no table-level UPDATE or DELETE) every
    operation works, and another tenant sees none of it."""
    _register(app_engine)
    await app_engine.schedule("mine", "ping", every_s=60, input={"n": 1}, catch_up="one")
    await app_engine.pause_schedule("mine")
    await app_engine.resume_schedule("mine")
    await _set_next_tick(engine, "mine", utc(2024, 1, 1))
    fired = await _fire(app_engine, utc(2024, 1, 1, 0, 5))
    assert [f.task_ids for f in fired] == [("sched:mine:20240101T000500Z",)]
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with app_engine.database.pool.acquire() as connection:
            await connection.execute("DELETE FROM wal_schedules")
    async with app_engine.database.pool.acquire() as connection:
        other = await connection.fetchval(
            "SELECT count(*) FROM wal_schedules WHERE tenant <> current_setting('wal.tenant')")
    assert other == 0
    await app_engine.delete_schedule("mine")
    assert await app_engine.schedules() == []


async def test_an_existing_database_gains_the_schedules_table(engine: Engine) -> None:
    """A database applied before schedules existed (other checksum, no table) is upgraded by
    the next migration, with its tasks kept."""
    _register(engine)
    await engine.submit("ping", {"n": 1}, task_id="old-task")
    async with engine.database.acquire() as connection:
        await connection.execute("DROP FUNCTION wal_delete_schedule(text); "
                                 "DROP TABLE wal_schedules; "
                                 "UPDATE wal_schema_version SET checksum = 'before-24'")
        assert await apply_schema(connection)
    await engine.schedule("after", "ping", every_s=60, input={"n": 1})
    assert [s.name for s in await engine.schedules()] == ["after"]
    assert str((await engine.head("old-task")).status) == "QUEUED"


# ----------------------------------------------------------------------------- the CLI


async def test_cli_schedule_commands_in_json_and_their_errors(scheduled: Engine) -> None:
    """wal-engine schedule add|list|pause|resume|delete --json; a bad cron expression, an
    unknown schedule: one error line each, exit 2 and 3, nothing written."""
    dsn = scheduled.database.dsn
    started = time.monotonic()
    added = await cli("schedule", "add", "nightly", "ping", "--cron", "30 2 * * *", "--tz",
                      "America/New_York", "--input", '{"n": 4}', "--catch-up", "skip",
                      "--dsn", dsn, "--json")
    assert added.exit_code == 0, added.output
    (shown,) = lines(added.stdout)
    assert (shown["name"], shown["cron"], shown["time_zone"], shown["catch_up"],
            shown["input"], shown["paused"]) == ("nightly", "30 2 * * *",
                                                 "America/New_York", "skip", {"n": 4}, False)
    every = await cli("schedule", "add", "often", "ping", "--every", "30", "--dsn", dsn)
    assert every.exit_code == 0 and "schedule often saved" in every.stdout
    listed = lines((await cli("schedule", "list", "--dsn", dsn, "--json")).stdout)
    assert [(s["name"], s["every_s"]) for s in listed] == [("nightly", None), ("often", 30)]
    paused = lines((await cli("schedule", "pause", "often", "--dsn", dsn, "--json")).stdout)
    assert paused[0]["paused"] is True
    resumed = lines((await cli("schedule", "resume", "often", "--dsn", dsn, "--json")).stdout)
    assert resumed[0]["paused"] is False
    table = await cli("schedule", "list", "--dsn", dsn)
    assert "nightly" in table.stdout and "every 30 s" in table.stdout
    deleted = await cli("schedule", "delete", "often", "--dsn", dsn, "--json")
    assert lines(deleted.stdout) == [{"name": "often", "deleted": True}]
    bad = await cli("schedule", "add", "broken", "ping", "--cron", "0 99 * * *", "--dsn", dsn)
    assert bad.exit_code == 2 and "cron" in one_error_line(bad)
    zone = await cli("schedule", "add", "broken", "ping", "--every", "0", "--dsn", dsn)
    assert zone.exit_code == 2 and "every_s" in one_error_line(zone)
    unknown = await cli("schedule", "pause", "nothing", "--dsn", dsn)
    assert unknown.exit_code == 3 and "unknown schedule 'nothing'" in one_error_line(unknown)
    assert [s.name for s in await scheduled.schedules()] == ["nightly"]
    assert time.monotonic() - started < 30


async def test_a_worker_on_a_database_without_schedules_runs_its_tasks(
        scheduled: Engine) -> None:
    """A database not migrated to schedules (no table): the worker says so once and runs
    its tasks as before, without a reconnect loop."""
    engine = scheduled
    async with engine.database.acquire() as connection:
        await connection.execute("DROP FUNCTION wal_delete_schedule(text); "
                                 "DROP TABLE wal_schedules")
    task_id = await engine.submit("ping", {"n": 5})
    with capture_logs() as logs:
        worker = engine.worker(concurrency=2, **FAST)
        running = asyncio.create_task(worker.run())
        try:
            assert (await engine.wait(task_id, timeout_s=20)).output == 5
            await asyncio.sleep(0.3)  # A few of the loop's polls, were it spinning.
        finally:
            worker.stop()
            await running
    unavailable = [e for e in logs if e["event"] == "schedules_unavailable"]
    assert len(unavailable) == 1 and "wal_schedules" in unavailable[0]["error"]
    assert not [e for e in logs if e["event"] == "worker_connection_lost"]
