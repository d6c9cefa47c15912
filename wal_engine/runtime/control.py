"""What unwinds agent code, the engine's reserved names, and the call in flight.

A leaf of the running side: the run, the context and the call driver all import it, and it
imports none of them. The three exceptions are ``BaseException`` subclasses so that agent
code's ``except Exception`` cannot swallow them.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from wal_engine.effects.gateway import Claim

INTERNAL_PREFIX: Final = "~"
"""Call ids and signal names the engine uses for its own waits (approvals, reconciliation,
retry timers). The journal the agent code is matched against leaves them out, and
``engine.signal`` and ``ctx.wait_for_signal`` refuse them."""
APPROVAL_SIGNAL_PREFIX: Final = f"{INTERNAL_PREFIX}approval:"
"""The signal ``engine.approve`` sends for a call awaiting approval (then its call id)."""
RECONCILE_SIGNAL_PREFIX: Final = f"{INTERNAL_PREFIX}reconcile:"
"""The signal ``engine.reconcile`` sends for an escalated call (then its call id)."""
RETRY_TIMER_PREFIX: Final = f"{INTERNAL_PREFIX}retry:"
"""The durable timer of a long retry backoff (then ``<call id>:<attempt>``)."""
CHILD_SIGNAL_PREFIX: Final = f"{INTERNAL_PREFIX}child:"
"""The signal a child task's ending puts in its parent's inbox (then the child's id; sent
by the database, schema.sql's wal_task_ended)."""


def approval_signal(call_id: str) -> str:
    """The internal signal that carries the approval of ``call_id``."""
    return f"{APPROVAL_SIGNAL_PREFIX}{call_id}"


def reconcile_signal(call_id: str) -> str:
    """The internal signal that carries the reconciliation of ``call_id``."""
    return f"{RECONCILE_SIGNAL_PREFIX}{call_id}"


class Suspended(BaseException):
    """Unwinds agent code when the task waits or is handed back.

    A BaseException so that agent code's ``except Exception`` cannot swallow it.
    """


class Fenced(BaseException):
    """Unwinds agent code when the lease is lost: nothing more may be written or done.

    A BaseException for the same reason as :class:`Suspended`.
    """


class Finished(BaseException):
    """Unwinds agent code after the engine recorded a terminal event (budget, escalation).

    A BaseException for the same reason as :class:`Suspended`.
    """


class StoppedAfterCall(asyncio.CancelledError):
    """The run was cancelled (a stop ran out of drain time) while a sync call's thread ran,
    and that thread has ended since: its outcome is known and is recorded before the run
    unwinds like the cancellation it is.

    Attributes:
        outcome: The finished attempt: its result, or the exception it raised (a
            :class:`~wal_engine.errors.CallTimedOut` if it ran past its ``timeout_s``).
        failed: Whether ``outcome`` is an exception.
    """

    def __init__(self, outcome: Any, *, failed: bool) -> None:
        super().__init__("the worker stopped during the call; its thread has ended")
        self.outcome = outcome
        self.failed = failed


class StoppedDuringCall(asyncio.CancelledError):
    """The run was cancelled a second time (a forced stop) while a sync call's thread was
    still running: the run ends without handing its task back, as in a crash; the lease
    lapses and the next owner treats the call as in doubt, with the reconcile grace."""


current_call_claim: contextvars.ContextVar[Claim | None] = contextvars.ContextVar(
    "wal_engine_current_call", default=None)
"""The call in flight in this coroutine or thread (its idempotency key and fencing epoch):
set by the call driver around each attempt, read by ``ctx.idempotency_key`` and tools."""
lease_check: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar(
    "wal_engine_lease_check", default=None)
"""Whether the running worker can still trust the lease of the call in flight (set with
:data:`current_call_claim`; None outside a call)."""
