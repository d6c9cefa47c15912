"""W1-W3, W7, L8 in process: the Hypothesis crash machine on the demo agent and on the
ledgered fault agent. Every program crashes workers at drawn failpoints, expires leases,
restarts and kills workers, answers signals and advances timers; after every rule every
invariant is checked, and at the end each task must equal its crash-free run (L8)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from tests.fault import ledger_agents
from tests.fault.support import deep_count
from wal_engine.cli import demo
from wal_engine.testing.machine import (
    AgentUnderTest,
    MachineStats,
    Submission,
    crash_settings,
    run_crash_machine,
)
from wal_engine.testing.postgres import DatabaseFactory

DEEP = os.environ.get("RELIABILITY_DEEP") == "1"
deep_only = [pytest.mark.deep,
             pytest.mark.skipif(not DEEP, reason="deep tier: set RELIABILITY_DEEP=1")]
DEMO_EFFECTS = "SELECT key, tool, deliveries, applied, 'idem' AS tool_class FROM demo_effects"
CRASH_POINTS_MIN = 1000


async def register_demo(engine: Any) -> None:
    """The demo agent and its effects table."""
    demo.register(engine)
    await demo.prepare(engine)


DEMO = AgentUnderTest(
    register=register_demo,
    submissions=st.builds(Submission, agent=st.just(demo.AGENT_NAME),
                          input=st.sampled_from([{"question": "why WAL?"},
                                                 {"question": "how to fence?",
                                                  "recipient": "ops@example.com"}])),
    effects_query=DEMO_EFFECTS,
)
LEDGERED = AgentUnderTest(
    register=ledger_agents.register,
    submissions=st.builds(Submission, agent=st.just(ledger_agents.AGENT),
                          input=st.fixed_dictionaries({"n": st.integers(1, 3),
                                                       "sleep_ms": st.sampled_from([0, 30]),
                                                       "wait": st.booleans()})),
    signals={"go": {"ok": True}},
)


def _report(name: str, stats: MachineStats) -> None:
    line = f"{name}: {stats}"
    print(line)
    try:
        from tests.fault.support import FIGURES

        FIGURES.append(line)
    except ImportError:  # pragma: no cover - the fault package is part of this tree
        pass
    assert stats.violations == 0


# 282 s serially at load average 4; 939 s beside another xdist worker at load 8-13.
@pytest.mark.timeout(1800)
def test_w1_w3_w7_l8_crash_machine_on_the_demo_agent(database_factory: DatabaseFactory
                                                     ) -> None:
    """At least 1,000 fired crash points per CI run on the demo agent, zero violations."""
    stats = run_crash_machine(DEMO, database_factory, profile="crash-ci")
    _report("W1-W3/W7/L8 machine, demo agent", stats)
    assert stats.crash_points_fired >= CRASH_POINTS_MIN


@pytest.mark.timeout(deep_count(6 * 3600, 3600))
@pytest.mark.parametrize("config", [DEMO, LEDGERED], ids=["demo", "ledgered"])
@deep_only[0]
@deep_only[1]
def test_deep_crash_machine(database_factory: DatabaseFactory, config: AgentUnderTest) -> None:
    """Deep: programs of 30 steps (crash-deep), random; 120 of its 3,000 in the deep tier's
    hour (about 4 s a program here), all of them with RELIABILITY_DEEP_FULL=1."""
    stats = run_crash_machine(config, database_factory, settings_=settings(
        crash_settings("crash-deep"), max_examples=deep_count(3000, 120)))
    _report("deep crash machine", stats)
