"""The agent that scheduled ticks run in the schedule fault tests
(``python -m wal_engine.testing.worker DSN ID tests.fault.schedule_agents:register``)."""

from __future__ import annotations

from typing import Any, Final

from wal_engine.engine import Engine

AGENT: Final = "tick"
REGISTER: Final = "tests.fault.schedule_agents:register"


def register(engine: Engine) -> None:
    """Register ``tick``: it returns its input."""

    @engine.agent(AGENT)
    async def tick(ctx: Any, value: Any) -> Any:
        return value
