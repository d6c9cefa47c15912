"""Child tasks under a worker crash (issue 24): the worker running a child is SIGKILLed in
the middle of the child's tool call; another worker process takes the child over after
its lease expires, and the parent, waiting durably, is woken and completes. Nothing is
spawned twice."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.fault.child_agents import CHILDREN, REGISTER
from tests.fault.support import REPO
from wal_engine.engine import connect
from wal_engine.state_machine import Status
from wal_engine.testing.processes import WorkerPool, wait_until


@pytest.mark.timeout(90)
async def test_a_childs_worker_killed_mid_run_is_taken_over(database_dsn: str,
                                                           tmp_path: Path) -> None:
    """The only worker dies (SIGKILL) inside a child's tool call; a fresh worker process
    takes the orphaned child over, the parent wakes when the last child ends, and the run
    spawned each child exactly once."""
    engine = await connect(database_dsn, migrate=False)
    pool = WorkerPool(engine.database.dsn, REGISTER, tmp_path, cwd=REPO,
                      lease_ttl_ms=1000, heartbeat_ms=250)
    try:
        doomed = await pool.spawn("doomed", failpoint="during_effect:1:sigkill")
        task = await engine.submit("fan_parent", None, task_id="fan")
        await wait_until(lambda: doomed.returncode is not None,
                         "the child's worker to die mid-call", 30, 0.05)
        assert doomed.returncode == -signal.SIGKILL, doomed.output()
        await pool.spawn("survivor")
        state = await engine.wait(task, timeout_s=40)
        assert state.status is Status.COMPLETED, state.failure
        assert state.output == sum(2 * n for n in range(1, CHILDREN + 1))
        rows = await engine.database.fetch(
            "SELECT task_id, status FROM wal_tasks WHERE tenant = current_setting("
            "'wal.tenant', true) ORDER BY task_id")
        assert [(r["task_id"], r["status"]) for r in rows] == [
            ("fan", "COMPLETED"),
            *((f"fan:child:value-{n}", "COMPLETED") for n in range(CHILDREN))]
        orphaned = [child for child in (f"fan:child:value-{n}" for n in range(CHILDREN))
                    if any(r.type == "task_orphaned" for r in await engine.history(child))]
        assert orphaned, "no child was running on the killed worker"
        spawns = [r for r in await engine.history(task)
                  if r.type == "value_recorded" and b'"kind":"spawn:' in r.payload]
        assert len(spawns) == CHILDREN
    finally:
        pool.close()
        await engine.close()
