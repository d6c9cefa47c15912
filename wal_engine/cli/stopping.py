"""How ``wal-engine worker`` stops on a signal: SIGTERM and a first Ctrl-C drain (no new
claims; running tasks are handed back at their next durable point), with a countdown on
standard error; a second Ctrl-C stops at once: the worker's run is cancelled, which cancels
its task runs and hands their tasks back as far as it can; a task it could not hand back
resumes on another worker once its lease expires (nothing is lost, only delayed). A run whose
plain ``def`` tool is still running in its thread is kept through the drain until the thread
ends; on the second Ctrl-C the process exits at once with that thread (operate.py)."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING, Final

import click

if TYPE_CHECKING:
    from wal_engine.runtime.worker import Worker

countdown_interval_s: Final = 1.0


class StopHandlers:
    """The worker command's SIGTERM and SIGINT handlers (main thread only)."""

    def __init__(self, runner: Worker, running: asyncio.Task[None]) -> None:
        self.runner = runner
        self.running = running
        self.forced = False
        self._countdown: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()

    def install(self) -> None:
        """Take over SIGTERM and SIGINT for the worker's lifetime."""
        self._loop.add_signal_handler(signal.SIGTERM, self.runner.stop)
        self._loop.add_signal_handler(signal.SIGINT, self._interrupt)

    def remove(self) -> None:
        """Give the signals back and stop the countdown."""
        self._loop.remove_signal_handler(signal.SIGTERM)
        self._loop.remove_signal_handler(signal.SIGINT)
        if self._countdown is not None:
            self._countdown.cancel()

    def _interrupt(self) -> None:
        if self._countdown is None:
            self.runner.stop()
            self._countdown = asyncio.create_task(self._count_down())
            return
        self.forced = True
        running = len(self.runner.runs)
        click.echo(f"stopping now: cancelling {running} task run(s); a task not handed back "
                   "resumes on another worker once its lease expires", err=True)
        self.running.cancel()

    async def _count_down(self) -> None:
        deadline = time.monotonic() + self.runner.config.drain_timeout_s
        while not self.running.done():
            left = max(0.0, deadline - time.monotonic())
            click.echo(f"draining: {len(self.runner.runs)} task(s) handing back, at most "
                       f"{left:.0f} s left; Ctrl-C again to stop now", err=True)
            await asyncio.sleep(countdown_interval_s)
