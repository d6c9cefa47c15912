"""Retry policy (pure): which failures are retried, and exponential backoff with full jitter.

:func:`classify_failure` is the one table that decides, for each kind of call and each way
an attempt can fail, whether it is retried under the same key, recorded as a failure, or in
doubt (the callee may have acted: ask its ``lookup``, else escalate per ``on_uncertain``).
A call that is not safe to repeat is retried only on an error that says it did not act.

The jitter is a hash of (task id, intent seq, attempt), not a random draw, so a replay of
the log computes exactly the delays that were recorded and two tasks failing together do
not retry in lockstep. Waits longer than ``durable_after_s`` become durable timers (the task
releases its lease and sleeps in the database), never a coroutine sleeping on a lease.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import msgspec

from wal_engine.errors import ConnectionLost
from wal_engine.errors import DidNotAct as DidNotAct
from wal_engine.errors import LeaseExpired as LeaseExpired
from wal_engine.errors import PermanentError as PermanentError
from wal_engine.errors import TransientError as TransientError


class Disposition(enum.StrEnum):
    """What follows a failed attempt (see :func:`classify_failure`)."""

    RETRY = "retry"
    """Another attempt under the same idempotency key, after the backoff."""
    FAIL = "fail"
    """Recorded as the call's failure; agent code gets a ``ToolError``."""
    IN_DOUBT = "in_doubt"
    """The callee may have acted: ask its ``lookup`` if it has one, else escalate."""


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How a tool's failures are retried.

    Attributes:
        max_attempts: Attempts in all, the first included; 1 disables retries.
        initial_delay_s: Cap of the first backoff delay.
        multiplier: Growth of the cap per attempt.
        max_delay_s: Largest cap.
        durable_after_s: Delays longer than this become durable timers.
        retry_on: Names of exception classes (their ``__name__``) treated as transient in
            addition to :class:`TransientError`, ``TimeoutError`` and ``ConnectionError``
            (for calls that are safe to repeat).
        did_not_act_on: Names of exception classes that say the attempt did not act, in
            addition to :class:`DidNotAct` (for example a client library's "connection
            refused" error): such a failure is retried for every kind of call.
    """

    max_attempts: int = 3
    initial_delay_s: float = 0.5
    multiplier: float = 2.0
    max_delay_s: float = 60.0
    durable_after_s: float = 5.0
    retry_on: tuple[str, ...] = ()
    did_not_act_on: tuple[str, ...] = ()


NO_RETRY: Final = RetryPolicy(max_attempts=1)
DEFAULT_POLICY: Final = RetryPolicy()

_transient_builtin: Final = (TransientError, TimeoutError, ConnectionError, ConnectionLost)
"""ConnectionLost is the engine's own typed form of a ConnectionError (a tool using the
engine's database meets it where it met the driver's ConnectionError before)."""


def is_transient(error: BaseException, policy: RetryPolicy) -> bool:
    """Whether ``error`` may go away on another attempt under ``policy``."""
    if isinstance(error, PermanentError):
        return False
    if isinstance(error, _transient_builtin):
        return True
    return _named(error, policy.retry_on)


def _named(error: BaseException, names: tuple[str, ...]) -> bool:
    return bool(names) and any(cls.__name__ in names for cls in type(error).__mro__)


def did_not_act(error: BaseException, policy: RetryPolicy) -> bool:
    """Whether ``error`` says the attempt did not act (:class:`DidNotAct` or a class the
    policy names in ``did_not_act_on``)."""
    return isinstance(error, DidNotAct) or _named(error, policy.did_not_act_on)


def classify_failure(error: BaseException, policy: RetryPolicy, attempt: int, *,
                     repeat_safe: bool) -> Disposition:
    """What follows attempt number ``attempt`` of a call that raised ``error``.

    ``repeat_safe`` is true for an idempotent tool and an LLM call (another delivery under
    the same key is safe); false for a non-idempotent tool, whose every failure but a
    declared "did not act" (or a declared permanent failure) is in doubt. A timeout is a
    ``TimeoutError``: transient for a call safe to repeat, in doubt for the others.
    """
    more = attempt < policy.max_attempts
    if isinstance(error, LeaseExpired):
        # Not the call's failure but this worker's: the next owner makes the attempt, so it
        # never uses up the policy (the run stops after recording it).
        return Disposition.RETRY
    if did_not_act(error, policy):
        return Disposition.RETRY if more else Disposition.FAIL
    if isinstance(error, PermanentError):
        return Disposition.FAIL
    if not repeat_safe:
        return Disposition.IN_DOUBT
    return Disposition.RETRY if more and is_transient(error, policy) else Disposition.FAIL


def jitter_fraction(task_id: str, seq: int, attempt: int) -> float:
    """A deterministic number in [0, 1) from the position of the attempt in the history."""
    digest = hashlib.sha256(f"{task_id}\n{seq}\n{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def backoff_delay_s(policy: RetryPolicy, task_id: str, seq: int, attempt: int) -> float:
    """Delay before attempt ``attempt + 1`` after attempt ``attempt`` failed (full jitter)."""
    cap = min(policy.max_delay_s, policy.initial_delay_s * policy.multiplier ** (attempt - 1))
    return cap * jitter_fraction(task_id, seq, attempt)


def should_retry(policy: RetryPolicy, attempt: int, error: BaseException) -> bool:
    """Whether another attempt follows attempt number ``attempt`` that raised ``error``."""
    return attempt < policy.max_attempts and is_transient(error, policy)


# ---------------------------------------------------------------------------------------
# Infrastructure retries: the engine's own statements, reconnects and read-backs (never a
# tool's call, whose attempts are recorded in the log). One policy per kind of operation.


class InfraPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How one kind of infrastructure operation is retried (:func:`retrying`).

    Attributes:
        name: The kind of operation; part of the jitter, and logged.
        attempts_max: Attempts in all, the first included; None: bounded by ``deadline_s``
            only (and by nothing when that is None too: reconnect loops that run until the
            worker stops).
        deadline_s: No attempt starts after this many seconds from the first; None: none.
        initial_delay_s: Cap of the first backoff delay.
        multiplier: Growth of the cap per attempt.
        max_delay_s: Largest cap.
        jitter: Full jitter (a deterministic fraction of the cap, see :func:`infra_jitter`)
            so that many clients failing together do not retry in lockstep; False: the cap.
    """

    name: str
    attempts_max: int | None = 3
    deadline_s: float | None = None
    initial_delay_s: float = 0.05
    multiplier: float = 2.0
    max_delay_s: float = 1.0
    jitter: bool = True

    def delay_s(self, attempt: int, key: str = "") -> float:
        """Delay after attempt number ``attempt`` failed (``key`` spreads the jitter)."""
        cap = min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (attempt - 1))
        return cap * infra_jitter(self.name, key, attempt) if self.jitter else cap

    def exhausted(self, attempt: int, elapsed_s: float) -> bool:
        """Whether no attempt follows attempt number ``attempt`` after ``elapsed_s``."""
        if self.attempts_max is not None and attempt >= self.attempts_max:
            return True
        return self.deadline_s is not None and elapsed_s >= self.deadline_s


def infra_jitter(name: str, key: str, attempt: int) -> float:
    """A deterministic number in [0, 1) for attempt ``attempt`` of operation ``name`` on
    ``key``: a failing run reproduces its delays, and two keys do not retry together."""
    digest = hashlib.sha256(f"infra\n{name}\n{key}\n{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


STATEMENT_RETRY: Final = InfraPolicy(name="statement", attempts_max=3, initial_delay_s=0.1,
                                     max_delay_s=0.4)
"""A statement of its own rolled back whole (deadlock, lock or statement timeout): run it
again (store/connection.py ``Database.fetch``)."""
GATEWAY_TRANSACTION_RETRY: Final = InfraPolicy(name="gateway_transaction", attempts_max=3,
                                               initial_delay_s=0.1, max_delay_s=0.4)
"""The exactly-once transaction of the gateway rolled back whole, or lost the key's race."""
EMIT_RETRY: Final = InfraPolicy(name="emit", attempts_max=10, initial_delay_s=0.005,
                                multiplier=1.5, max_delay_s=0.05)
"""A database-written event (cancel, signal wake) lost its seq to the task's own append."""
RESOLVE_RETRY: Final = InfraPolicy(name="resolve", attempts_max=None, deadline_s=30.0,
                                   initial_delay_s=0.05, max_delay_s=1.0, jitter=False)
"""Reading back an append whose answer was lost, until the database answers or 30 s pass
(then :class:`~wal_engine.errors.AmbiguousCommit`)."""
RECONNECT_RETRY: Final = InfraPolicy(name="reconnect", attempts_max=None,
                                     initial_delay_s=0.05, max_delay_s=5.0)
"""A dedicated session (sweep, LISTEN, lease renewals) reconnecting until its loop stops."""
RUN_RECONNECT_RETRY: Final = InfraPolicy(name="run_reconnect", attempts_max=None,
                                         initial_delay_s=0.05, max_delay_s=2.0, jitter=False)
"""A task run waiting for the database while its lease can be trusted (the caller's
``retry_if`` checks the lease, which bounds it)."""
CLAIM_RETRY: Final = InfraPolicy(name="claim", attempts_max=3, initial_delay_s=0.05,
                                 max_delay_s=1.0)
"""A worker's claim or registration statement failing while the database is away: a few
quick attempts, then the claim loop's own poll (so a draining worker is not held up)."""
READ_RETRY: Final = InfraPolicy(name="read", attempts_max=None, initial_delay_s=0.05,
                                max_delay_s=1.0)
"""A read that is simply made again (``engine.wait`` polling through an outage); bounded
by the caller's own timeout."""
UNAVAILABLE_RETRY_S_DEFAULT: Final = 30.0
"""How long a call of the public API that is safe to repeat is retried while the database
is away (``connect(unavailable_retry_s=...)``): longer than a Patroni failover with its
default ``ttl`` of 30 s and ``loop_wait`` of 10 s usually takes once the leader's node is
gone (10-30 s), and than a switchover or a restarted postmaster (a few seconds)."""


def api_policy(deadline_s: float) -> InfraPolicy:
    """The retries of a public API call through an outage: no attempt starts after
    ``deadline_s``, delays grow from 0.1 s to 2 s with full jitter (0: never retried)."""
    return InfraPolicy(name="api", attempts_max=1 if deadline_s <= 0 else None,
                       deadline_s=max(deadline_s, 0.0), initial_delay_s=0.1,
                       multiplier=2.0, max_delay_s=2.0)


CONNECT_WAIT_POLICY_NAME: Final = "connect_wait"


def connect_wait_policy(deadline_s: float) -> InfraPolicy:
    """A process waiting for the database at start (``connect(connect_wait_s=...)``, the
    worker's ``--wait-for-db``): delays grow from 0.2 s to 5 s with full jitter, no
    attempt starts after ``deadline_s``."""
    return InfraPolicy(name=CONNECT_WAIT_POLICY_NAME, attempts_max=None,
                       deadline_s=max(deadline_s, 0.0), initial_delay_s=0.2,
                       multiplier=2.0, max_delay_s=5.0)

T = TypeVar("T")


async def retrying(
    policy: InfraPolicy,
    operation: Callable[[], Awaitable[T]],
    *,
    retry_if: Callable[[BaseException], bool],
    key: str = "",
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Run ``operation`` until it returns, retrying the errors ``retry_if`` accepts.

    The last error is raised unchanged when ``retry_if`` refuses it or ``policy`` is
    exhausted (callers translate it: the retried error is theirs to name). ``on_retry``
    hears ``(error, attempt, delay_s)`` before each sleep; ``sleep`` and ``clock`` are the
    time sources (injected by tests). A policy with a deadline never sleeps past it: the
    last attempt starts at the deadline at the latest.
    """
    started = clock()
    attempt = 1
    while True:
        try:
            return await operation()
        except Exception as error:
            elapsed = clock() - started
            if not retry_if(error) or policy.exhausted(attempt, elapsed):
                raise
            delay = policy.delay_s(attempt, key)
            if policy.deadline_s is not None:
                delay = min(delay, max(0.0, policy.deadline_s - elapsed))
            if on_retry is not None:
                on_retry(error, attempt, delay)
        await sleep(delay)
        attempt += 1
