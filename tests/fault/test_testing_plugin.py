"""The public testing module works from a user's project: the plugin's fixtures, the
ledger, in-process crashes, worker subprocesses, replay and the crash machine, exercised
by a test file written like docs/testing.md and run by a separate pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fault.support import FIGURES
from wal_engine.testing.postgres import TestServer

USER_AGENTS = '''
from wal_engine.testing.ledger import EffectLedger


def register(engine):
    ledger = EffectLedger.for_engine(engine)
    charge = ledger.service("charge", kind="unsafe",
                            result=lambda args: {"charged": args["cents"]})
    book = ledger.transaction("book", result=lambda args: {"booked": args["cents"]})

    @engine.agent("billing")
    async def billing(ctx, order):
        booked = await ctx.transaction("book", book, {"cents": order["cents"]})
        await ctx.checkpoint(next_action="charge")
        receipt = await ctx.tool("charge", charge, {"cents": order["cents"]},
                                 idempotent=False)
        return {"booked": booked, "receipt": receipt}
'''

USER_TESTS = '''
import pytest
from hypothesis import strategies as st

from user_agents import register
from wal_engine.testing import assert_no_violations, check_effects, check_log
from wal_engine.testing.crash import crash_at, drive_to_quiescence, expire_leases
from wal_engine.testing.crash import run_worker_until_idle
from wal_engine.testing.machine import AgentUnderTest, Submission
from wal_engine.testing.replay import assert_replay_equivalent


async def test_crash_after_the_charge_is_escalated(wal_test_engine, wal_effect_ledger):
    register(wal_test_engine)
    task = await wal_test_engine.submit("billing", {"cents": 500})
    with crash_at("after_effect_before_result") as crash:
        await run_worker_until_idle(wal_test_engine)
    assert crash.fired
    await expire_leases(wal_test_engine)
    await drive_to_quiescence(wal_test_engine)
    state = await wal_test_engine.state(task)
    assert state.failure.reason == "uncertain_side_effect"
    assert_no_violations(await check_log(wal_test_engine.database)
                         + await check_effects(wal_test_engine.database))
    rows = await wal_effect_ledger.effects()
    assert {r.tool: r.applied for r in rows} == {"book": 1, "charge": 1}


async def test_replay_of_its_own_history(wal_test_engine, wal_effect_ledger):
    register(wal_test_engine)

    async def deliveries():
        return (await wal_effect_ledger.totals()).deliveries

    report = await assert_replay_equivalent(wal_test_engine, "billing", {"cents": 7},
                                            count_effects=deliveries)
    assert report.outcome == "completed"


async def test_sigkilled_worker_subprocess(wal_worker_pool, wal_test_engine,
                                           wal_effect_ledger):
    register(wal_test_engine)
    pool = wal_worker_pool("user_agents:register", lease_ttl_ms=1000, heartbeat_ms=250)
    task = await wal_test_engine.submit("billing", {"cents": 500})
    doomed = await pool.spawn("doomed", failpoint="before_intent_append:1:sigkill")
    assert await doomed.exited() == -9
    await pool.spawn("survivor")
    state = await wal_test_engine.wait(task, timeout_s=30)
    assert state.status == "COMPLETED"


def test_crash_machine(wal_crash_machine, wal_fault_seed):
    stats = wal_crash_machine(AgentUnderTest(
        register=register,
        submissions=st.builds(Submission, agent=st.just("billing"),
                              input=st.fixed_dictionaries({"cents": st.integers(1, 9)})),
    ), profile="crash-dev")
    assert stats.violations == 0 and stats.crash_points_tried > 0


@pytest.mark.deep
def test_deep_is_skipped_by_default():
    raise AssertionError("deep tests run only with RELIABILITY_DEEP=1")
'''


@pytest.mark.timeout(300)
def test_the_plugin_in_a_user_project(tmp_path: Path, pg_server: TestServer) -> None:
    """A user's test file using every public piece passes under the plugin alone."""
    (tmp_path / "user_agents.py").write_text(textwrap.dedent(USER_AGENTS))
    (tmp_path / "test_user_agents.py").write_text(textwrap.dedent(USER_TESTS))
    env = {**os.environ, "WAL_ENGINE_TEST_DSN": pg_server.admin_dsn,
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(tmp_path)}
    env.pop("RELIABILITY_DEEP", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "wal_engine.testing.plugin", "-p", "pytest_asyncio.plugin",
         "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function",
         "-rs", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert "4 passed, 1 skipped" in result.stdout, tail
    line = "plugin: 4 user tests passed (ledger, in-process crash, SIGKILL, replay, machine)"
    print(line)
    FIGURES.append(line)
