"""The effect-safety model (issue 15) in CI: agents drawn from every call kind, sync and
async, each call misbehaving as drawn, under crashes, lease expiries, killed workers and lost
database sessions; every effect acts at most once, every escalation has its reason, every
task ends, and final states equal the crash-free run where no call was in doubt."""

from __future__ import annotations

import os

import pytest

from wal_engine.testing.effects import run_effect_model
from wal_engine.testing.postgres import DatabaseFactory

CALLS_MIN = 1000
DEEP = os.environ.get("RELIABILITY_DEEP") == "1"


def _report(line: str) -> None:
    print(line)
    try:
        from tests.fault.support import FIGURES

        FIGURES.append(line)
    except ImportError:  # pragma: no cover - the fault package is part of this tree
        pass


@pytest.mark.timeout(3600 if DEEP else 300)
def test_effect_model(database_factory: DatabaseFactory) -> None:
    """At least 1,000 drawn calls per CI run (the deep profile with RELIABILITY_DEEP=1), no
    violation, every kind, variant and first-attempt outcome tried."""
    stats = run_effect_model(database_factory)
    _report(f"effect model: {stats}")
    assert stats.violations == 0
    assert stats.calls >= CALLS_MIN
    assert set(stats.calls_by_kind) == {"idem", "lookup", "unsafe", "llm", "db"}
    assert 0 < stats.sync_calls < stats.calls
    assert {"return", "did_not_act", "act_then_raise", "act_then_sleep", "block",
            "lose_connections"} <= set(stats.calls_by_outcome)
    assert stats.machine.crash_points_fired > 0
