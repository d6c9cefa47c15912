"""A manual clock for tests that skip time: no libfaketime, no waiting.

Put it on an engine before building a worker, and the runs of that worker read it::

    clock = ManualClock()
    engine.clock = clock
    worker = engine.worker()

What it controls (everything a run times through :class:`wal_engine.clock.Clock`):
``ctx.now()``; the due time a failed attempt records (``retry_at_ms``) and the in-memory
backoff before the next attempt, which :meth:`ManualClock.sleep` skips at once by moving
the clock forward; an escalation's ``not_before_ms``; the ``wake_at_ms`` a durable sleep
records; a task's runtime against ``max_runtime_s``.

What it does not: anything the database times with its own ``now()`` (leases and their
expiry, when a durable timer or a long retry's timer is due, the sweep), the worker's lease
keeper (its own thread, the operating system's monotonic clock), and ``timeout_s`` of a
call (asyncio's loop clock). A task parked on a durable timer waits for the database's
clock; ``wal_engine.testing.crash`` has helpers that make its timers due.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Final

manual_clock_start_s: Final = 1_800_000_000.0
"""Where a manual clock starts by default (2027-01-15, a fixed point so tests repeat)."""


class ManualClock:
    """A :class:`wal_engine.clock.Clock` that moves only when told to, or when slept on.

    ``sleep(s)`` advances the clock by ``s`` and returns after one turn of the event loop,
    so a backoff of an hour takes no time. Thread-safe (sync tools run on threads).
    """

    def __init__(self, start_s: float = manual_clock_start_s) -> None:
        self._lock = threading.Lock()
        self._now_s = float(start_s)
        self._monotonic_s = 0.0
        self.slept_s = 0.0
        """How long the runs slept on this clock in all (skipped, not waited)."""

    def time_s(self) -> float:
        """The clock's wall time (seconds since the epoch)."""
        with self._lock:
            return self._now_s

    def monotonic_s(self) -> float:
        """The clock's monotonic time (seconds since it was made, as moved)."""
        with self._lock:
            return self._monotonic_s

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (never back).

        Raises:
            ValueError: ``seconds`` is negative or not finite.
        """
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"a manual clock moves forward by a finite amount, not {seconds}")
        with self._lock:
            self._now_s += seconds
            self._monotonic_s += seconds

    async def sleep(self, seconds: float) -> None:
        """Skip ``seconds``: the clock moves forward at once; the loop turns once."""
        seconds = max(0.0, seconds)
        self.advance(seconds)
        with self._lock:
            self.slept_s += seconds
        await asyncio.sleep(0)
