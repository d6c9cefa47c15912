"""Retry policy (pure): exponential backoff with full jitter derived from the history.

The jitter is a hash of (task id, intent seq, attempt), not a random draw, so a replay of
the log computes exactly the delays that were recorded and two tasks failing together do
not retry in lockstep. Waits longer than ``durable_after_s`` become durable timers (the task
releases its lease and sleeps in the database), never a coroutine sleeping on a lease.
"""

from __future__ import annotations

import hashlib
from typing import Final

import msgspec


class TransientError(Exception):
    """Raise from a tool to say: this attempt failed, another may succeed."""


class PermanentError(Exception):
    """Raise from a tool to say: retrying cannot help; fail the call at once."""


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """How a tool's failures are retried.

    Attributes:
        max_attempts: Attempts in all, the first included; 1 disables retries.
        initial_delay_s: Cap of the first backoff delay.
        multiplier: Growth of the cap per attempt.
        max_delay_s: Largest cap.
        durable_after_s: Delays longer than this become durable timers.
        retry_on: Names of exception classes (their ``__name__``) treated as transient in
            addition to :class:`TransientError`, ``TimeoutError`` and ``ConnectionError``.
    """

    max_attempts: int = 3
    initial_delay_s: float = 0.5
    multiplier: float = 2.0
    max_delay_s: float = 60.0
    durable_after_s: float = 5.0
    retry_on: tuple[str, ...] = ()


NO_RETRY: Final = RetryPolicy(max_attempts=1)
DEFAULT_POLICY: Final = RetryPolicy()

_transient_builtin: Final = (TransientError, TimeoutError, ConnectionError)


def is_transient(error: BaseException, policy: RetryPolicy) -> bool:
    """Whether ``error`` may go away on another attempt under ``policy``."""
    if isinstance(error, PermanentError):
        return False
    if isinstance(error, _transient_builtin):
        return True
    return any(cls.__name__ in policy.retry_on for cls in type(error).__mro__)


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
