"""W1-W3, L8 in process on the ledgered fault agent: the Hypothesis crash machine over every
tool class (LLM, T-idem, T-db, T-lookup, T-unsafe, a durable sleep and a signal wait). A file
of its own beside the demo agent's machine (test_w1_w3_crash_machine.py), so the two long
machines run on different xdist workers (`--dist loadfile` keeps a file on one worker)."""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.fault.test_w1_w3_crash_machine import LEDGERED, _report
from wal_engine.testing.machine import crash_settings, run_crash_machine
from wal_engine.testing.postgres import DatabaseFactory


@pytest.mark.timeout(600)
def test_w1_w3_l8_crash_machine_on_every_tool_class(database_factory: DatabaseFactory) -> None:
    """The machine on the ledgered agent: LLM, T-idem, T-db, T-lookup, T-unsafe, a durable
    sleep and a signal wait; only escalations of non-idempotent calls may differ from the
    crash-free run."""
    stats = run_crash_machine(LEDGERED, database_factory,
                              settings_=settings(crash_settings("crash-ci"), max_examples=50))
    _report("W1-W3/L8 machine, ledgered agent (every tool class)", stats)
