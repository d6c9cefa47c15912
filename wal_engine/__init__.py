"""wal-engine: durable long-running LLM-agent tasks on a PostgreSQL write-ahead log.

The pure modules (errors, ids, limits, payloads, events, state_machine, chain) are cheap
to import. The running side (store, engine, worker) is loaded lazily on first attribute
access (PEP 562), so ``import replay`` never pulls in asyncpg. Type checkers read the same
names through the ``TYPE_CHECKING`` imports below (``__all__`` and ``_lazy`` name the same
set; ``tests/unit/test_public_api.py`` checks it), so the API is typed for its users.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_lazy = {
    "Store": "wal_engine.store",
    "Database": "wal_engine.store",
    "EventRecord": "wal_engine.store",
    "TaskHead": "wal_engine.store",
    "connect": "wal_engine.engine",
    "code_version": "wal_engine.engine",
    "Engine": "wal_engine.engine",
    "EngineConfig": "wal_engine.engine",
    "Worker": "wal_engine.runtime.worker",
    "WorkerConfig": "wal_engine.runtime.worker",
    "AgentContext": "wal_engine.runtime.context",
    "LlmResponse": "wal_engine.runtime.context",
    "ToolError": "wal_engine.runtime.context",
    "SignalTimeout": "wal_engine.runtime.context",
    "Budget": "wal_engine.events",
    "PlanNode": "wal_engine.events",
    "RetryPolicy": "wal_engine.retries",
    "TransientError": "wal_engine.retries",
    "PermanentError": "wal_engine.retries",
    "DidNotAct": "wal_engine.retries",
    "LeaseExpired": "wal_engine.retries",
    "ensure_lease": "wal_engine.runtime.context",
    "lease_valid": "wal_engine.runtime.context",
    "current_call": "wal_engine.runtime.context",
    "WalError": "wal_engine.errors",
    "secret_ref": "wal_engine.security.redaction",
}


if TYPE_CHECKING:
    from wal_engine.engine import Engine, EngineConfig, code_version, connect
    from wal_engine.errors import WalError
    from wal_engine.events import Budget, PlanNode
    from wal_engine.retries import (
        DidNotAct,
        LeaseExpired,
        PermanentError,
        RetryPolicy,
        TransientError,
    )
    from wal_engine.runtime.context import (
        AgentContext,
        LlmResponse,
        SignalTimeout,
        ToolError,
        current_call,
        ensure_lease,
        lease_valid,
    )
    from wal_engine.runtime.worker import Worker, WorkerConfig
    from wal_engine.security.redaction import secret_ref
    from wal_engine.store import Database, EventRecord, Store, TaskHead

__all__ = [
    "AgentContext",
    "Budget",
    "Database",
    "DidNotAct",
    "Engine",
    "EngineConfig",
    "EventRecord",
    "LeaseExpired",
    "LlmResponse",
    "PermanentError",
    "PlanNode",
    "RetryPolicy",
    "SignalTimeout",
    "Store",
    "TaskHead",
    "ToolError",
    "TransientError",
    "WalError",
    "Worker",
    "WorkerConfig",
    "__version__",
    "code_version",
    "connect",
    "current_call",
    "ensure_lease",
    "lease_valid",
    "secret_ref",
]


def __getattr__(name: str) -> Any:
    module_name = _lazy.get(name)
    if module_name is None:
        raise AttributeError(f"module 'wal_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)

