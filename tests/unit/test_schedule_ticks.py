"""Schedules' tick arithmetic (wal_engine.runtime.ticks): validation, DST, catch-up plans."""

from __future__ import annotations

import datetime as dt

import pytest

from wal_engine.errors import InvalidInput, InvalidSchedule
from wal_engine.runtime.ticks import (
    ScheduleSpec,
    due_ticks,
    next_tick_after,
    plan_ticks,
    task_id_for,
    validate_spec,
)

UTC = dt.UTC


def utc(*parts: int) -> dt.datetime:
    return dt.datetime(*parts, tzinfo=UTC)


def cron(expression: str, tz: str = "UTC", catch_up: str = "one",
         catch_up_max: int = 100) -> ScheduleSpec:
    return validate_spec("s", "a", cron=expression, tz=tz, catch_up=catch_up,
                         catch_up_max=catch_up_max)


def walk(spec: ScheduleSpec, start: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
    """Every tick a worker fires stepping from ``start`` tick by tick (next_tick_after)."""
    ticks = []
    tick = next_tick_after(spec, start)
    while tick is not None and tick <= until:
        ticks.append(tick)
        tick = next_tick_after(spec, tick)
    return ticks


@pytest.mark.parametrize(("arguments", "field"), [
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": "* * *"}, "cron"),
    ({"cron": "0 0 30 2 *"}, "cron"),
    ({"cron": ""}, "cron"),
    ({"cron": "0 0 * * *\x00"}, "cron"),
    ({"cron": 5}, "cron"),
    ({"cron": "0 * * * *", "tz": "Mars/Olympus"}, "tz"),
    ({"cron": "0 * * * *", "tz": "../../etc/passwd"}, "tz"),
    ({"cron": "0 * * * *", "tz": ""}, "tz"),
    ({"every_s": 0}, "every_s"),
    ({"every_s": -5}, "every_s"),
    ({"every_s": 1.5}, "every_s"),
    ({"every_s": True}, "every_s"),
    ({"every_s": 366 * 86_400 + 1}, "every_s"),
    ({"every_s": 60, "tz": "Europe/Riga"}, "tz"),
    ({"every_s": 60, "cron": "* * * * *"}, "cron"),
    ({}, "cron"),
    ({"every_s": 60, "catch_up": "sometimes"}, "catch_up"),
    ({"every_s": 60, "catch_up_max": 0}, "catch_up_max"),
    ({"every_s": 60, "catch_up_max": 1001}, "catch_up_max"),
])
def test_bad_definitions_are_typed_and_name_their_argument(arguments: dict[str, object],
                                                           field: str) -> None:
    """Each bad argument raises InvalidSchedule (an InvalidInput) naming that argument."""
    with pytest.raises(InvalidSchedule) as raised:
        validate_spec("nightly", "agent", **arguments)  # type: ignore[arg-type]
    assert raised.value.field == field
    assert isinstance(raised.value, InvalidInput)
    assert "nightly" in str(raised.value)


@pytest.mark.parametrize("name", ["", "a:b", "x" * 101, "sp ace", None, "é"])
def test_bad_names_are_refused(name: object) -> None:
    """A name that cannot be part of a task id is refused."""
    with pytest.raises(InvalidSchedule) as raised:
        validate_spec(name, "agent", every_s=60)
    assert raised.value.field == "name"


def test_names_and_aliases_are_accepted() -> None:
    """@daily is 0 0 * * *; whitespace is normalised; six fields take seconds."""
    assert cron("@daily").cron == "0 0 * * *"
    assert cron(" 0  0 * * * ").cron == "0 0 * * *"
    assert next_tick_after(cron("*/2 * * * * *"), utc(2024, 1, 1, 0, 0, 1)) == utc(
        2024, 1, 1, 0, 0, 2)


def test_interval_ticks_are_multiples_of_the_interval_since_the_epoch() -> None:
    """every_s=3600 ticks on the hour; the next tick is strictly after."""
    spec = validate_spec("h", "a", every_s=3600)
    assert next_tick_after(spec, utc(2024, 5, 1, 10, 0, 0)) == utc(2024, 5, 1, 11)
    assert next_tick_after(spec, utc(2024, 5, 1, 10, 59, 59, 999999)) == utc(2024, 5, 1, 11)
    assert task_id_for("h", utc(2024, 5, 1, 11)) == "sched:h:20240501T110000Z"


def test_spring_forward_runs_a_skipped_time_once_after_the_gap() -> None:
    """02:30 daily in New York: on 2024-03-10 (02:00 -> 03:00) it runs at 03:00 EDT, once."""
    spec = cron("30 2 * * *", "America/New_York")
    ticks = walk(spec, utc(2024, 3, 8, 12), utc(2024, 3, 12, 12))
    assert ticks == [utc(2024, 3, 9, 7, 30), utc(2024, 3, 10, 7, 0),
                     utc(2024, 3, 11, 6, 30), utc(2024, 3, 12, 6, 30)]


def test_fall_back_does_not_run_a_repeated_time_twice() -> None:
    """01:30 daily in New York: on 2024-11-03 (01:00-02:00 twice) it runs once, even when
    the next tick is asked for from inside the repeated hour."""
    spec = cron("30 1 * * *", "America/New_York")
    ticks = walk(spec, utc(2024, 11, 1, 12), utc(2024, 11, 5, 12))
    assert ticks == [utc(2024, 11, 2, 5, 30), utc(2024, 11, 3, 5, 30),
                     utc(2024, 11, 4, 6, 30), utc(2024, 11, 5, 6, 30)]
    # 01:10 EST, the second pass of the hour, after the 01:30 EDT tick fired.
    assert next_tick_after(spec, utc(2024, 11, 3, 6, 10)) == utc(2024, 11, 4, 6, 30)
    due, more = due_ticks(spec, utc(2024, 11, 3, 5, 31), utc(2024, 11, 3, 6, 45), 10)
    assert (due, more) == ([], False)


def test_interval_like_cron_runs_at_each_real_instant_of_a_repeated_hour() -> None:
    """*/30 in New York across the fall-back: four ticks in the two passes of 01:xx."""
    spec = cron("*/30 * * * *", "America/New_York")
    ticks = walk(spec, utc(2024, 11, 3, 4, 45), utc(2024, 11, 3, 6, 45))
    assert ticks == [utc(2024, 11, 3, 5), utc(2024, 11, 3, 5, 30), utc(2024, 11, 3, 6),
                     utc(2024, 11, 3, 6, 30)]


def test_catch_up_policies() -> None:
    """Ten hourly ticks missed: skip fires none, one fires the latest, all the latest N."""
    first, now = utc(2024, 1, 1, 0), utc(2024, 1, 1, 9, 10)
    skip = plan_ticks(cron("0 * * * *", catch_up="skip"), first, now)
    one = plan_ticks(cron("0 * * * *", catch_up="one"), first, now)
    every = plan_ticks(cron("0 * * * *", catch_up="all"), first, now)
    capped = plan_ticks(cron("0 * * * *", catch_up="all", catch_up_max=3), first, now)
    assert (skip.fire, skip.missed) == ((), True)
    assert (one.fire, one.missed) == ((utc(2024, 1, 1, 9),), True)
    assert every.fire == tuple(utc(2024, 1, 1, h) for h in range(10))
    assert not every.capped and not every.missed
    assert capped.fire == (utc(2024, 1, 1, 7), utc(2024, 1, 1, 8), utc(2024, 1, 1, 9))
    assert capped.capped
    for plan in (skip, one, every, capped):
        assert plan.next_tick == utc(2024, 1, 1, 10)


def test_an_on_time_tick_fires_under_every_policy() -> None:
    """A lone tick a few seconds late is not missed: skip fires it too."""
    for policy in ("skip", "one", "all"):
        plan = plan_ticks(cron("0 * * * *", catch_up=policy), utc(2024, 1, 1, 9),
                          utc(2024, 1, 1, 9, 0, 5))
        assert plan.fire == (utc(2024, 1, 1, 9),) and not plan.missed, policy
    late = plan_ticks(cron("0 * * * *", catch_up="skip"), utc(2024, 1, 1, 9),
                      utc(2024, 1, 1, 9, 5))
    assert late.fire == () and late.missed


def test_a_long_gap_costs_no_more_steps_than_ticks_fired() -> None:
    """A per-second cron missed for ten years plans quickly (backwards from now)."""
    spec = cron("* * * * * *", catch_up="all", catch_up_max=5)
    plan = plan_ticks(spec, utc(2014, 1, 1), utc(2024, 1, 1))
    last_second = tuple(utc(2023, 12, 31, 23, 59, s) for s in range(56, 60))
    assert plan.fire == (*last_second, utc(2024, 1, 1))
    assert plan.capped
    interval = validate_spec("i", "a", every_s=1, catch_up="all", catch_up_max=2)
    assert plan_ticks(interval, utc(2014, 1, 1), utc(2024, 1, 1)).fire == (
        utc(2023, 12, 31, 23, 59, 59), utc(2024, 1, 1))
