"""``submit`` of an agent no worker serves: an error when ``--agents`` says which agents
exist, else a warning naming the agents that workers registered (``wal_workers``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tests.integration.test_cli_agents import cli, lines, one_error_line
from wal_engine.engine import Engine

SPEC = "tests.integration.test_cli_agents:register"


async def test_submit_warns_until_a_worker_registers_the_agent(database_dsn: str) -> None:
    """Before any worker: a warning that none registered; after `worker` ran: no warning
    for its agent, and a warning naming its agents for a misspelt one. Each is queued."""
    first = await cli("submit", "cli-echo", "--input", "{}", "--dsn", database_dsn, "--json")
    assert first.exit_code == 0, first.output
    assert "warning: no worker registered agent 'cli-echo'" in first.stderr
    assert "no worker registered any agent" in first.stderr
    ran = await cli("worker", "--agents", SPEC, "--until-idle", "--worker-id", "w-reg",
                    "--poll-ms", "50", "--dsn", database_dsn,
                    env={"WAL_ENGINE_LOG_LEVEL": "error"})
    assert ran.exit_code == 0, ran.output
    served = await cli("submit", "cli-echo", "--input", "{}", "--dsn", database_dsn, "--json")
    assert served.exit_code == 0 and "warning" not in served.stderr
    typo = await cli("submit", "cli-ecko", "--input", "{}", "--dsn", database_dsn, "--json")
    assert typo.exit_code == 0
    assert "no worker registered agent 'cli-ecko'" in typo.stderr
    assert "workers registered: cli-echo" in typo.stderr
    assert lines(typo.stdout)[0]["status"] == "QUEUED"


async def test_submit_with_agents_refuses_an_unknown_name(database_dsn: str) -> None:
    """With --agents the name is checked before anything is written."""
    refused = await cli("submit", "cli-ecko", "--agents", SPEC, "--input", "{}",
                        "--dsn", database_dsn)
    assert refused.exit_code == 2
    line = one_error_line(refused)
    assert "'cli-ecko' is not registered" in line and "cli-echo" in line
    listed = lines((await cli("tasks", "--dsn", database_dsn, "--json")).stdout)
    assert listed == []


async def test_a_long_running_worker_stays_registered(engine: Engine) -> None:
    """A worker records its agents again while it runs: its start two days ago (seen_at
    moved back) is refreshed, so `submit` does not warn about an agent it still serves."""
    from tests.integration.test_cli_agents import register

    register(engine)
    worker = engine.worker(worker_id="w-long", poll_ms=50)
    worker.registration_every_s = 0.05
    running = asyncio.create_task(worker.run())
    try:
        two_days_ago = await _until(lambda: _value(engine,
            "UPDATE wal_workers SET seen_at = now() - interval '2 days'"
            " WHERE worker_id = 'w-long' RETURNING seen_at"))
        refreshed = await _until(lambda: _value(engine,
            "SELECT seen_at FROM wal_workers WHERE worker_id = 'w-long'"
            " AND seen_at > $1", two_days_ago))
        assert refreshed > two_days_ago
        served = await cli("submit", "cli-echo", "--input", "{}", "--dsn",
                           engine.database.dsn, "--json")
        assert served.exit_code == 0 and "warning" not in served.stderr, served.stderr
    finally:
        worker.stop()
        await asyncio.wait_for(running, 30)


async def _until(probe: Callable[[], Awaitable[Any]], deadline_s: float = 30.0) -> Any:
    """The first non-None answer of ``probe`` within the deadline."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        found = await probe()
        if found is not None:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"no answer within {deadline_s} s")


async def _value(engine: Engine, query: str, *args: Any) -> Any:
    row = await engine.database.fetchrow(query, *args)
    return None if row is None else row[0]
