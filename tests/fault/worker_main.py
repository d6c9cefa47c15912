"""A worker process for the fault tests: ``python -m tests.fault.worker_main DSN ID [N]``.

Timings come from the environment (``FAULT_LEASE_TTL_MS``, ``FAULT_HEARTBEAT_MS``), and a
failpoint from ``ENGINE_FAILPOINT``. Prints ``ready`` once it works; exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import sys

from tests.fault import agents
from wal_engine.engine import connect


async def main(dsn: str, worker_id: str, concurrency: int) -> None:
    engine = await connect(dsn, migrate=False)
    try:
        agents.register(engine)
        await agents.prepare(engine)
        ttl_ms = int(os.environ.get("FAULT_LEASE_TTL_MS", "1000"))
        heartbeat_ms = int(os.environ.get("FAULT_HEARTBEAT_MS", "250"))
        worker = engine.worker(concurrency=concurrency, worker_id=worker_id,
                               lease_ttl_ms=ttl_ms, heartbeat_ms=heartbeat_ms, poll_ms=100,
                               sweep_ms=200)
        print("ready", flush=True)
        await worker.run(install_signal_handlers=True)
    finally:
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 4))
