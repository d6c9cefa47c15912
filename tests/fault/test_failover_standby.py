"""A failover without Patroni: the module's own embedded server as the primary, a hot
standby made with ``pg_basebackup`` as its synchronous standby, the primary killed and the
standby promoted, while an engine connected through a multi-host DSN
(``primary,standby`` with ``target_session_attrs=read-write``) submits, signals and reads
and a worker runs tasks. Every call rides the failover (none raises), no acknowledged
submission is lost, and the worker keeps its tasks (a failover shorter than its lease)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import asyncpg
import pytest
from structlog.testing import capture_logs

from tests.fault.standby import HotStandby, with_hosts
from tests.fault.test_outage_api import ACTED, register
from wal_engine.engine import connect
from wal_engine.errors import DatabaseUnavailable
from wal_engine.testing.postgres import DatabaseFactory, TestServer


async def _synchronous(admin_dsn: str) -> None:
    """Make every commit of the primary wait for the standby (so that an acknowledged
    submission survives the primary's loss), and wait until the standby is in sync."""
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await admin.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while await admin.fetchval("SELECT count(*) FROM pg_stat_replication "
                                   "WHERE sync_state = 'sync'") == 0:
            assert time.monotonic() < deadline, "the standby never became synchronous"
            await asyncio.sleep(0.05)
    finally:
        await admin.close()


@pytest.mark.timeout(180)
async def test_a_failover_to_a_promoted_standby_is_ridden(
        crashable: tuple[TestServer, DatabaseFactory]) -> None:
    server, factory = crashable
    assert server.embedded is not None and server.embedded.port is not None
    dsn = await factory.create()
    standby = await asyncio.to_thread(HotStandby(server).create)
    try:
        await _synchronous(server.admin_dsn)
        # Only the standby, asking for a read-write session: refused, typed, nothing applied.
        with pytest.raises(DatabaseUnavailable) as refused:
            await connect(with_hosts(dsn, [standby.port], target_session_attrs="read-write"),
                          migrate=False, development=True)
        assert type(refused.value.__cause__).__name__ == "TargetServerAttributeNotMatched"
        assert refused.value.may_have_applied is False
        multi = with_hosts(dsn, [server.embedded.port, standby.port],
                           target_session_attrs="read-write")
        engine = await connect(multi, migrate=False, development=True, unavailable_retry_s=30)
        register(engine)
        workers = [f"fo-{n}" for n in range(4)]
        for task_id in workers:
            # 30 steps of 0.1 s: they span the failover (at 1 s, promoted about 1.3 s later).
            await engine.submit("steps", {"steps": 30, "delay_s": 0.1}, task_id=task_id)
        worker = engine.worker(concurrency=4, lease_ttl_ms=15_000, heartbeat_ms=1_000,
                               poll_ms=100, sweep_ms=500)
        acknowledged: list[str] = []
        failures: Counter[str] = Counter()
        slowest = 0.0
        stop = asyncio.Event()

        async def client() -> None:
            nonlocal slowest
            n = 0
            while not stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    task_id = await engine.submit("waits", {"n": n}, task_id=f"ack-{n}")
                    acknowledged.append(task_id)
                    await engine.signal(task_id, "go", n, dedup_key=f"go-{n}")
                    await engine.head(task_id)
                except Exception as error:
                    failures[type(error).__name__] += 1
                slowest = max(slowest, time.monotonic() - started)

        with capture_logs() as logs:
            running = asyncio.ensure_future(worker.run())
            calls = asyncio.ensure_future(client())
            await asyncio.sleep(1.0)
            # Every task is part-way through its steps when the primary is lost.
            done_before = [sum(ACTED[(task_id, step)] for step in range(30))
                           for task_id in workers]
            failed_at = time.monotonic()
            await asyncio.to_thread(server.embedded.stop, "immediate")
            await asyncio.sleep(1.0)
            await asyncio.to_thread(standby.promote)
            promoted_s = time.monotonic() - failed_at
            await asyncio.sleep(2.0)
            stop.set()
            await asyncio.wait_for(calls, 60)
            states = [await engine.wait(task_id, timeout_s=60) for task_id in workers]
            worker.stop()
            await asyncio.wait_for(running, 30)
        epochs = [(await engine.head(task_id)).lease_epoch for task_id in workers]
        rows = await engine.database.fetch(
            "SELECT task_id FROM wal_tasks WHERE task_id = ANY($1::text[])", acknowledged)
        present = {row["task_id"] for row in rows}
        print(f"\nfailover (kill, promote) {promoted_s:.1f} s; {len(acknowledged)} "
              f"submissions acknowledged, {len(acknowledged) - len(present)} lost, "
              f"failures {dict(failures)}, slowest call {slowest:.1f} s; steps done "
              f"by each worker task at the loss {done_before}")
        await engine.close()
        assert not failures, failures
        assert present == set(acknowledged)
        assert len(acknowledged) > 10
        assert [state.output for state in states] == [sum(range(30))] * 4
        for task_id in workers:
            assert [ACTED[(task_id, step)] for step in range(30)] == [1] * 30, task_id
        assert all(0 < done < 30 for done in done_before), done_before
        assert epochs == [1] * 4, epochs  # Each kept by its first claim through the failover.
        assert not [entry for entry in logs if entry.get("log_level") == "error"]
    finally:
        await asyncio.to_thread(standby.stop)
