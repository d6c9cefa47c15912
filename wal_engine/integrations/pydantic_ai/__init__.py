"""Durable Pydantic AI agents on wal-engine's write-ahead log (extra ``[pydantic-ai]``).

Attach :class:`WalDurability` to a Pydantic AI ``Agent`` and run the agent inside a
wal-engine agent function with :func:`run_agent`: its model requests are journaled as
``ctx.llm`` calls (response and token usage), its tool calls, MCP calls included, as
``ctx.tool`` calls, and the tool events its event stream handler receives as calls of their
own. A worker that resumes the task re-runs the agent function; the agent's completed
model responses and tool results then come from the log, and only what had not finished
runs again. See :mod:`.durability` for how each operation is journaled.

Importing this package imports Pydantic AI; the core library never does.
"""

from __future__ import annotations

try:
    import pydantic_ai.durable_exec  # noqa: F401  # fail early with a clear message
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "wal_engine.integrations.pydantic_ai needs Pydantic AI: "
        "pip install 'wal-engine[pydantic-ai]'"
    ) from error

from wal_engine.errors import UnserializableValue
from wal_engine.integrations.pydantic_ai.durability import (
    CONFIG_KEY,
    CallOptions,
    WalDurability,
    current_context,
    durable_scope,
)
from wal_engine.integrations.pydantic_ai.running import run_agent

__all__ = ["CONFIG_KEY", "CallOptions", "UnserializableValue", "WalDurability",
           "current_context", "durable_scope", "run_agent"]
