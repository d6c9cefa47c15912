"""Every worker setting from the CLI (each WorkerConfig field, and the recovery cap) and
recovery_attempts_max from connect()."""

from __future__ import annotations

import msgspec
import pytest

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import cli, one_error_line
from wal_engine.cli.operate import worker
from wal_engine.engine import Engine, connect
from wal_engine.errors import ConfigurationError
from wal_engine.runtime.worker import WorkerConfig

SPEC = "tests.integration.test_cli_agents:register"


async def test_worker_takes_every_setting_from_the_cli(engine: Engine) -> None:
    """A worker started with every setting runs the queue; out-of-range values are usage
    errors naming the option."""
    agents.register(engine)
    task_id = await engine.submit("cli-echo", {"q": "settings"})
    ran = await cli("worker", "--agents", SPEC, "--until-idle", "--lease-ttl-ms", "900",
                    "--heartbeat-ms", "300", "--poll-ms", "50", "--sweep-ms", "100",
                    "--drain-timeout-s", "2.5", "--recovery-attempts-max", "3",
                    "--sync-threads", "2", "--stall-warn-ms", "500",
                    "--stall-abandon-ms", "1000",
                    "--dsn", engine.database.dsn, env={"WAL_ENGINE_LOG_LEVEL": "error"})
    assert ran.exit_code == 0, ran.output
    assert str((await engine.head(task_id)).status) == "COMPLETED"
    for option, value in (("--drain-timeout-s", "-1"), ("--recovery-attempts-max", "0"),
                          ("--sweep-ms", "1"), ("--sync-threads", "-1"),
                          ("--stall-warn-ms", "0")):
        bad = await cli("worker", "--agents", SPEC, option, value, "--dsn",
                        engine.database.dsn)
        assert bad.exit_code == 2 and option in one_error_line(bad)
    # Below the lease TTL: refused by WorkerConfig, named in the usage error.
    short = await cli("worker", "--agents", SPEC, "--stall-abandon-ms", "1000",
                      "--dsn", engine.database.dsn)
    assert short.exit_code == 2 and "stall_abandon_ms" in one_error_line(short)


def test_every_worker_config_field_is_a_worker_option() -> None:
    """No WorkerConfig field is settable from Python only: each has a --option on
    `wal-engine worker` (the recovery cap, an engine setting, has one too)."""
    options = {name for param in worker.params for name in getattr(param, "opts", ())}
    wanted = {"--" + field.name.replace("_", "-")
              for field in msgspec.structs.fields(WorkerConfig)}
    assert wanted - options == set()
    assert "--recovery-attempts-max" in options


async def test_connect_takes_recovery_attempts_max(database_dsn: str) -> None:
    """connect(recovery_attempts_max=N) reaches the engine; below 1 is refused."""
    engine = await connect(database_dsn, migrate=False, recovery_attempts_max=3)
    try:
        assert engine.recovery_attempts_max == 3
    finally:
        await engine.close()
    with pytest.raises(ConfigurationError, match="recovery_attempts_max"):
        await connect(database_dsn, migrate=False, recovery_attempts_max=0)
