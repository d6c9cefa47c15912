"""Out-of-process crash injection: worker subprocesses a test starts, kills and pauses.

A :class:`WorkerProcess` runs ``python -m wal_engine.testing.worker`` with your agents'
register function; with ``failpoint="after_intent_commit:2:sigkill"`` it kills itself with
SIGKILL the second time it passes that point (no cleanup at all, like a power cut for the
process). :meth:`WorkerProcess.pause` and :meth:`WorkerProcess.resume` send SIGSTOP and
SIGCONT: a paused worker keeps its sockets and row locks but stops renewing its lease, the
dangerous "zombie" case (RELIABILITY.md finding 4).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from wal_engine.failpoints import ENV as FAILPOINT_ENV
from wal_engine.testing.worker import (
    DRAIN_TIMEOUT_ENV,
    HEARTBEAT_ENV,
    LEASE_TTL_ENV,
    POLL_ENV,
    READY,
)

start_timeout_s: Final = 30.0


class WorkerProcess:
    """One worker subprocess, its output in ``log_path``."""

    def __init__(self, dsn: str, worker_id: str, register: str, *, log_dir: Path,
                 failpoint: str | None = None, concurrency: int = 4,
                 lease_ttl_ms: int = 1000, heartbeat_ms: int = 250, poll_ms: int = 100,
                 env: Mapping[str, str] | None = None, wrapper: list[str] | None = None,
                 cwd: Path | None = None, drain_timeout_s: float | None = None) -> None:
        self.worker_id = worker_id
        environment = {**os.environ, **(env or {})}
        environment.pop(FAILPOINT_ENV, None)
        if failpoint:
            environment[FAILPOINT_ENV] = failpoint
        environment[LEASE_TTL_ENV] = str(lease_ttl_ms)
        environment[HEARTBEAT_ENV] = str(heartbeat_ms)
        environment[POLL_ENV] = str(poll_ms)
        environment.pop(DRAIN_TIMEOUT_ENV, None)
        if drain_timeout_s is not None:
            environment[DRAIN_TIMEOUT_ENV] = str(drain_timeout_s)
        self.log_path = log_dir / f"{worker_id}.log"
        self._log = self.log_path.open("wb")
        argv = [*(wrapper or []), sys.executable, "-m", "wal_engine.testing.worker", dsn,
                worker_id, register, str(concurrency)]
        self.process = subprocess.Popen(argv, env=environment, stdout=self._log,
                                        stderr=subprocess.STDOUT, cwd=cwd)

    @property
    def returncode(self) -> int | None:
        """The exit status (negative: killed by that signal), None while running."""
        return self.process.poll()

    def output(self) -> str:
        """Everything the worker printed so far."""
        return self.log_path.read_text(errors="replace")

    async def ready(self, timeout_s: float = start_timeout_s) -> None:
        """Wait until the worker prints ``ready`` (or exits)."""
        await wait_until(lambda: READY in self.output() or self.returncode is not None,
                         f"{self.worker_id} to start", timeout_s)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL by default) if the process still runs."""
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its connections but runs no more."""
        self.kill(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT."""
        self.kill(signal.SIGCONT)

    async def exited(self, timeout_s: float = 30.0) -> int:
        """Wait for the process to end; return its exit status."""
        await wait_until(lambda: self.returncode is not None, f"{self.worker_id} to exit",
                         timeout_s)
        code = self.returncode
        assert code is not None
        return code

    def close(self) -> None:
        """Kill and reap the process."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
        self.process.wait(timeout=30)
        self._log.close()


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0,
                     interval_s: float = 0.02) -> Any:
    """Poll ``predicate`` (sync or async) until it is truthy; AssertionError after the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


class WorkerPool:
    """Starts worker subprocesses for one test database and kills them all at the end."""

    def __init__(self, dsn: str, register: str, log_dir: Path, **defaults: Any) -> None:
        self.dsn = dsn
        self.register = register
        self.log_dir = log_dir
        self.defaults = defaults
        self.workers: list[WorkerProcess] = []

    def start(self, worker_id: str, **options: Any) -> WorkerProcess:
        """Start a worker without waiting for it (await its :meth:`WorkerProcess.ready`):
        several can then start at once, as replacements started ahead of a kill."""
        worker = WorkerProcess(self.dsn, worker_id, self.register, log_dir=self.log_dir,
                               **{**self.defaults, **options})
        self.workers.append(worker)
        return worker

    async def spawn(self, worker_id: str, **options: Any) -> WorkerProcess:
        """Start a worker and wait until it is ready."""
        worker = self.start(worker_id, **options)
        await worker.ready()
        return worker

    def close(self) -> None:
        """Kill every worker this pool started."""
        for worker in self.workers:
            worker.close()
