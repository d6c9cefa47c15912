"""LangGraph checkpointer on wal-engine's write-ahead log (extra ``[langgraph]``).

``WalCheckpointSaver`` stores each LangGraph thread as one wal-engine task: checkpoints,
pending writes and retention operations are hash-chained events, so a LangGraph agent gets
the log's audit trail, ``verify``, history and forks. See :mod:`.saver` for the storage
layout and the retention design, :mod:`.thread_log` for the lease rules.

Importing this package imports LangGraph; the core library never does.
"""

from __future__ import annotations

try:
    import langgraph.checkpoint.base  # noqa: F401  # fail early with a clear message
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "wal_engine.integrations.langgraph needs LangGraph: pip install 'wal-engine[langgraph]'"
    ) from error

from wal_engine.integrations.langgraph.codec import thread_task_id
from wal_engine.integrations.langgraph.saver import (
    WalCheckpointSaver,
    default_serde,
    default_worker_id,
)
from wal_engine.integrations.langgraph.thread_log import AGENT

__all__ = ["AGENT", "WalCheckpointSaver", "default_serde", "default_worker_id", "thread_task_id"]
