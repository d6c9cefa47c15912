"""When a schedule is due: its validated definition and its ticks (pure: no I/O).

A schedule ticks either on a cron expression read in a time zone (``cron``, ``tz``), or
every ``every_s`` seconds, at the whole multiples of ``every_s`` since 1970-01-01 UTC (so
``every_s=3600`` ticks at the top of each hour, whoever created it and whenever).

Cron expressions are parsed and stepped by ``cronsim`` (the Healthchecks project's parser,
which matches Debian cron, DST included): five fields, or six with a leading seconds field,
and the ``@hourly``-style names. Across DST changes a fixed-time job (no ``*`` in its minute
and hour fields) behaves as Debian cron does: a time the spring-forward skips runs at the
first minute after the gap (02:30 runs at 03:00), and a time the fall-back repeats runs
once; other jobs run at each real instant that matches (``*/30 * * * *`` runs four times in
the repeated hour). Every tick is handled as a UTC instant here: aware datetimes in one
zone compare by their wall-clock fields, ignoring the DST fold, so two ticks of a repeated
hour would compare equal in local time.

Catch-up of ticks that came while no worker ran (:func:`plan_ticks`): a tick is *missed*
when a later tick is due too, or when it is more than ``late_grace_s`` late. ``skip`` fires
no missed tick (only an on-time one; the schedule goes on at the next future tick), ``one``
fires one task for the latest due tick standing for all of them, ``all`` fires each due
tick, the latest ``catch_up_max`` of them.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
from cronsim import CronSim, CronSimError

from wal_engine import limits
from wal_engine.errors import InvalidInput, InvalidSchedule
from wal_engine.ids import validate_text

CatchUp = Literal["skip", "one", "all"]
CATCH_UP_POLICIES: Final = ("skip", "one", "all")
catch_up_default: Final = "one"
catch_up_max_default: Final = 100
catch_up_max_ceiling: Final = 1000
"""The most tasks one catch-up of a schedule with ``catch_up="all"`` submits at once."""
late_grace_s: Final = 60
"""A lone due tick later than this is missed (``skip`` drops it); within it, it is on time
(a worker busy, a short outage)."""
every_s_max: Final = 366 * 86_400
cron_chars_max: Final = 200
zone_chars_max: Final = 100
schedule_name_pattern: Final = re.compile(r"[A-Za-z0-9_.-]{1,100}")
"""Schedule names: they are part of their tasks' ids (``sched:<name>:<tick>``), so no
``:`` and at most 100 characters (a task id is at most 128)."""
cron_steps_max: Final = 16
"""Cron steps taken to step over the ticks a DST fall-back repeats (a bound, never reached
in practice: each repeated wall-clock time is met at most twice)."""
TASK_ID_PREFIX: Final = "sched:"
CRON_NAMES: Final = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
UTC: Final = dt.UTC
_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=UTC)


class ScheduleSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a schedule is, validated: its name and agent, when it ticks (``cron`` in
    ``time_zone``, or ``every_s``), and its catch-up policy."""

    name: str
    agent: str
    cron: str | None = None
    every_s: int | None = None
    time_zone: str = "UTC"
    catch_up: str = catch_up_default
    catch_up_max: int = catch_up_max_default


class TickPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker does with a due schedule: the ticks it fires now (UTC, ascending) and
    the next tick after now (None: the cron expression matches no later time). ``missed``:
    due ticks were left unfired (skipped, or folded into the one task fired); ``capped``:
    ``all`` left out the due ticks before the latest ``catch_up_max``."""

    fire: tuple[dt.datetime, ...]
    next_tick: dt.datetime | None
    missed: bool
    capped: bool


def validate_spec(name: object, agent: object, *, cron: object = None,
                  every_s: object = None, tz: object = None, catch_up: object = None,
                  catch_up_max: object = None) -> ScheduleSpec:
    """The :class:`ScheduleSpec` for these arguments, or :class:`InvalidSchedule` naming the
    first one that is wrong: exactly one of ``cron`` and ``every_s``; a cron expression
    cronsim parses and that matches some time in the next 50 years; an IANA time zone
    (cron only); an interval of 1 s to 366 days; a known catch-up policy and a cap of 1 to
    1,000."""
    if not isinstance(name, str) or not schedule_name_pattern.fullmatch(name):
        raise InvalidSchedule(name, "name", "must be 1..100 letters, digits, '_', '.' or '-'")
    if not isinstance(agent, str) or not 1 <= len(agent) <= limits.name_length_max:
        raise InvalidSchedule(name, "agent",
                              f"must be a name of 1..{limits.name_length_max} characters")
    _check_text(name, "agent", agent, limits.name_length_max)
    if (cron is None) == (every_s is None):
        raise InvalidSchedule(name, "cron", "give exactly one of cron= and every_s=")
    policy = catch_up_default if catch_up is None else catch_up
    if policy not in CATCH_UP_POLICIES:
        raise InvalidSchedule(name, "catch_up", f"must be one of {', '.join(CATCH_UP_POLICIES)}"
                                                f", not {policy!r}")
    cap = catch_up_max_default if catch_up_max is None else catch_up_max
    if (not isinstance(cap, int) or isinstance(cap, bool)
            or not 1 <= cap <= catch_up_max_ceiling):
        raise InvalidSchedule(name, "catch_up_max",
                              f"must be a whole number 1..{catch_up_max_ceiling}, not {cap!r}")
    if every_s is not None:
        if tz is not None:
            raise InvalidSchedule(name, "tz", "applies to cron schedules only (an interval "
                                              "is a duration, the same in every zone)")
        return ScheduleSpec(name=name, agent=agent, every_s=_interval(name, every_s),
                            catch_up=str(policy), catch_up_max=cap)
    zone_name = "UTC" if tz is None else tz
    zone_of(name, zone_name)
    expression = _cron(name, cron)
    spec = ScheduleSpec(name=name, agent=agent, cron=expression, time_zone=str(zone_name),
                        catch_up=str(policy), catch_up_max=cap)
    if next_tick_after(spec, dt.datetime.now(UTC)) is None:
        raise InvalidSchedule(name, "cron", f"{expression!r} matches no time in the next 50 "
                                            "years")
    return spec


def _check_text(name: str, field: str, value: str, chars_max: int) -> None:
    try:
        validate_text(value, f"a schedule's {field}", bytes_max=4 * chars_max)
    except InvalidInput as error:
        raise InvalidSchedule(name, field, str(error)) from None


def _interval(name: str, every_s: object) -> int:
    if isinstance(every_s, float) and every_s.is_integer():
        every_s = int(every_s)
    if not isinstance(every_s, int) or isinstance(every_s, bool):
        raise InvalidSchedule(name, "every_s", f"must be a whole number of seconds, not "
                                               f"{every_s!r}")
    if not 1 <= every_s <= every_s_max:
        raise InvalidSchedule(name, "every_s", f"must be 1..{every_s_max} seconds, not "
                                               f"{every_s}")
    return every_s


def _cron(name: str, cron: object) -> str:
    if not isinstance(cron, str) or not cron.strip():
        raise InvalidSchedule(name, "cron", f"must be a cron expression, not {cron!r}")
    if len(cron) > cron_chars_max:
        raise InvalidSchedule(name, "cron", f"longer than {cron_chars_max} characters")
    _check_text(name, "cron", cron, cron_chars_max)
    expression = " ".join(cron.split())
    expression = CRON_NAMES.get(expression.lower(), expression)
    try:
        CronSim(expression, dt.datetime(2000, 1, 1))
    except CronSimError as error:
        raise InvalidSchedule(name, "cron", f"{cron!r} is not a cron expression: "
                                            f"{error}") from None
    return expression


def zone_of(name: str, zone: object) -> ZoneInfo:
    """The time zone named ``zone`` (IANA, e.g. ``Europe/Riga``), else InvalidSchedule."""
    if not isinstance(zone, str) or not 1 <= len(zone) <= zone_chars_max:
        raise InvalidSchedule(name, "tz", f"must be an IANA time zone name, not {zone!r}")
    _check_text(name, "tz", zone, zone_chars_max)
    try:
        return ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError) as error:
        # ValueError: a key that is a path ("../x"); OSError: an unreadable tz file.
        raise InvalidSchedule(name, "tz", f"unknown time zone {zone!r} ({error})") from None


def task_id_for(name: str, tick: dt.datetime) -> str:
    """The id of the task ``tick`` of schedule ``name`` submits: the same for every worker
    that fires it, so a tick can only ever make one task."""
    return f"{TASK_ID_PREFIX}{name}:{tick.astimezone(UTC):%Y%m%dT%H%M%SZ}"


def next_tick_after(spec: ScheduleSpec, after: dt.datetime) -> dt.datetime | None:
    """The first tick strictly after ``after`` (UTC), or None when the cron expression
    matches no time in the 50 years after it."""
    after = after.astimezone(UTC)
    if spec.every_s is not None:
        return _EPOCH + dt.timedelta(seconds=(_seconds(after) // spec.every_s + 1)
                                     * spec.every_s)
    assert spec.cron is not None
    ticks = CronSim(spec.cron, after.astimezone(ZoneInfo(spec.time_zone)))
    for _ in range(cron_steps_max):
        try:
            tick = next(ticks).astimezone(UTC)
        except StopIteration:
            return None
        # A fixed-time job is stepped in wall-clock time: from inside a repeated hour its
        # next match can be the first pass of that hour, already behind us.
        if tick > after:
            return tick
    return None


def due_ticks(spec: ScheduleSpec, first: dt.datetime, now: dt.datetime,
              limit: int) -> tuple[list[dt.datetime], bool]:
    """The ticks from ``first`` to ``now`` (both included), the latest ``limit`` of them in
    ascending order (UTC), and whether earlier ones were left out."""
    first, now = first.astimezone(UTC), now.astimezone(UTC)
    if now < first:
        return [], False
    if spec.every_s is not None:
        every = spec.every_s
        low = -(-_seconds(first) // every)
        high = _seconds(now) // every
        start = max(low, high - limit + 1)
        return ([_EPOCH + dt.timedelta(seconds=k * every) for k in range(start, high + 1)],
                start > low)
    assert spec.cron is not None
    # Backwards from just after now: no more steps than ticks wanted, however long the gap.
    ticks = CronSim(spec.cron, (now + dt.timedelta(seconds=1)).astimezone(
        ZoneInfo(spec.time_zone)), reverse=True)
    found: set[dt.datetime] = set()
    for _ in range(limit + cron_steps_max):
        try:
            tick = next(ticks).astimezone(UTC)
        except StopIteration:
            break
        if tick < first:
            break
        if tick <= now:
            found.add(tick)
            if len(found) > limit:
                break
    ordered = sorted(found)
    return ordered[-limit:], len(ordered) > limit


def plan_ticks(spec: ScheduleSpec, next_tick: dt.datetime, now: dt.datetime) -> TickPlan:
    """What to fire for a schedule whose next tick not yet fired is ``next_tick`` (due:
    at or before ``now``), by its catch-up policy (see the module's docstring)."""
    limit = spec.catch_up_max if spec.catch_up == "all" else 1
    due, more = due_ticks(spec, next_tick, now, limit)
    following = next_tick_after(spec, now)
    if not due:
        return TickPlan(fire=(), next_tick=following, missed=False, capped=False)
    latest = due[-1]
    if spec.catch_up == "all":
        return TickPlan(fire=tuple(due), next_tick=following, missed=more, capped=more)
    on_time = (now.astimezone(UTC) - latest).total_seconds() <= late_grace_s
    if spec.catch_up == "one" or on_time:
        return TickPlan(fire=(latest,), next_tick=following, missed=more, capped=False)
    return TickPlan(fire=(), next_tick=following, missed=True, capped=False)


def _seconds(instant: dt.datetime) -> int:
    """Whole seconds since the epoch, rounded down (ticks fall on whole seconds)."""
    delta = instant - _EPOCH
    return delta.days * 86_400 + delta.seconds
