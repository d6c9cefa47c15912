"""The one clock and the one source of randomness of the running side.

Agent runs read the wall clock (``ctx.now()``, the due time of a retry, an escalation's
grace period), a monotonic clock (a task's runtime against its budget), sleep (a short
retry backoff waited in memory) and draw random numbers (``ctx.random()``) only through a
:class:`Clock` and a :class:`RandomSource` given to them with their services, so that a
test can put a manual clock in their place (:class:`wal_engine.testing.ManualClock`) and
skip time without libfaketime.

Not covered, on purpose: whatever the database times with its own ``now()`` (leases, the
wake-up of a durable timer, the sweep of expired leases) and the worker's lease keeper,
which trusts a lease by the operating system's monotonic clock on a thread of its own; and
``timeout_s`` of a call, which asyncio times on the event loop's clock.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Final, Protocol


class Clock(Protocol):
    """Wall time, monotonic time and sleeping, as a run reads them."""

    def time_s(self) -> float:
        """Seconds since the Unix epoch (wall clock)."""
        ...

    def monotonic_s(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a short backoff between two attempts of a call)."""
        ...


class RandomSource(Protocol):
    """Random numbers, as ``ctx.random()`` draws them (:class:`random.Random` is one)."""

    def random(self) -> float:
        """A number in [0, 1)."""
        ...


class SystemClock:
    """The operating system's clocks and asyncio's sleep."""

    def time_s(self) -> float:
        """``time.time()``."""
        return time.time()

    def monotonic_s(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """``asyncio.sleep``."""
        await asyncio.sleep(seconds)


SYSTEM_CLOCK: Final[Clock] = SystemClock()
"""The clock every engine uses unless given another."""
SYSTEM_RANDOM: Final[RandomSource] = random.Random()
"""The random source every engine uses unless given another (not for secrets)."""


def now_ms(clock: Clock) -> int:
    """``clock``'s wall time in whole milliseconds since the epoch."""
    return round(clock.time_s() * 1000)
