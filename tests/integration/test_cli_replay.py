"""``wal-engine replay`` and ``wal_engine.runtime.replayer``: today's code against recorded
histories, with no call and no write."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tests.helpers import log_snapshot
from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, drive, drive_until, lines, one_error_line
from wal_engine.engine import Engine
from wal_engine.runtime.replayer import check_history, replay_events
from wal_engine.state_machine import Status

SPEC = "tests.integration.test_cli_agents:"


async def _completed_echo(engine: Engine) -> str:
    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "why"})
    state = await drive(engine, task_id)
    assert state.status is Status.COMPLETED
    return task_id


async def test_replay_of_unchanged_code_is_ok_calls_nothing_and_writes_nothing(
        engine: Engine) -> None:
    """Same code: every recorded call is answered from the log, no tool runs, no row moves."""
    task_id = await _completed_echo(engine)
    before, calls_before = await log_snapshot(engine.database), Counter(agents.CALLS)
    result = await cli("replay", task_id, "--agents", SPEC + "register", "--dsn",
                       engine.database.dsn, "--json")
    assert result.exit_code == 0, result.output
    (report,) = lines(result.stdout)
    assert report["ok"] is True and report["outcome"] == "completed"
    assert report["calls_recorded"] == report["calls_replayed"] == 4  # llm, 2 tools, random
    assert report["output_matches"] is True and report["divergence"] is None
    assert await log_snapshot(engine.database) == before
    assert agents.CALLS == calls_before


async def test_replay_reports_the_first_nondeterminism_with_seq_and_exit_1(
        engine: Engine) -> None:
    """Another tool at the second call: exit 1, the seq of the recorded intent, fork point."""
    task_id = await _completed_echo(engine)
    history = await engine.history(task_id)
    search_seq = next(r.seq for r in history if r.type == "tool_call_intended")
    result = await cli("replay", task_id, "--agents", SPEC + "register_changed", "--dsn",
                       engine.database.dsn, "--json")
    assert result.exit_code == 1
    (report,) = lines(result.stdout)
    assert report["ok"] is False and report["outcome"] == "diverged"
    divergence = report["divergence"]
    assert divergence["kind"] == "call" and divergence["seq"] == search_seq
    assert divergence["fork_point"] == search_seq - 1 and divergence["call_index"] == 1
    assert "'search'" in divergence["recorded"] and "'search-v2'" in divergence["requested"]
    human = await cli("replay", task_id, "--agents", SPEC + "register_changed", "--dsn",
                      engine.database.dsn)
    assert human.exit_code == 1
    assert f"NON-DETERMINISM (call) at seq {search_seq}" in human.stdout
    assert f"fork {task_id} --at {search_seq - 1}" in human.stdout


async def test_replay_flags_calls_past_a_completed_history_and_another_output(
        engine: Engine) -> None:
    """Code that makes one more call, or returns another output, does not match."""
    task_id = await _completed_echo(engine)
    dsn = engine.database.dsn
    extra = await cli("replay", task_id, "--agents", SPEC + "register_extra", "--dsn", dsn,
                      "--json")
    assert extra.exit_code == 1
    (report,) = lines(extra.stdout)
    assert report["divergence"]["kind"] == "call"
    assert report["divergence"]["recorded"] is None
    assert "'notify'" in report["divergence"]["requested"]
    output = await cli("replay", task_id, "--agents", SPEC + "register_output", "--dsn", dsn,
                       "--json")
    assert output.exit_code == 1
    (report,) = lines(output.stdout)
    assert report["divergence"]["kind"] == "ending" and report["output_matches"] is False


async def test_replay_stops_where_a_worker_would_act_on_an_unfinished_history(
        engine: Engine) -> None:
    """A task waiting for a signal: the code matches up to the wait and stops there."""
    agents.register(engine)
    task_id = await engine.submit("cli-waiter", 3)
    await drive_until(engine, task_id, "WAITING")
    before = await log_snapshot(engine.database)
    result = await cli("replay", task_id, "--agents", SPEC + "AGENTS", "--dsn",
                       engine.database.dsn, "--json")
    assert result.exit_code == 0, result.output
    (report,) = lines(result.stdout)
    assert report["ok"] is True and report["outcome"] == "reached_end"
    assert report["recorded_status"] == "WAITING"
    assert "signal 'go'" in report["stopped_at"]
    assert await log_snapshot(engine.database) == before


async def test_check_history_is_a_function_over_an_engine_or_a_store(engine: Engine) -> None:
    """The testing module calls the same check: with an engine's agents, or a registry."""
    task_id = await _completed_echo(engine)
    seen: list[tuple[str, int, int]] = []
    report = await check_history(engine, task_id,
                                 on_progress=lambda *progress: seen.append(progress))
    assert report.ok and report.outcome == "completed" and report.events > 10
    assert seen[-1] == ("calls", 4, 4) and any(phase == "events" for phase, _, _ in seen)
    changed = await check_history(engine.store, task_id, {"cli-echo": agents.echo_changed})
    assert not changed.ok and changed.divergence is not None
    golden = await replay_events(await engine.history(task_id), agents.echo)
    assert golden.ok and golden.calls_replayed == 4


async def test_replay_on_a_cancelled_task_stops_at_the_next_call(engine: Engine) -> None:
    """The engine ended the history (cancel): the code may go on; it stops at its next act."""
    agents.register(engine)
    task_id = await engine.submit("cli-waiter", 1)
    await drive_until(engine, task_id, "WAITING")
    await engine.cancel(task_id)
    report = await check_history(engine, task_id)
    assert report.ok and report.outcome == "reached_end"
    assert report.recorded_status == "FAILED"


async def test_agent_code_cannot_swallow_the_divergence(engine: Engine) -> None:
    """An agent catching every Exception still gets its divergence reported."""
    task_id = await _completed_echo(engine)

    async def swallowing(ctx: Any, task_input: Any) -> Any:
        try:
            await agents.echo_changed(ctx, task_input)
        except Exception:
            pass
        return {"title": "A"}

    report = await check_history(engine.store, task_id, {"cli-echo": swallowing})
    assert not report.ok and report.divergence is not None
    assert report.divergence.kind == "call"


async def test_replay_errors_are_one_line(engine: Engine, database_dsn: str) -> None:
    """Unknown task, a bad --agents spec, an agent the registry lacks: one line, non-zero."""
    task_id = await _completed_echo(engine)
    unknown = await cli("replay", "no-such-task", "--agents", SPEC + "register", "--dsn",
                        database_dsn)
    assert unknown.exit_code == 3 and "unknown task" in one_error_line(unknown)
    bad_spec = await cli("replay", task_id, "--agents", "no_such_module_x:register", "--dsn",
                         database_dsn)
    assert bad_spec.exit_code == 2 and "cannot import" in one_error_line(bad_spec)
    not_registry = await cli("replay", task_id, "--agents", SPEC + "NOT_AN_AGENT_REGISTRY",
                             "--dsn", database_dsn)
    assert not_registry.exit_code == 2 and "must name a function" in one_error_line(not_registry)
    broken = await cli("replay", task_id, "--agents", SPEC + "register_broken", "--dsn",
                       database_dsn)
    assert broken.exit_code == 2
    assert "RuntimeError: agent module misconfigured" in one_error_line(broken)
    missing = await cli("replay", task_id, "--agents", "wal_engine.cli.demo:register", "--dsn",
                        database_dsn)
    assert missing.exit_code == 4 and "'cli-echo' is not registered" in one_error_line(missing)


async def test_the_replay_session_is_read_only(engine: Engine) -> None:
    """Even code that tries to write during a replay cannot: every transaction is read-only."""
    task_id = await _completed_echo(engine)
    before = await log_snapshot(engine.database)
    result = await cli("replay", task_id, "--agents", SPEC + "register_and_write", "--dsn",
                       engine.database.dsn)
    assert result.exit_code == 4
    assert "read-only transaction" in one_error_line(result)
    assert await log_snapshot(engine.database) == before
