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

import enum
import hashlib
from typing import Final

import msgspec

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

_transient_builtin: Final = (TransientError, TimeoutError, ConnectionError)


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
