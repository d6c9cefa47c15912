"""Recovery hooks: an agent's callbacks at the moments a hand-off needs work outside the log.

The second seed's worker contract names "checkpointing, heartbeat management, and recovery
hooks"; a hook is where an agent re-opens a sandbox or a browser session after another
worker took its task over, or pages someone with the diagnostic report when a task needs
a human. Hooks are **not** journaled calls: they run again on every claim, live and after
every resume, so they must be safe to repeat (open-if-closed, send-once-by-key); anything
that must happen once belongs in ``ctx.tool``. A hook that raises is logged and recorded
(``hook_failed``) and the task goes on: a hook can never corrupt the log or stop a task.

=================  ==============================================================  =========
hook               when                                                            ``reason``
=================  ==============================================================  =========
``on_claim``       every time a worker takes the task, before the agent code runs  see below
``on_resume``      as ``on_claim``, except on the task's first run                 see below
``on_orphaned``    before ``on_resume``, when the previous worker's lease expired  orphaned
``on_checkpoint``  after each ``ctx.checkpoint`` is recorded                       checkpoint
``on_escalation``  a call in doubt was escalated to a human (``tool_call_uncertain``) the doubt
``on_complete``    the task ended (COMPLETED or FAILED), ``detail`` its output or failure
=================  ==============================================================  =========

``reason`` of a claim: ``first_run``, ``orphaned`` (lease expired), ``released`` (handed back
at a shutdown), ``woken`` (timer due, signal arrived); ``new_version`` is true when the
code that runs the task is not the version that started it (a deploy).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

HookFunction = Callable[["HookEvent"], Awaitable[None] | None]


class HookEvent(msgspec.Struct, frozen=True, kw_only=True):
    """What a hook is told."""

    hook: str
    task_id: str
    agent: str
    reason: str
    task_version: str | None = None
    """The agent version that started the task."""
    code_version: str | None = None
    """The agent version of the code running now."""
    new_version: bool = False
    worker_id: str | None = None
    epoch: int = 0
    seq: int = 0
    detail: Any = None
    """``on_complete``: the output, or the failure (reason, error, diagnostic);
    ``on_escalation``: the call id, tool, reason and error of the uncertain call."""


class AgentHooks(msgspec.Struct, frozen=True, kw_only=True):
    """An agent's recovery hooks; each a sync or async function of a :class:`HookEvent`."""

    on_claim: HookFunction | None = None
    on_resume: HookFunction | None = None
    on_orphaned: HookFunction | None = None
    on_checkpoint: HookFunction | None = None
    on_escalation: HookFunction | None = None
    on_complete: HookFunction | None = None

    def get(self, hook: str) -> HookFunction | None:
        """The function registered for ``hook`` (``on_claim``, ...), if any."""
        function: HookFunction | None = getattr(self, hook)
        return function


NO_HOOKS = AgentHooks()


async def call_hook(function: HookFunction, event: HookEvent) -> None:
    """Call a hook, awaiting it if it is async."""
    result = function(event)
    if inspect.isawaitable(result):
        await result
