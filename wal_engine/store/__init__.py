"""PostgreSQL side of the log: connections, statements, appends and reads."""

from wal_engine.store.connection import Database, apply_schema, resolve_dsn
from wal_engine.store.records import AppendResult, EventRecord, PendingAppend, TaskHead
from wal_engine.store.store import Store

__all__ = [
    "AppendResult",
    "Database",
    "EventRecord",
    "PendingAppend",
    "Store",
    "TaskHead",
    "apply_schema",
    "resolve_dsn",
]
