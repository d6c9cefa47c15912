"""Rate limiters shared by every worker of a tenant: define them, list them, and take a
grant for one attempt of a call before its intent is written.

A limiter is a row of ``wal_limiters`` (``schema.sql``, section "limiters"): a limit in
requests and/or tokens (input, output or both, as an LLM call records them) per sliding
period. An attempt of a call made with ``limiter=`` takes a grant first
(:func:`acquire`, one statement: ``wal_limiter_reserve``): granted, or told how long until
enough of the window's earlier grants have left it. A short wait sleeps in process and asks
again; a wait longer than the call's ``RetryPolicy.durable_after_s`` parks the task on a
durable timer (the lease is dropped, any worker resumes it). The grant carries the call's
token estimate; once the LLM's response is in the log, :func:`settle` replaces the
estimate with the recorded usage. A provider's 429 (:class:`~wal_engine.errors.RateLimited`)
blocks the limiter until its Retry-After (:func:`block`).

Grants are keyed by (task, call key): ``<call id>:<attempt>`` for an attempt whose intent
is not yet in the log, so a run that crashed between its grant and its intent finds the
grant again (no second count); ``<call id>:<attempt>:e<epoch>`` for an attempt sent again
because a crash left it in doubt (the provider may have seen it already: it counts again).
A recorded call is answered from the log and takes no grant. A worker killed while holding
a grant leaves it counted until its window passes: the limit is never exceeded by a crash.

The statements live here, beside their code, as the schedules' do.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec

from replay.state import CallStatus
from wal_engine import events as ev
from wal_engine.clock import now_ms
from wal_engine.errors import InvalidInput, InvalidLimiter, UnknownLimiter
from wal_engine.observability import metrics
from wal_engine.runtime.control import INTERNAL_PREFIX, Suspended

if TYPE_CHECKING:
    from wal_engine.runtime.ports import Run
    from wal_engine.store import Database

TokenKind = Literal["input", "output", "both"]
LIMIT_TIMER_PREFIX: Final = f"{INTERNAL_PREFIX}limit:"
"""Durable timers of limiter waits: ``~limit:<call id>:<attempt>:<n>``."""
name_pattern: Final = re.compile(r"[A-Za-z0-9_.:/-]{1,100}")
limit_max: Final = 10**15
period_s_max: Final = 86400.0
poll_max_s: Final = 0.25
"""Longest in-process sleep between two asks: an estimate settled lower than it was frees
capacity before the window says, and a waiter should see it."""
waits_max: Final = 100_000
"""Bound on the asks of one attempt (each ask sleeps; the bound is never reached in use)."""
list_rows_max: Final = 10_000

_COLUMNS: Final = """l.name, l.requests_per_period, l.tokens_per_period, l.token_kind,
    l.period_s, l.blocked_until, l.created_at, l.updated_at"""
_MINE: Final = "l.tenant = current_setting('wal.tenant', true)"
DEFINE_LIMITER: Final = """
INSERT INTO wal_limiters AS l (name, requests_per_period, tokens_per_period, token_kind,
                              period_s)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (tenant, name) DO UPDATE
   SET requests_per_period = $2, tokens_per_period = $3, token_kind = $4, period_s = $5,
       updated_at = now()
"""
# What each limiter holds now: grants in the window (all, and those still at their
# estimate), their tokens, and the database's now.
LIMITER_STATE: Final = f"""
SELECT {_COLUMNS}, clock_timestamp() AS now,
       count(r.*) AS requests_in_window,
       coalesce(sum(r.tokens), 0) AS tokens_in_window,
       count(r.*) FILTER (WHERE NOT r.settled) AS requests_reserved,
       coalesce(sum(r.tokens) FILTER (WHERE NOT r.settled), 0) AS tokens_reserved
  FROM wal_limiters l
  LEFT JOIN wal_limiter_reservations r
    ON r.tenant = l.tenant AND r.name = l.name
   AND r.reserved_at > clock_timestamp() - make_interval(secs => l.period_s)
 WHERE {_MINE} AND ($1::text IS NULL OR l.name = $1) AND l.name > $2
 GROUP BY l.tenant, l.name
 ORDER BY l.name
 LIMIT $3
"""
RESERVE: Final = "SELECT granted, wait_ms FROM wal_limiter_reserve($1, $2, $3, $4)"
SETTLE: Final = "SELECT wal_limiter_settle($1, $2, $3, $4, $5)"
BLOCK: Final = "SELECT wal_limiter_block($1, $2)"
DELETE_LIMITER: Final = "SELECT wal_delete_limiter($1)"


class LimiterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A limiter's definition and state (times in UTC, as the database saw them).

    ``requests_in_window`` and ``tokens_in_window`` count every grant of the sliding
    window; ``requests_reserved`` and ``tokens_reserved`` the part of it still at its
    estimate (calls in flight, or whose worker died before settling: they stay counted).
    ``blocked_until`` is a provider's Retry-After, None when it has passed or never came.
    """

    name: str
    requests_per_period: int | None
    tokens_per_period: int | None
    token_kind: str
    period_s: float
    requests_in_window: int
    tokens_in_window: int
    requests_reserved: int
    tokens_reserved: int
    blocked_until: dt.datetime | None
    created_at: dt.datetime
    updated_at: dt.datetime


class CallLimit(msgspec.Struct, frozen=True, kw_only=True):
    """A call's limiter and the tokens its grant reserves (the estimate)."""

    name: str
    tokens: int


# ------------------------------------------------------------------ definitions


def checked_name(name: object) -> str:
    """``name`` if it can be a limiter's, else :class:`InvalidLimiter`."""
    if not isinstance(name, str) or not name_pattern.fullmatch(name):
        raise InvalidLimiter(name, "name", "must be 1..100 letters, digits, '_ . : / -'")
    return name


def _checked_limit(name: str, field: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit_max:
        raise InvalidLimiter(name, field, f"must be a whole number of 1..{limit_max}, "
                                          f"not {value!r}")
    return value


def checked_tokens(name: str, field: str, value: object) -> int:
    """A token count a call reserves: a whole number of 0.. (else InvalidLimiter)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit_max:
        raise InvalidLimiter(name, field, f"must be a whole number of 0..{limit_max}, "
                                          f"not {value!r}")
    return value


async def define_limiter(database: Database, name: str, *,
                         requests_per_period: int | None, tokens_per_period: int | None,
                         period_s: float, tokens: TokenKind) -> LimiterInfo:
    """Create ``name``, or change its limits (its grants in the window stay counted)."""
    name = checked_name(name)
    requests = _checked_limit(name, "requests_per_period", requests_per_period)
    token_limit = _checked_limit(name, "tokens_per_period", tokens_per_period)
    if requests is None and token_limit is None:
        raise InvalidLimiter(name, "requests_per_period",
                             "give requests_per_period, tokens_per_period or both")
    if isinstance(period_s, bool) or not isinstance(period_s, int | float) \
            or not math.isfinite(period_s) or not 0 < period_s <= period_s_max:
        raise InvalidLimiter(name, "period_s",
                             f"must be a number of seconds in (0, {period_s_max:g}]")
    if tokens not in ("input", "output", "both"):
        raise InvalidLimiter(name, "tokens", "must be 'input', 'output' or 'both'")
    await database.fetch(DEFINE_LIMITER, name, requests, token_limit, tokens, float(period_s))
    return await read_limiter(database, name)


async def list_limiters(database: Database, *, after: str = "",
                        limit: int = list_rows_max) -> list[LimiterInfo]:
    """This tenant's limiters and their state, by name."""
    rows = await database.fetch(LIMITER_STATE, None, after, max(1, min(limit, list_rows_max)))
    return [_info(row) for row in rows]


async def read_limiter(database: Database, name: str) -> LimiterInfo:
    """One limiter and its state; :class:`UnknownLimiter` when there is none."""
    rows = await database.fetch(LIMITER_STATE, checked_name(name), "", 1)
    if not rows:
        raise UnknownLimiter(name)
    return _info(rows[0])


async def delete_limiter(database: Database, name: str) -> None:
    """Delete ``name`` and its grants; :class:`UnknownLimiter` when there is none."""
    row = await database.fetchrow(DELETE_LIMITER, checked_name(name))
    if row is None or not row[0]:
        raise UnknownLimiter(name)


def _info(row: Any) -> LimiterInfo:
    blocked = row["blocked_until"]
    if blocked is not None and blocked <= row["now"]:
        blocked = None
    return LimiterInfo(
        name=row["name"], requests_per_period=row["requests_per_period"],
        tokens_per_period=row["tokens_per_period"], token_kind=row["token_kind"],
        period_s=float(row["period_s"]), requests_in_window=int(row["requests_in_window"]),
        tokens_in_window=int(row["tokens_in_window"]),
        requests_reserved=int(row["requests_reserved"]),
        tokens_reserved=int(row["tokens_reserved"]), blocked_until=blocked,
        created_at=row["created_at"], updated_at=row["updated_at"])


# ------------------------------------------------------------------ calls


def call_key(call_id: str, attempt: int, epoch: int | None = None) -> str:
    """The key of one attempt's grant (with ``epoch``: an in-doubt attempt sent again)."""
    return f"{call_id}:{attempt}" if epoch is None else f"{call_id}:{attempt}:e{epoch}"


async def acquire(run: Run, limit: CallLimit, call_id: str, attempt: int, key: str, *,
                  durable_after_s: float) -> None:
    """Take a grant of ``limit`` for this attempt, waiting as long as it takes: in process
    for a short wait, on a durable timer (raises :class:`Suspended`) for a long one.

    Raises:
        UnknownLimiter: no limiter of that name (before anything of the call is written).
        InvalidLimiter: the estimate exceeds the limiter's token limit: it could never be
            granted.
    """
    timer_base = f"{LIMIT_TIMER_PREFIX}{call_id}:{attempt}:"
    timers = 0
    while (timer := run.view.calls.get(f"{timer_base}{timers}")) is not None:
        if timer.status is CallStatus.PENDING:  # Woken by its timer: the wait is over.
            await run.append([ev.TimerFired(timer_id=f"{timer_base}{timers}")])
        timers += 1
    database = run.services.database
    clock = run.services.clock
    waited_s = 0.0
    for _ in range(waits_max):
        try:
            row = await database.fetchrow(RESERVE, limit.name, run.task_id, key, limit.tokens,
                                          task_id=run.task_id)
        except InvalidLimiter:
            raise
        except InvalidInput as error:  # An estimate above the token limit: never granted.
            raise InvalidLimiter(limit.name, "estimate_tokens", str(error)) from error
        if row["granted"]:
            metrics.limiter_granted(limit.name, waited_s)
            return
        wait_s = int(row["wait_ms"]) / 1000
        if wait_s > durable_after_s:
            metrics.limiter_parked(limit.name)
            run.log.info("limiter_wait_durable", limiter=limit.name, call_id=call_id,
                         wait_s=round(wait_s, 3))
            wake = now_ms(clock) + int(row["wait_ms"])
            await run.append([ev.TimerStarted(timer_id=f"{timer_base}{timers}",
                                              wake_at_ms=wake, duration_ms=int(row["wait_ms"]))])
            raise Suspended
        pause = min(wait_s, poll_max_s)
        await clock.sleep(pause)
        waited_s += pause
        run.check_live()
    raise InvalidLimiter(limit.name, "tokens", f"not granted after {waits_max} asks")


async def settle(run: Run, limit: CallLimit, key: str, input_tokens: int,
                 output_tokens: int) -> None:
    """Replace the grant's estimate with the usage the log recorded (input, output or both
    tokens, as the limiter counts), after the result is durable: a crash in between leaves
    the estimate counted until the window passes, never less."""
    await run.services.database.fetch(SETTLE, limit.name, run.task_id, key, input_tokens,
                                      output_tokens, task_id=run.task_id)


async def block(run: Run, limit: CallLimit, retry_after_s: float | None) -> None:
    """A provider said 429: grant nothing under the limiter until Retry-After has passed
    (a 429 without one blocks nothing: the call's own backoff spaces its retry)."""
    metrics.limiter_rate_limited(limit.name)
    if retry_after_s is None or isinstance(retry_after_s, bool) \
            or not isinstance(retry_after_s, int | float) or not math.isfinite(retry_after_s):
        return
    seconds = min(max(float(retry_after_s), 0.0), period_s_max)
    run.log.info("limiter_blocked", limiter=limit.name, retry_after_s=seconds)
    await run.services.database.fetch(BLOCK, limit.name, seconds, task_id=run.task_id)

