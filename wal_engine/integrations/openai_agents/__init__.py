"""Durable runs of OpenAI Agents SDK agents on wal-engine's log (extra ``[openai-agents]``).

:class:`DurableRunner` runs an SDK agent inside a wal-engine agent function: every model
response and every function-tool call is a journaled wal-engine call, handoffs between
agents follow the SDK's own loop over journaled responses, and a tool that needs approval
(``needs_approval``) makes the task wait durably for ``engine.approve``. A task resumed on
any worker re-runs the SDK loop with recorded responses and results: nothing that committed
is asked for or done again. See :mod:`.model` for how responses are recorded and
:mod:`.runner` for tools, handoffs and approvals.

Importing this package imports the SDK (module ``agents``); the core library never does.
"""

from __future__ import annotations

try:
    import agents  # noqa: F401  # fail early with a clear message
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "wal_engine.integrations.openai_agents needs the OpenAI Agents SDK:"
        " pip install 'wal-engine[openai-agents]'"
    ) from error

from wal_engine.integrations.openai_agents.model import DurableModel, DurableModelProvider
from wal_engine.integrations.openai_agents.runner import DurableRunner

__all__ = ["DurableModel", "DurableModelProvider", "DurableRunner"]
