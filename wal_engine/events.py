"""The event vocabulary: one closed, tagged union of frozen msgspec Structs (pure).

Every row of ``wal_events`` is one of these. The row's ``type`` column is the struct's tag
and its ``version`` column the struct's ``VERSION``; the payload is the struct's fields as
canonical JSON (:mod:`wal_engine.payloads`). Stored payloads decode only into this closed
union and plain JSON values: no pickle, no class looked up by a name found in a row.

Evolution rules:

* A new field comes with a default, so older rows still decode; the version stays.
* A field that changes type or meaning bumps ``VERSION`` and registers an upcaster in
  ``replay.upcasting`` that lifts a stored payload of version n to n + 1.
* A new kind of fact is a new event type; a type is never reused for another meaning.
* Tags are past-tense snake_case and never change once written.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import msgspec

from wal_engine import payloads
from wal_engine.errors import UndecodableEvent, UnknownEventType, UnknownEventVersion
from wal_engine.state_machine import Status


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every stored event."""

    VERSION: ClassVar[int] = 1
    TARGET_STATUS: ClassVar[Status | None] = None
    """The status the task moves to when this event is recorded, or None for observations."""


class Budget(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Limits allocated to a task at submission; None means unlimited."""

    max_steps: int | None = None
    max_tokens: int | None = None
    max_runtime_s: float | None = None
    max_cost_usd: float | None = None
    max_tool_calls: int | None = None
    max_attempts: int | None = None


class PlanNode(msgspec.Struct, frozen=True, kw_only=True):
    """One planned step of the task's plan DAG."""

    node_id: str
    action: Any = None
    depends_on: list[str] = []


# --------------------------------------------------------------------------- transitions


class TaskSubmitted(Event, tag="task_submitted", frozen=True, kw_only=True):
    """The task exists: its agent, validated input and budget (always seq 1)."""

    TARGET_STATUS = Status.QUEUED
    agent: str
    input: Any = None
    budget: Budget = Budget()
    parent_task_id: str | None = None
    parent_seq: int | None = None
    agent_version: str | None = None
    """The version of the agent code that started the task; None when the submitter did
    not have the agent registered (the first claim then pins the claiming code's version)."""


class TaskClaimed(Event, tag="task_claimed", frozen=True, kw_only=True):
    """A worker took a QUEUED task; the row's epoch is its fencing token."""

    TARGET_STATUS = Status.RUNNING
    worker_id: str
    attempt: int = 1
    agent_version: str | None = None
    """The task's agent version as of the claim (pinned by it if the submission had none)."""


class TaskResumed(Event, tag="task_resumed", frozen=True, kw_only=True):
    """A worker took a RESUMING task and rehydrates its state from the log."""

    TARGET_STATUS = Status.RUNNING
    worker_id: str
    attempt: int = 1
    agent_version: str | None = None


class StepStarted(Event, tag="step_started", frozen=True, kw_only=True):
    """The next step after a checkpoint began."""

    TARGET_STATUS = Status.RUNNING
    step: int


class StepCheckpointed(Event, tag="step_checkpointed", frozen=True, kw_only=True):
    """A step boundary: everything before is durable; ``next_action`` is what comes next."""

    TARGET_STATUS = Status.CHECKPOINTED
    step: int
    next_action: Any = None


class TimerStarted(Event, tag="timer_started", frozen=True, kw_only=True):
    """The task sleeps durably until ``wake_at_ms`` (database clock, ms since the epoch)."""

    TARGET_STATUS = Status.WAITING
    timer_id: str
    wake_at_ms: int
    duration_ms: int


class SignalAwaited(Event, tag="signal_awaited", frozen=True, kw_only=True):
    """The task waits for a named signal, at most ``timeout_ms`` (database clock) if given."""

    TARGET_STATUS = Status.WAITING
    name: str
    timeout_ms: int | None = None


class TaskWoken(Event, tag="task_woken", frozen=True, kw_only=True):
    """A waiting task is due again: its timer fired, its signal arrived, or its wait timed out."""

    TARGET_STATUS = Status.RESUMING
    reason: str


class TaskOrphaned(Event, tag="task_orphaned", frozen=True, kw_only=True):
    """The owner's lease expired (worker presumed dead); any worker may resume the task."""

    TARGET_STATUS = Status.RESUMING
    previous_owner: str | None = None
    previous_epoch: int = 0


class TaskReleased(Event, tag="task_released", frozen=True, kw_only=True):
    """The owner handed the task back on purpose (graceful shutdown, fork)."""

    TARGET_STATUS = Status.RESUMING
    worker_id: str | None = None
    reason: str = "shutdown"


class TaskCompleted(Event, tag="task_completed", frozen=True, kw_only=True):
    """The task finished with ``output``."""

    TARGET_STATUS = Status.COMPLETED
    output: Any = None


class TaskFailed(Event, tag="task_failed", frozen=True, kw_only=True):
    """The task failed; ``diagnostic`` is the report for the human it escalates to."""

    TARGET_STATUS = Status.FAILED
    reason: str
    error: str | None = None
    diagnostic: Any = None


class TaskCancelled(Event, tag="task_cancelled", frozen=True, kw_only=True):
    """The task was cancelled from outside; it is terminal (FAILED)."""

    TARGET_STATUS = Status.FAILED
    reason: str = "cancelled"
    requested_by: str | None = None


# --------------------------------------------------------------------------- observations


class ToolCallIntended(Event, tag="tool_call_intended", frozen=True, kw_only=True):
    """Write-ahead record of a tool call, committed before the call runs."""

    call_id: str
    tool: str
    args: Any = None
    args_hash: str
    idempotency_key: str
    idempotent: bool = True
    attempt: int = 1


class ToolCallCompleted(Event, tag="tool_call_completed", frozen=True, kw_only=True):
    """The recorded result of an intended tool call."""

    call_id: str
    result: Any = None


class ToolCallFailed(Event, tag="tool_call_failed", frozen=True, kw_only=True):
    """One failed attempt of a tool call; ``retry_at_ms`` set when another attempt follows."""

    call_id: str
    attempt: int
    error: str
    error_type: str
    retryable: bool = False
    retry_at_ms: int | None = None


class ToolCallUncertain(Event, tag="tool_call_uncertain", frozen=True, kw_only=True):
    """A call not safe to repeat is in doubt; it is escalated, never re-run.

    ``reason``: ``interrupted`` (the run that made the attempt ended before its outcome),
    ``timed_out``, ``connection_lost`` or ``error_after_start`` (the attempt failed with
    an error that does not say it did not act: ``error_type`` and ``error``). Until
    ``not_before_ms`` (epoch ms) the attempt may still act, so it is not reconciled before.
    """

    call_id: str
    policy: str
    reason: str = "interrupted"
    error_type: str | None = None
    error: str | None = None
    not_before_ms: int | None = None


class LlmCallIntended(Event, tag="llm_call_intended", frozen=True, kw_only=True):
    """Write-ahead record of an LLM call."""

    call_id: str
    model: str
    request: Any = None
    request_hash: str
    idempotency_key: str
    attempt: int = 1


class LlmCallCompleted(Event, tag="llm_call_completed", frozen=True, kw_only=True):
    """The journaled LLM response and its token usage, so replay never pays twice."""

    call_id: str
    response: Any = None
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0


class LlmCallFailed(Event, tag="llm_call_failed", frozen=True, kw_only=True):
    """One failed attempt of an LLM call."""

    call_id: str
    attempt: int
    error: str
    error_type: str
    retryable: bool = False
    retry_at_ms: int | None = None


class MessageAppended(Event, tag="message_appended", frozen=True, kw_only=True):
    """One message added to the agent's conversation history."""

    role: str
    content: Any = None
    name: str | None = None


class TimerFired(Event, tag="timer_fired", frozen=True, kw_only=True):
    """A durable timer came due."""

    timer_id: str


class SignalReceived(Event, tag="signal_received", frozen=True, kw_only=True):
    """A signal from the inbox was delivered to the task."""

    name: str
    payload: Any = None
    signal_id: int


class ApprovalRequested(Event, tag="approval_requested", frozen=True, kw_only=True):
    """A human must approve the exact planned call (tool and hash of its canonical args).
    ``args`` are those arguments as the log records them (redacted), so whoever approves
    sees what they approve (``wal-engine pending``); None in histories written before."""

    call_id: str
    tool: str
    args_hash: str
    signal_name: str
    args: Any = None


class ApprovalDecided(Event, tag="approval_decided", frozen=True, kw_only=True):
    """The audited answer to an approval request: who decided, on which call."""

    call_id: str
    approved: bool
    approver: str
    args_hash: str
    comment: str | None = None


class ValueRecorded(Event, tag="value_recorded", frozen=True, kw_only=True):
    """A non-deterministic value (clock, random) journaled so replay sees the same value."""

    call_id: str
    kind: str
    value: Any = None


class EnvironmentSet(Event, tag="environment_set", frozen=True, kw_only=True):
    """The task's own environment variables changed (a None value unsets one)."""

    values: dict[str, str | None]


class PlanUpdated(Event, tag="plan_updated", frozen=True, kw_only=True):
    """The plan DAG was (re)written; completed nodes are kept."""

    nodes: list[PlanNode]


class PlanNodeCompleted(Event, tag="plan_node_completed", frozen=True, kw_only=True):
    """A node of the plan DAG is done."""

    node_id: str


class BudgetExceeded(Event, tag="budget_exceeded", frozen=True, kw_only=True):
    """A budget tripped: which one, its limit and what was used. A TaskFailed follows."""

    budget: str
    limit: float
    used: float


class TaskForked(Event, tag="task_forked", frozen=True, kw_only=True):
    """This task continues a prefix of another task's history."""

    parent_task_id: str
    parent_seq: int


# --------------------------------------------------------------------------- LangGraph threads
# Written by wal_engine.integrations.langgraph: one task per LangGraph thread. Channel values
# and pending writes arrive already serialized by LangGraph's serializer; they are stored as
# plain JSON (``{"j": value}`` for plain JSON values, else ``{"t": type, "b": base64}`` or
# ``{"t": type, "z": base64 of zlib}``) and are never decoded by the engine itself.


class GraphCheckpointSaved(Event, tag="graph_checkpoint_saved", frozen=True, kw_only=True):
    """A LangGraph checkpoint: its skeleton, metadata and the channel values that changed.

    ``checkpoint`` is the checkpoint without ``id`` (that is ``checkpoint_id``) and without
    ``channel_values`` (ts, channel_versions, versions_seen, ...). ``values`` holds only the
    channels whose value this event stores, channel -> ``{"v": version, ...encoded value}``;
    ``refs`` maps every other channel that has a value to the seq of the earlier event of
    this task whose ``values`` holds it. A checkpoint's size therefore does not grow with the
    thread's history, and reading one needs the events it names, never a scan.
    ``big_ints`` lists the JSON paths in ``metadata`` of integers outside the signed 64-bit
    range, which the log's payloads do not hold as numbers: each is stored as its decimal
    text at that path and read back as the integer.
    """

    checkpoint_ns: str = ""
    checkpoint_id: str
    parent_checkpoint_id: str | None = None
    checkpoint: dict[str, Any]
    metadata: dict[str, Any] = {}
    values: dict[str, Any] = {}
    refs: dict[str, int] = {}
    big_ints: list[list[str | int]] = []


class GraphWritesSaved(Event, tag="graph_writes_saved", frozen=True, kw_only=True):
    """Pending writes of one LangGraph task against one checkpoint, as one ``put_writes`` call.

    ``writes`` is a list of ``{"i": index, "c": channel, ...encoded value}``. Readers keep one
    write per (task, index): the first one recorded, or the last one when ``upsert`` is set
    (every write is a special channel: error, interrupt, ...), as LangGraph's savers do.
    """

    checkpoint_ns: str = ""
    checkpoint_id: str
    graph_task_id: str
    task_path: str = ""
    writes: list[Any] = []
    upsert: bool = False


class GraphCheckpointsRemoved(Event, tag="graph_checkpoints_removed", frozen=True, kw_only=True):
    """A retention operation hid checkpoints recorded before this event.

    ``operation`` is ``delete_thread``, ``prune_delete``, ``prune_keep_latest`` (``kept``
    maps each namespace to the checkpoint it kept) or ``delete_for_runs`` (``run_ids``).
    Nothing is erased: the events stay in the log and the chain verifies; readers no longer
    see what the operation removed.
    """

    operation: str
    run_ids: list[str] = []
    kept: dict[str, str] = {}
    checkpoints_removed: int = 0


class PatchMarked(Event, tag="patch_marked", frozen=True, kw_only=True):
    """Agent code passed ``ctx.patched(change_id)`` for the first time in this task: from
    here on the task runs the patched branch (histories without it run the old one)."""

    change_id: str


class RunInterrupted(Event, tag="run_interrupted", frozen=True, kw_only=True):
    """The run lost its database connection and continues under the same lease: its agent
    code runs again from the top against the log as it was read back."""

    error_type: str
    error: str = ""
    worker_id: str | None = None


class HookFailed(Event, tag="hook_failed", frozen=True, kw_only=True):
    """A recovery hook of the agent raised; recorded, and the task went on."""

    hook: str
    error_type: str
    error: str = ""


AnyEvent = (
    TaskSubmitted
    | TaskClaimed
    | TaskResumed
    | StepStarted
    | StepCheckpointed
    | TimerStarted
    | SignalAwaited
    | TaskWoken
    | TaskOrphaned
    | TaskReleased
    | TaskCompleted
    | TaskFailed
    | TaskCancelled
    | ToolCallIntended
    | ToolCallCompleted
    | ToolCallFailed
    | ToolCallUncertain
    | LlmCallIntended
    | LlmCallCompleted
    | LlmCallFailed
    | MessageAppended
    | TimerFired
    | SignalReceived
    | ApprovalRequested
    | ApprovalDecided
    | ValueRecorded
    | EnvironmentSet
    | PlanUpdated
    | PlanNodeCompleted
    | BudgetExceeded
    | TaskForked
    | GraphCheckpointSaved
    | GraphWritesSaved
    | GraphCheckpointsRemoved
    | PatchMarked
    | RunInterrupted
    | HookFailed
)

EVENT_TYPES: Final[dict[str, type[Event]]] = {
    cls.__struct_config__.tag: cls
    for cls in AnyEvent.__args__
}
"""The closed vocabulary: tag -> class. Decoding never looks anywhere else."""


def event_type(event: Event) -> str:
    """The tag stored in the row's ``type`` column."""
    tag = event.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def target_status(event_type_name: str) -> Status | None:
    """The status an event of this type moves a task to, or None for observations."""
    cls = EVENT_TYPES.get(event_type_name)
    if cls is None:
        raise UnknownEventType(event_type_name)
    return cls.TARGET_STATUS


_SCALAR_TYPES: Final = (msgspec.inspect.StrType, msgspec.inspect.IntType,
                        msgspec.inspect.BoolType, msgspec.inspect.FloatType,
                        msgspec.inspect.NoneType)


def _scalar(kind: msgspec.inspect.Type) -> bool:
    if isinstance(kind, msgspec.inspect.UnionType):
        return all(_scalar(member) for member in kind.types)
    return isinstance(kind, _SCALAR_TYPES)


def _compound_fields(cls: type[Event]) -> tuple[str, ...]:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(field.name for field in info.fields if not _scalar(field.type))


_COMPOUND_FIELDS: Final[dict[type[Event], tuple[str, ...]]] = {
    cls: _compound_fields(cls) for cls in EVENT_TYPES.values()
}
"""Per event type, the fields that may hold a struct or a user value (the others are
declared str, int, bool, float or None, and need no conversion)."""


def encode_event(event: Event, *, payload_bytes_max: int | None = None) -> tuple[str, int, bytes]:
    """Return ``(type, version, payload bytes)`` for storage; raises InvalidPayload."""
    fields = msgspec.structs.asdict(event)
    for name in _COMPOUND_FIELDS[type(event)]:
        fields[name] = _plain(fields[name])
    if payload_bytes_max is None:
        encoded = payloads.encode_payload(fields)
    else:
        encoded = payloads.encode_payload(fields, payload_bytes_max=payload_bytes_max)
    return event_type(event), type(event).VERSION, encoded


def _plain(value: Any) -> Any:
    """Turn the vocabulary's own structs into dicts; leave user values as given.

    User values are not passed through ``msgspec.to_builtins``, which would quietly turn a
    set into a list or a datetime into a string: they must already be plain JSON, and
    :func:`wal_engine.payloads.encode_payload` refuses them otherwise.
    """
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    if type(value) is list and value and isinstance(value[0], msgspec.Struct):
        return msgspec.to_builtins(value)
    return value


def decode_event(
    event_type_name: str, version: int, payload: bytes | dict[str, Any], seq: int | None = None
) -> Event:
    """Decode a stored row into its event; fails closed on an unknown type or version.

    ``payload`` is the stored bytes, or an already-upcast dict of plain values.
    """
    cls = EVENT_TYPES.get(event_type_name)
    if cls is None:
        raise UnknownEventType(event_type_name, seq)
    if version != cls.VERSION:
        raise UnknownEventVersion(event_type_name, version, cls.VERSION, seq)
    try:
        if isinstance(payload, dict):
            return msgspec.convert(payload, cls)
        return msgspec.json.decode(payload, type=cls)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise UndecodableEvent(event_type_name, seq, str(error)) from error
