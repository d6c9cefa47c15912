"""``WalDurability``: a Pydantic AI capability that journals an agent's I/O in wal-engine's log.

Built on the public surface Pydantic AI offers durable engines (``pydantic_ai.durable_exec``):
its base capability collects the model, the toolsets (function, MCP, dynamic) and the event
stream handler into *durable operations*, and hands each one to a backend to run as one
durable unit. wal-engine's unit is a journaled call of the agent context:

* a model request (streaming or not) or a message compaction: ``ctx.llm``, its response
  and token usage recorded; on resume the recorded response, the model is not called;
* a function, MCP or dynamic tool call: ``ctx.tool``, idempotent unless the tool's
  ``wal_engine`` metadata says otherwise (:class:`CallOptions`); on resume the recorded
  result, the tool does not run (an interrupted call is retried under its idempotency key,
  or escalated if it is not idempotent, as ``ctx.tool`` does);
* MCP ``get_tools``/``get_instructions``, dynamic toolset discovery, MCP and dynamic argument
  validation: ``ctx.tool``, idempotent; on resume the recorded answer;
* each tool event for the event stream handler: ``ctx.tool``, idempotent; a resumed run
  does not deliver it again (model events reach the handler live, inside the model call);
* the run's start time (for ``timeout=``): ``ctx.now()``.

Function tool argument validation runs in place: it is the tool's own pydantic schema applied
to arguments that come from a recorded model response, so it answers the same on every run,
and journaling it would add two events to every tool call.

The log is the journal, so the codec is Pydantic AI's JSON codec: every result is reduced
to plain JSON inside the unit and validated back into Pydantic AI's types outside it, live
and on resume alike. Dependencies (``deps``) and the run context never cross a process
boundary: units run in the worker's own process, as DBOS runs its steps, so ``deps`` are
whatever the agent function passes to the run (build them from the task's input, so that
a worker that resumes the task builds the same ones). The journal matches the k-th call of a
run with the k-th recorded one, so tool calls run one after another inside a task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal, TypedDict, cast
from weakref import WeakKeyDictionary

from pydantic_ai.agent import EventStreamHandler
from pydantic_ai.durable_exec import (
    JSON_CODEC,
    BaseDurabilityCapability,
    CallableOperationBackend,
    DurabilityEngineSpec,
    DurableOperationId,
    EventStreamHandlerId,
    JournalOperationNamer,
    ModelCompactMessagesId,
    ModelRequestId,
    RoleBasedOperationConfig,
    ToolsetCallToolId,
    ToolsetKind,
    ToolsetValidateToolArgumentsId,
    conversation_id_from_run_id,
)
from pydantic_ai.models import Model
from pydantic_ai.tools import AgentDepsT, RunContext
from pydantic_ai.toolsets import ToolsetTool
from pydantic_core import to_jsonable_python

from wal_engine.errors import UnserializableValue
from wal_engine.retries import DEFAULT_POLICY, RetryPolicy
from wal_engine.runtime.context import LlmResponse, UncertainPolicy

if TYPE_CHECKING:
    from wal_engine.runtime.context import AgentContext

CONFIG_KEY: Final = "wal_engine"
"""The tool metadata key of a tool's own call options (:class:`CallOptions`)."""

_current: ContextVar[AgentContext | None] = ContextVar("wal_engine_pydantic_ai_context",
                                                       default=None)


class CallOptions(TypedDict, total=False):
    """How one kind of durable unit is journaled; every key is optional.

    Set per tool in its metadata, ``@agent.tool(metadata={"wal_engine": {"idempotent":
    False}})``, or for every tool, MCP call and model request with the arguments of
    :class:`WalDurability`. ``False`` in place of the options runs the tool outside the log
    (it runs again on every resume).
    """

    idempotent: bool
    """Whether a retry after a crash (same idempotency key) is safe. A non-idempotent tool
    interrupted mid-call is escalated, never re-run (``ctx.tool``'s rule)."""
    retry: RetryPolicy
    """Attempts and backoff of the call."""
    timeout_s: float | None
    """Per-attempt timeout."""
    on_uncertain: UncertainPolicy
    """What an interrupted non-idempotent call does: ``"fail"`` the task or ``"wait"``
    for ``engine.reconcile``."""


def current_context() -> AgentContext | None:
    """The wal-engine agent context the durable run in this coroutine belongs to."""
    return _current.get()


@contextmanager
def durable_scope(ctx: AgentContext) -> Iterator[None]:
    """Inside it, agents that carry :class:`WalDurability` journal their I/O in ``ctx``'s
    task; outside any, they run as ordinary, non-durable Pydantic AI agents."""
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)


def _context() -> AgentContext:
    ctx = _current.get()
    assert ctx is not None, "a durable unit ran outside durable_scope"
    return ctx


def _run_step(value: object) -> int | None:
    return value.run_step if isinstance(value, RunContext) else None


def _journal_args(operation_id: DurableOperationId,
                  cache_key: tuple[object, ...]) -> dict[str, Any]:
    """The call's arguments as journaled and matched on resume: what identifies the call,
    small and stable across processes (never message timestamps, never the whole history,
    which the recorded responses before it already fix)."""
    contexts = [item for item in cache_key if isinstance(item, RunContext)]
    step = _run_step(contexts[0]) if contexts else None
    match operation_id:
        case ToolsetCallToolId() | ToolsetValidateToolArgumentsId():
            tool_name, tool_args = cache_key[0], cache_key[1]
            call_id = contexts[0].tool_call_id if contexts else None
            return {"tool": tool_name, "args": to_jsonable_python(tool_args),
                    "tool_call_id": call_id, "run_step": step}
        case ModelRequestId():
            messages = cache_key[1]
            count = len(messages) if isinstance(messages, list) else None
            return {"messages": count, "run_step": step}
        case EventStreamHandlerId():
            event = cache_key[0]
            return {"event": getattr(event, "event_kind", type(event).__name__),
                    "tool_call_id": _event_call_id(event), "run_step": step}
        case _:
            return {"run_step": step}


def _event_call_id(event: object) -> str | None:
    for holder in (event, getattr(event, "part", None), getattr(event, "result", None)):
        value = getattr(holder, "tool_call_id", None)
        if isinstance(value, str):
            return value
    return None


def _usage_response(payload: object) -> LlmResponse:
    """A model response as ``ctx.llm`` records it: the JSON payload and its token usage."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    usage = usage if isinstance(usage, dict) else {}
    return LlmResponse(content=payload, input_tokens=_tokens(usage, "input_tokens"),
                       output_tokens=_tokens(usage, "output_tokens"))


def _tokens(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True)
class _Unit:
    """A durable unit's body as a ``ctx.tool``/``ctx.llm`` function: it ignores the
    journaled arguments (they identify the call; the body holds the real ones)."""

    body: Callable[[], Awaitable[object]]

    async def __call__(self, _args: object) -> object:
        return await self.body()


class _LlmUnit(_Unit):
    async def __call__(self, _args: object) -> object:
        return _usage_response(await self.body())


class WalOperationBackend(CallableOperationBackend[CallOptions]):
    """Runs each of Pydantic AI's durable operations as one journaled call of the task."""

    def __init__(self, *, agent_name: str, default_model_id: str | None,
                 config: RoleBasedOperationConfig[CallOptions]) -> None:
        super().__init__(
            namer=JournalOperationNamer(agent_name, default_model_id=default_model_id or "default"),
            config=config)

    async def execute(self, *, operation_id: DurableOperationId, name: str,
                      body: Callable[[], Awaitable[object]], cache_key: tuple[object, ...],
                      config: CallOptions) -> object:
        """Run ``body`` as the task's next journaled call (or return its recorded result)."""
        ctx = _context()
        if isinstance(operation_id, ToolsetValidateToolArgumentsId) and (
                operation_id.toolset_kind == "function"):
            return await body()
        args = _journal_args(operation_id, cache_key)
        options = config or {}
        retry = options.get("retry", DEFAULT_POLICY)
        timeout_s = options.get("timeout_s")
        if isinstance(operation_id, ModelRequestId | ModelCompactMessagesId):
            return await ctx.llm(name, _LlmUnit(body), args, retry=retry, timeout_s=timeout_s)
        return await ctx.tool(name, _Unit(body), args, retry=retry, timeout_s=timeout_s,
                              idempotent=options.get("idempotent", True),
                              on_uncertain=options.get("on_uncertain", "fail"))


class WalDurability(BaseDurabilityCapability[AgentDepsT]):
    """Makes a Pydantic AI agent durable on wal-engine: attach it to the agent, and run the
    agent inside a wal-engine agent function with :func:`run_agent` (or
    :func:`durable_scope`). Every model request, tool call (function, MCP, dynamic) and
    tool event for the stream handler is then a journaled call of the task, so a worker that
    resumes the task after a crash gets each completed response and result from the log.
    Outside a wal-engine run the agent is an ordinary agent.

    Example::

        agent = Agent(model, name="support", capabilities=[WalDurability()])

        @engine.agent("support")
        async def support(ctx: AgentContext, question: str) -> str:
            return (await run_agent(ctx, agent, question)).output
    """

    engine_spec = DurabilityEngineSpec(
        engine_name="wal-engine",
        durable_unit_noun="call",
        durable_unit_plural="calls",
        durable_container_noun="agent function",
        # The log is a journal of plain JSON: results are reduced to JSON inside the call.
        codec=JSON_CODEC,
        serialization_failure=lambda error: UnserializableValue(str(error)),
        # Tools added for one run (agent.run(toolsets=...)) bypass the binding, and would
        # act again on every resume: refused inside a task.
        unsupported_runtime_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        # Calls run in the task's own process, so an MCP server holds one session per run,
        # entered by the first call that needs it (and its connect retried with that call).
        toolset_lifecycles={"function": "enter-always", "mcp": "enter-in-durable-unit",
                            "dynamic": "enter-never"},
        tool_call_result_upgrade_lenient=False,
        journal_discovery=True,
        # The journal matches calls by their order: parallel tool calls would race for it.
        sequential_tools_in_durable_context=True,
        tool_config_key=CONFIG_KEY,
    )

    def __init__(
        self,
        *,
        models: Mapping[str, Model] | None = None,
        event_stream_handler: EventStreamHandler[AgentDepsT] | None = None,
        name: str | None = None,
        model_options: CallOptions | None = None,
        tool_options: CallOptions | None = None,
        mcp_options: CallOptions | None = None,
        event_options: CallOptions | None = None,
    ) -> None:
        """Create the capability; the agent's model, name and toolsets are found when it
        is attached.

        Args:
            models: Further models by id, for ``agent.run(model=...)`` inside a task.
            event_stream_handler: Receives the run's events: model events live while the
                model streams (inside its journaled call), each tool event in a journaled
                call of its own (so a resume does not deliver it again).
            name: The name in the journaled call names; defaults to the agent's ``name``.
                Journaled names are matched on resume: keep it stable.
            model_options: Retry and timeout of model requests.
            tool_options: Defaults of function tool calls (a tool's ``wal_engine``
                metadata overrides them).
            mcp_options: Defaults of MCP server calls.
            event_options: Retry and timeout of event handler calls.
        """
        super().__init__(models=models, event_stream_handler=event_stream_handler, name=name)
        self._model_options: CallOptions = model_options or {}
        self._tool_options: CallOptions = tool_options or {}
        self._mcp_options: CallOptions = mcp_options or {}
        self._event_options: CallOptions = event_options or {}

    @property
    def in_durable_context(self) -> bool:
        """Whether this coroutine runs inside a wal-engine task (:func:`durable_scope`)."""
        return _current.get() is not None

    def get_default_run_id(self) -> str | None:
        """A run id that a resumed task draws again: the task id and the run's ordinal."""
        ctx = _current.get()
        if ctx is None:
            return None
        return f"{ctx.task_id}:{_next_run_ordinal(ctx)}"

    def get_default_conversation_id(self, run_id: str) -> str | None:
        """The conversation id derived from the replay-stable run id."""
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None

    async def get_run_start_time(self, run_id: str) -> datetime | None:
        """The run's start, journaled (``ctx.now()``): a resumed run counts its ``timeout=``
        from when it first started."""
        ctx = _current.get()
        if ctx is None:
            return None
        return datetime.fromtimestamp(await ctx.now(), tz=UTC)

    def get_durable_operation_backend(self) -> WalOperationBackend:
        """The backend that journals this agent's operations in the current task."""
        def tool_config(operation_id: DurableOperationId, tool: object | None,
                        tool_name: str) -> CallOptions | Literal[False]:
            kind: ToolsetKind = "function"
            if isinstance(operation_id, ToolsetCallToolId | ToolsetValidateToolArgumentsId):
                kind = operation_id.toolset_kind
            resolve = self._build_resolve_tool_config(self._toolset_base_config(kind))
            return cast("CallOptions | Literal[False]",
                        resolve(cast("ToolsetTool[Any] | None", tool), tool_name))

        return WalOperationBackend(
            agent_name=self.name, default_model_id=self.default_model_id,
            config=RoleBasedOperationConfig(
                model=self._model_options, event=self._event_options, capability={},
                tool=self._tool_options, resolve_tool=tool_config))

    def _toolset_base_config(self, kind: ToolsetKind) -> Any:
        return self._mcp_options if kind == "mcp" else self._tool_options


_run_ordinals: WeakKeyDictionary[AgentContext, int] = WeakKeyDictionary()
"""Agent runs started so far by each execution of an agent function (its context)."""


def _next_run_ordinal(ctx: AgentContext) -> int:
    """The how-manyth agent run of this execution of the agent function (0 first): a
    resumed execution has a new context and counts again, so each run gets its id again."""
    ordinal = _run_ordinals.get(ctx, 0)
    _run_ordinals[ctx] = ordinal + 1
    return ordinal
