"""Every worker setting from the CLI (sweep, drain timeout, recovery attempts, beside the
lease timings) and recovery_attempts_max from connect()."""

from __future__ import annotations

import pytest

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, one_error_line
from wal_engine.engine import Engine, connect
from wal_engine.errors import ConfigurationError

SPEC = "tests.integration.test_cli_agents:register"


async def test_worker_takes_every_setting_from_the_cli(engine: Engine) -> None:
    """A worker started with every setting runs the queue; out-of-range values are usage
    errors naming the option."""
    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "settings"})
    ran = await cli("worker", "--agents", SPEC, "--until-idle", "--lease-ttl-ms", "900",
                    "--heartbeat-ms", "300", "--poll-ms", "50", "--sweep-ms", "100",
                    "--drain-timeout-s", "2.5", "--recovery-attempts-max", "3",
                    "--dsn", engine.database.dsn, env={"WAL_ENGINE_LOG_LEVEL": "error"})
    assert ran.exit_code == 0, ran.output
    assert str((await engine.head(task_id)).status) == "COMPLETED"
    for option, value in (("--drain-timeout-s", "-1"), ("--recovery-attempts-max", "0"),
                          ("--sweep-ms", "1")):
        bad = await cli("worker", "--agents", SPEC, option, value, "--dsn",
                        engine.database.dsn)
        assert bad.exit_code == 2 and option in one_error_line(bad)


async def test_connect_takes_recovery_attempts_max(database_dsn: str) -> None:
    """connect(recovery_attempts_max=N) reaches the engine; below 1 is refused."""
    engine = await connect(database_dsn, migrate=False, recovery_attempts_max=3)
    try:
        assert engine.recovery_attempts_max == 3
    finally:
        await engine.close()
    with pytest.raises(ConfigurationError, match="recovery_attempts_max"):
        await connect(database_dsn, migrate=False, recovery_attempts_max=0)
