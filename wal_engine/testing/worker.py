"""A worker process for crash tests: ``python -m wal_engine.testing.worker DSN ID SPEC [N]``.

``SPEC`` names the function that registers the agents, ``package.module:function`` (sync or
async, called with the engine). Timings come from ``WAL_ENGINE_TEST_LEASE_TTL_MS``,
``WAL_ENGINE_TEST_HEARTBEAT_MS``, ``WAL_ENGINE_TEST_POLL_MS`` and (optional)
``WAL_ENGINE_TEST_DRAIN_TIMEOUT_S``; a failpoint from
``ENGINE_FAILPOINT`` (``name:nth:sigkill``). Prints ``ready`` once it works and exits 0 on
SIGTERM after handing its tasks back. With ``WAL_ENGINE_TEST_ACK_LOG`` set to a file, every
append the worker saw acknowledged is written to it, one line each (wall times sent and
acknowledged, task, seq, hash; :func:`read_ack_log` reads it back), so that a test can check
a subprocess's acknowledged appends (I1) after a fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Final, NamedTuple

LEASE_TTL_ENV: Final = "WAL_ENGINE_TEST_LEASE_TTL_MS"
HEARTBEAT_ENV: Final = "WAL_ENGINE_TEST_HEARTBEAT_MS"
POLL_ENV: Final = "WAL_ENGINE_TEST_POLL_MS"
DRAIN_TIMEOUT_ENV: Final = "WAL_ENGINE_TEST_DRAIN_TIMEOUT_S"
ACK_LOG_ENV: Final = "WAL_ENGINE_TEST_ACK_LOG"
READY: Final = "ready"


class AckLine(NamedTuple):
    """One acknowledged append a worker wrote to its ack log."""

    sent: float
    """Wall time (``time.time()``) when the append was handed to the committer."""
    at: float
    """Wall time when it returned acknowledged."""
    task_id: str
    seq: int
    hash: bytes


def _log_acks(engine: Any, path: str) -> None:
    """Write every append ``engine``'s runs see acknowledged to ``path`` (line-buffered:
    a line is written when its append returned, so a SIGKILL loses at most that line)."""
    log = open(path, "a", buffering=1)  # Open for the process's lifetime.
    committer = engine.committer
    original = committer.append

    async def append(pending: Any) -> Any:
        sent = time.time()
        result = await original(pending)
        log.write(f"{sent:.6f}\t{time.time():.6f}\t{result.task_id}\t{result.head_seq}\t"
                  f"{result.head_hash.hex()}\n")
        return result

    committer.append = append


def read_ack_log(path: str | os.PathLike[str]) -> list[AckLine]:
    """The lines of an ack log (see the module docstring); a torn last line is skipped."""
    lines = []
    with contextlib.suppress(FileNotFoundError), open(path) as log:
        for line in log:
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 5 and line.endswith("\n"):
                lines.append(AckLine(float(parts[0]), float(parts[1]), parts[2],
                                     int(parts[3]), bytes.fromhex(parts[4])))
    return lines


def load_register(spec: str) -> Callable[[Any], Any]:
    """The function ``package.module:function`` names."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise SystemExit(f"register spec must be package.module:function, not {spec!r}")
    function: Callable[[Any], Any] = getattr(importlib.import_module(module_name), attribute)
    return function


async def serve(dsn: str, worker_id: str, spec: str, concurrency: int) -> None:
    """Register the agents, run a worker until SIGTERM."""
    from wal_engine.engine import connect
    from wal_engine.runtime.worker import WorkerConfig

    engine = await connect(dsn, migrate=False)
    try:
        if os.environ.get(ACK_LOG_ENV):
            _log_acks(engine, os.environ[ACK_LOG_ENV])
        registered = load_register(spec)(engine)
        if inspect.isawaitable(registered):
            await registered
        ttl_ms = int(os.environ.get(LEASE_TTL_ENV, "1000"))
        heartbeat_ms = int(os.environ.get(HEARTBEAT_ENV, "250"))
        poll_ms = int(os.environ.get(POLL_ENV, "100"))
        drain_s = float(os.environ.get(DRAIN_TIMEOUT_ENV, WorkerConfig().drain_timeout_s))
        worker = engine.worker(concurrency=concurrency, worker_id=worker_id,
                               lease_ttl_ms=ttl_ms, heartbeat_ms=heartbeat_ms, poll_ms=poll_ms,
                               sweep_ms=max(50, heartbeat_ms), drain_timeout_s=drain_s)
        print(READY, flush=True)
        await worker.run(install_signal_handlers=True)
    finally:
        await engine.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point (see the module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4):
        raise SystemExit("usage: python -m wal_engine.testing.worker DSN WORKER_ID "
                         "package.module:register [CONCURRENCY]")
    asyncio.run(serve(args[0], args[1], args[2], int(args[3]) if len(args) == 4 else 4))


if __name__ == "__main__":
    main()
