"""Crash-test your agents: PostgreSQL fixtures, crash injection, a Hypothesis state machine.

What is here (see ``docs/testing.md`` for a walk-through):

* :mod:`wal_engine.testing.plugin`: the pytest plugin (fixtures ``wal_pg_server``,
  ``wal_database_dsn``, ``wal_test_engine``, ``wal_effect_ledger``, ``wal_crash_machine``,
  ``wal_worker_pool``, ``wal_fault_seed``).
* :mod:`wal_engine.testing.postgres`: a server (``WAL_ENGINE_TEST_DSN`` or embedded) and a
  factory of fresh databases.
* :mod:`wal_engine.testing.ledger`: fake services per tool class that count how often each
  idempotency key really acted.
* :mod:`wal_engine.testing.crash`: in-process crashes at named points, lease expiry, timers,
  signals, driving tasks to their end, the crash-free run.
* :mod:`wal_engine.testing.processes`: worker subprocesses killed with SIGKILL at a point.
* :mod:`wal_engine.testing.machine`: the Hypothesis ``RuleBasedStateMachine``.
* :mod:`wal_engine.testing.effects`: the effect-safety model (the machine on agents drawn
  from every call kind, each call misbehaving as drawn).
* :mod:`wal_engine.testing.replay`: replay recorded histories against today's code (the
  check of :mod:`wal_engine.runtime.replayer`, the CLI's ``replay``) and history files.
* :mod:`wal_engine.testing.invariants`: the invariant checks (I1-I14).
* :mod:`wal_engine.testing.proxy`: a TCP proxy for network faults.
* :mod:`wal_engine.testing.pgbouncer`: a real PgBouncer in front of a test server
  (``docs/pgbouncer.md``).
* :mod:`wal_engine.testing.clock`: ``ManualClock``, a clock for tests that skip time.

Names are loaded lazily, so importing this package pulls in neither Hypothesis nor pytest;
type checkers read them through the ``TYPE_CHECKING`` imports (the same set as ``_lazy``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_lazy = {
    "ManualClock": "wal_engine.testing.clock",
    "DatabaseFactory": "wal_engine.testing.postgres",
    "TestServer": "wal_engine.testing.postgres",
    "start_test_server": "wal_engine.testing.postgres",
    "EffectLedger": "wal_engine.testing.ledger",
    "StaleDelivery": "wal_engine.testing.ledger",
    "Behaviour": "wal_engine.testing.ledger",
    "check_effects": "wal_engine.testing.ledger",
    "crash_at": "wal_engine.testing.crash",
    "drive_to_quiescence": "wal_engine.testing.crash",
    "expire_leases": "wal_engine.testing.crash",
    "advance_timers": "wal_engine.testing.crash",
    "deliver_signals": "wal_engine.testing.crash",
    "run_crash_free": "wal_engine.testing.crash",
    "run_crash_free_many": "wal_engine.testing.crash",
    "run_worker_until_idle": "wal_engine.testing.crash",
    "outcome": "wal_engine.testing.crash",
    "WorkerProcess": "wal_engine.testing.processes",
    "WorkerPool": "wal_engine.testing.processes",
    "AgentUnderTest": "wal_engine.testing.machine",
    "Submission": "wal_engine.testing.machine",
    "MachineStats": "wal_engine.testing.machine",
    "crash_machine": "wal_engine.testing.machine",
    "run_crash_machine": "wal_engine.testing.machine",
    "EffectStats": "wal_engine.testing.effects",
    "run_effect_model": "wal_engine.testing.effects",
    "check_history": "wal_engine.runtime.replayer",
    "replay_events": "wal_engine.runtime.replayer",
    "ReplayMismatch": "wal_engine.testing.replay",
    "assert_replays": "wal_engine.testing.replay",
    "assert_replay_equivalent": "wal_engine.testing.replay",
    "load_history": "wal_engine.testing.replay",
    "dump_history": "wal_engine.testing.replay",
    "check_log": "wal_engine.testing.invariants",
    "assert_no_violations": "wal_engine.testing.invariants",
    "AckRecorder": "wal_engine.testing.invariants",
    "FaultProxy": "wal_engine.testing.proxy",
}


if TYPE_CHECKING:
    from wal_engine.runtime.replayer import check_history, replay_events
    from wal_engine.testing.clock import ManualClock
    from wal_engine.testing.crash import (
        advance_timers,
        crash_at,
        deliver_signals,
        drive_to_quiescence,
        expire_leases,
        outcome,
        run_crash_free,
        run_crash_free_many,
        run_worker_until_idle,
    )
    from wal_engine.testing.effects import EffectStats, run_effect_model
    from wal_engine.testing.invariants import AckRecorder, assert_no_violations, check_log
    from wal_engine.testing.ledger import Behaviour, EffectLedger, StaleDelivery, check_effects
    from wal_engine.testing.machine import (
        AgentUnderTest,
        MachineStats,
        Submission,
        crash_machine,
        run_crash_machine,
    )
    from wal_engine.testing.postgres import DatabaseFactory, TestServer, start_test_server
    from wal_engine.testing.processes import WorkerPool, WorkerProcess
    from wal_engine.testing.proxy import FaultProxy
    from wal_engine.testing.replay import (
        ReplayMismatch,
        assert_replay_equivalent,
        assert_replays,
        dump_history,
        load_history,
    )

__all__ = [
    "AckRecorder",
    "AgentUnderTest",
    "Behaviour",
    "DatabaseFactory",
    "EffectLedger",
    "EffectStats",
    "FaultProxy",
    "MachineStats",
    "ManualClock",
    "ReplayMismatch",
    "StaleDelivery",
    "Submission",
    "TestServer",
    "WorkerPool",
    "WorkerProcess",
    "advance_timers",
    "assert_no_violations",
    "assert_replay_equivalent",
    "assert_replays",
    "check_effects",
    "check_history",
    "check_log",
    "crash_at",
    "crash_machine",
    "deliver_signals",
    "drive_to_quiescence",
    "dump_history",
    "expire_leases",
    "load_history",
    "outcome",
    "replay_events",
    "run_crash_free",
    "run_crash_free_many",
    "run_crash_machine",
    "run_effect_model",
    "run_worker_until_idle",
    "start_test_server",
]


def __getattr__(name: str) -> Any:
    module_name = _lazy.get(name)
    if module_name is None:
        raise AttributeError(f"module 'wal_engine.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)

