"""Issue 17's operator commands that no other test ran: ``wal-engine tasks --by-version``
(with the per-version claims metric and the live-tasks gauge), ``wal-engine fork
--at-divergence``, and ``replay --all`` (the deploy gate) in process, with ``--since``."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from tests.helpers import log_snapshot
from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, drive, drive_until, lines, one_error_line
from wal_engine.engine import Engine, connect
from wal_engine.observability import metrics
from wal_engine.runtime.replayer import check_history
from wal_engine.state_machine import Status
from wal_engine.testing.processes import wait_until

SPEC = "tests.integration.test_cli_agents:"
CLAIMS_BY_VERSION = "wal_engine_claims_by_agent_version_total"


def _claims(agent: str, version: str) -> float:
    import prometheus_client

    value = prometheus_client.REGISTRY.get_sample_value(
        CLAIMS_BY_VERSION, {"agent": agent, "version": version})
    return value or 0.0


async def test_tasks_by_version_shows_what_runs_on_each_version(engine: Engine) -> None:
    """One v1 task finished, one v1 task and one v2 task queued: ``tasks --by-version``
    counts each (agent, version, status); a claim counts into its version's metric."""
    engine.register("cli-echo", agents.echo, version="1")
    claims_before = _claims("cli-echo", "1") if metrics.available() else 0.0
    done = await engine.submit("cli-echo", {"q": "a"})
    assert (await drive(engine, done)).status is Status.COMPLETED
    await engine.submit("cli-echo", {"q": "b"})
    engine.register("cli-echo", agents.echo, version="2")
    await engine.submit("cli-echo", {"q": "c"})
    result = await cli("tasks", "--by-version", "--dsn", engine.database.dsn, "--json")
    assert result.exit_code == 0, result.output
    rows = {(r["agent"], r["agent_version"], r["status"]): r["tasks"]
            for r in lines(result.stdout)}
    assert rows == {("cli-echo", "1", "COMPLETED"): 1, ("cli-echo", "1", "QUEUED"): 1,
                    ("cli-echo", "2", "QUEUED"): 1}, rows
    human = await cli("tasks", "--by-version", "--dsn", engine.database.dsn)
    assert human.exit_code == 0 and "tasks by agent version" in human.stdout
    if metrics.available():
        assert _claims("cli-echo", "1") >= claims_before + 1


def _live_gauge(port: int, agent: str) -> dict[str, float]:
    """``wal_engine_live_tasks`` of ``agent`` by version, parsed from the exposition the
    metrics endpoint serves."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {sample.labels["version"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "wal_engine_live_tasks"
            for sample in family.samples if sample.labels["agent"] == agent}


async def test_live_tasks_gauge_shows_what_still_runs_on_each_version(engine: Engine) -> None:
    """A rolling deploy in one process: an old engine runs v1, a new one v2, each with its
    worker. Three tasks started on v1 and two on v2, all waiting for a signal: the gauge
    served on the metrics endpoint reads 3 and 2; one task of each finished, 2 and 1; the
    last v2 task finished, v2 reads 0 (drained) rather than vanishing. ``tasks
    --by-version`` counts the same tasks with the same statement."""
    if not metrics.available():
        pytest.skip("the metrics extra (prometheus-client) is not installed")
    agent = "gauge-waiter"
    new = await connect(engine.database.dsn, migrate=False, pool_size_max=4)
    engine.register(agent, agents.waiter, version="1")
    new.register(agent, agents.waiter, version="2")
    v1 = [await engine.submit(agent, n) for n in range(3)]
    v2 = [await new.submit(agent, n) for n in range(2)]
    server = metrics.serve(0, "127.0.0.1")
    port = server.server_address[1]
    workers = [engine.worker(concurrency=4, **agents.FAST),
               new.worker(concurrency=4, **agents.FAST)]
    running = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        async def gauge_reads(expected: dict[str, float]) -> bool:
            return await asyncio.to_thread(_live_gauge, port, agent) == expected

        async def finish(task_id: str) -> None:
            async def waiting() -> bool:
                return (await engine.head(task_id)).status is Status.WAITING
            await wait_until(waiting, f"task {task_id} to wait", 20)
            await engine.signal(task_id, "go", "now")
            assert (await engine.wait(task_id, timeout_s=20)).status is Status.COMPLETED

        await wait_until(lambda: gauge_reads({"1": 3, "2": 2}), "the gauge to read 3 and 2", 20)
        await finish(v1[0])
        await finish(v2[0])
        await wait_until(lambda: gauge_reads({"1": 2, "2": 1}), "the gauge to read 2 and 1", 20)
        await finish(v2[1])
        await wait_until(lambda: gauge_reads({"1": 2, "2": 0}), "v2 to drain to 0", 20)
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*running)
        await new.close()
        server.shutdown()
        server.server_close()
    result = await cli("tasks", "--by-version", "--dsn", engine.database.dsn, "--json")
    assert result.exit_code == 0, result.output
    counts = {(r["agent_version"], r["status"]): r["tasks"] for r in lines(result.stdout)
              if r["agent"] == agent}
    assert counts == {("1", "COMPLETED"): 1, ("1", "WAITING"): 2, ("2", "COMPLETED"): 2}, counts


async def test_fork_at_divergence_forks_where_the_new_code_parts(engine: Engine) -> None:
    """Code that calls another tool second: the fork keeps the history up to the fork point
    the replay names, and the new task replays against the new code; unchanged code has
    nothing to fork at (one error line, exit 1)."""
    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "why"})
    assert (await drive(engine, task_id)).status is Status.COMPLETED
    dsn = engine.database.dsn
    agents.register_changed(engine)
    expected = await check_history(engine, task_id)
    assert expected.divergence is not None
    result = await cli("fork", task_id, "--at-divergence", SPEC + "register_changed",
                       "--dsn", dsn, "--json")
    assert result.exit_code == 0, result.output
    (forked,) = lines(result.stdout)
    assert forked["parent_task_id"] == task_id
    assert forked["parent_seq"] == expected.divergence.fork_point
    child = forked["task_id"]
    report = await check_history(engine, child)
    assert report.ok and report.outcome == "reached_end", report
    agents.register(engine)
    unchanged = await cli("fork", task_id, "--at-divergence", SPEC + "register", "--dsn", dsn)
    assert unchanged.exit_code == 1
    assert "nothing to fork at" in one_error_line(unchanged)


@pytest.mark.parametrize("args", [(), ("--at", "3", "--at-divergence", SPEC + "register")])
async def test_fork_needs_exactly_one_of_at_and_at_divergence(
        engine: Engine, args: tuple[str, ...]) -> None:
    """Neither or both: a usage error (exit 2), nothing written."""
    result = await cli("fork", "some-task", *args, "--dsn", engine.database.dsn)
    assert result.exit_code == 2


async def test_replay_all_is_the_deploy_gate_and_since_narrows_it(engine: Engine) -> None:
    """``replay --all`` against code that calls another tool second: exit 1, the divergent
    finished task named with its seq and both sides, the live task passing, nothing
    written; ``--since`` after every update checks nothing and passes."""
    agents.register(engine)
    finished = await engine.submit("cli-echo", {"q": "why"})
    assert (await drive(engine, finished)).status is Status.COMPLETED
    waiting = await engine.submit("cli-waiter", 3)
    await drive_until(engine, waiting, "WAITING")
    dsn = engine.database.dsn
    before = await log_snapshot(engine.database)
    gate = await cli("replay", "--all", "--agents", SPEC + "register_changed", "--dsn", dsn,
                     "--json")
    assert gate.exit_code == 1, gate.output
    *reports, summary = lines(gate.stdout)
    assert summary["divergent"] == [finished] and summary["checked"] == 2
    assert (summary["live"], summary["finished"]) == (1, 1)
    (divergent,) = [r for r in reports if not r["ok"]]
    assert divergent["task_id"] == finished and divergent["divergence"]["seq"] > 1
    assert "'search'" in divergent["divergence"]["recorded"]
    assert "'search-v2'" in divergent["divergence"]["requested"]
    human = await cli("replay", "--all", "--agents", SPEC + "register_changed", "--dsn", dsn)
    assert human.exit_code == 1 and "NOT SAFE TO DEPLOY" in human.stdout
    assert f"task {finished}" in human.stdout and "NON-DETERMINISM (call) at seq" in human.stdout
    later = await cli("replay", "--all", "--since", "2999-01-01", "--agents",
                      SPEC + "register_changed", "--dsn", dsn, "--json")
    assert later.exit_code == 0, later.output
    assert lines(later.stdout)[-1]["checked"] == 0
    assert await log_snapshot(engine.database) == before
