"""``submit`` of an agent no worker serves: an error when ``--agents`` says which agents
exist, else a warning naming the agents that workers registered (``wal_workers``)."""

from __future__ import annotations

from tests.integration.test_cli_agents import cli, lines, one_error_line

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
