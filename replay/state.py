"""``AgentState``: everything a worker needs to continue a task, folded from its log (pure).

The state is what the seeds call the checkpoint content: the full message history, the step
index, every external call with its recorded outcome, the calls in doubt, the next planned
action, the token and cost usage, what the task waits on, the attempts, the last seq and
hash, the plan DAG and the task's own environment variables.

``AgentState`` is frozen. Its containers are plain lists and dicts so that a snapshot
decodes fast; the fold never mutates the containers of a state it was given (it copies
them once into a private draft), and callers must not mutate them either.

Every external call is one :class:`CallRecord` in ``calls``, keyed by call id and ordered
by first intent (dicts keep insertion order, and so do msgpack snapshots). The journal
cursor (:mod:`replay.journal`) walks them in that order. A call's result lives only in its
record, so a snapshot holds each result once; ``tool_results`` and ``llm_results`` are
views over ``calls``.
"""

from __future__ import annotations

import enum
import hashlib
from typing import Annotated, Any, Final

import msgspec

from wal_engine import budgets
from wal_engine.events import Budget, MessageAppended, PlanNode
from wal_engine.payloads import encode_payload
from wal_engine.state_machine import TERMINAL, Status


class CallKind(enum.StrEnum):
    """What kind of non-deterministic input an entry of the journal stands for."""

    TOOL = "tool"
    LLM = "llm"
    VALUE = "value"
    """A journaled clock reading or random number (``value_recorded``)."""
    TIMER = "timer"
    """A durable sleep (``timer_started`` ... ``timer_fired``)."""
    SIGNAL = "signal"
    """A wait for a named signal (``signal_awaited`` ... ``signal_received``)."""


class CallStatus(enum.StrEnum):
    """Where an external call stands in the log."""

    PENDING = "pending"
    """Intended (or started), no outcome recorded: in doubt after a crash."""
    COMPLETED = "completed"
    FAILED = "failed"
    """Failed for good: no further attempt follows."""
    RETRYING = "retrying"
    """The latest attempt failed and another one is scheduled at ``due_at_ms``."""
    UNCERTAIN = "uncertain"
    """A non-idempotent call in doubt, escalated: it must not be re-run blindly."""


OPEN_CALL_STATUSES = frozenset({CallStatus.PENDING, CallStatus.RETRYING, CallStatus.UNCERTAIN})
"""Statuses of calls that still wait for an outcome."""


class CallError(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The recorded failure of a call's latest attempt."""

    error: str
    error_type: str
    retryable: bool = False


class CallRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """One external call as the log recorded it; replaced (never mutated) when it moves."""

    call_id: str
    kind: CallKind
    name: str
    """The tool, the model, the value kind (``now``, ``random``), ``sleep``, or the signal."""
    args_hash: str = ""
    """sha256 hex of the canonical arguments (``replay.journal.args_hash``), or ``""``."""
    seq: int
    """Seq of the first intent (or of the event that started the wait): the call's place."""
    status: CallStatus = CallStatus.PENDING
    idempotency_key: str | None = None
    idempotent: bool = True
    attempt: int = 1
    result: Any = None
    error: CallError | None = None
    retry_seq: int | None = None
    """Seq of the latest attempt's intent when it is not the first (a retry)."""
    outcome_seq: int | None = None
    """Seq of the event that recorded the outcome of the latest attempt."""
    due_at_ms: int | None = None
    """When a retrying call's next attempt is due, or when a timer fires."""


class Usage(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """What the task has consumed so far (the budget's arithmetic reads this)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    tool_calls: int = 0
    """Tool intents recorded, retries included (each may have acted)."""
    llm_calls: int = 0
    """LLM intents recorded, retries included."""


CHILD_VALUE_PREFIX: Final = "child:"
"""The journal name (``value_recorded`` kind) of a child's outcome as its parent recorded
it (then the child's id); see :mod:`wal_engine.runtime.children`."""


class ChildSpend(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """Spend counted against a budget: a child's, charged to its parent under the budget
    policy ``share`` (the ``charge`` of the child's recorded outcome), and the total the
    parent has been charged so far. Names as in :class:`wal_engine.budgets.Usage`."""

    steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    cost_usd: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    tool_calls: Annotated[int, msgspec.Meta(ge=0)] = 0

    def plus(self, other: ChildSpend) -> ChildSpend:
        """The sum of both."""
        return ChildSpend(steps=self.steps + other.steps, tokens=self.tokens + other.tokens,
                          cost_usd=self.cost_usd + other.cost_usd,
                          tool_calls=self.tool_calls + other.tool_calls)


class Wait(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """What the task waits for: a timer, or a signal (optionally with a timeout).

    Set when the wait starts and cleared when its outcome is folded (``timer_fired``,
    ``signal_received``, or a wake-up for a timeout), so a task woken but not yet told why
    still shows the wait it is coming back from.
    """

    call_id: str
    """The journal entry of the wait (see ``AgentState.calls``)."""
    timer_id: str | None = None
    wake_at_ms: int | None = None
    signal: str | None = None
    timeout_ms: int | None = None


class Approval(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """A human approval of one exact planned call, and its decision once made."""

    tool: str
    args_hash: str
    signal_name: str
    requested_seq: int
    approved: bool | None = None
    approver: str | None = None
    comment: str | None = None
    decided_seq: int | None = None


class Failure(msgspec.Struct, frozen=True, kw_only=True, gc=False, omit_defaults=True):
    """Why a task failed (``task_failed``) or was cancelled (``task_cancelled``)."""

    reason: str
    error: str | None = None
    diagnostic: Any = None
    cancelled: bool = False
    requested_by: str | None = None
    seq: int


class BudgetTrip(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The budget that tripped, its limit and what was used."""

    budget: str
    limit: float
    used: float
    seq: int


class _StateFields(msgspec.Struct, kw_only=True):
    """The fields of a task's state, shared by the frozen state and the fold's draft."""

    task_id: str
    agent: str = ""
    status: Status | None = None
    """None before ``task_submitted`` (seq 1) is folded."""
    input: Any = None
    budget: Budget = Budget()
    parent_task_id: str | None = None
    parent_seq: int | None = None
    """Set on a fork: this task continues ``parent_task_id``'s history up to ``parent_seq``."""
    messages: list[MessageAppended] = []
    step: int = 0
    """Index of the latest step started or checkpointed (never decreases; the runtime
    chooses whether a step keeps its checkpoint's index or takes the next one)."""
    next_action: Any = None
    calls: dict[str, CallRecord] = {}
    """Every external call by call id, in the order of first intent."""
    pending: dict[str, int] = {}
    """Calls in doubt (intended, no outcome): call id -> seq of the intent."""
    usage: Usage = Usage()
    children_spend: ChildSpend = ChildSpend()
    """What the task's children spawned with the budget policy ``share`` spent, charged
    when each one's outcome was recorded (their own ``usage`` is theirs, not counted here
    in ``usage``); the budget counts it with the task's own (:func:`budget_usage`)."""
    waiting_on: Wait | None = None
    attempts: int = 0
    last_seq: int = 0
    last_hash: bytes = b""
    """Chain hash of ``last_seq``; empty when the events were folded without hashes."""
    plan: dict[str, PlanNode] = {}
    plan_completed: list[str] = []
    env: dict[str, str] = {}
    signal_ids: list[int] = []
    """Inbox signals consumed, in order (never delivered twice)."""
    approvals: dict[str, Approval] = {}
    commands: dict[str, int] = {}
    """How many agent commands of each non-call kind were recorded (``message_appended``,
    ``step_checkpointed``, ``environment_set``, ``plan_updated``, ``plan_node_completed``):
    a re-run of the agent code matches its k-th command of a kind against these."""
    output: Any = None
    failure: Failure | None = None
    budget_exceeded: BudgetTrip | None = None
    agent_version: str | None = None
    """The version of the agent code that started the task (``task_submitted``, else the
    first claim)."""
    patches: list[str] = []
    """Change ids of ``ctx.patched`` markers recorded, in order."""
    handed_over: str | None = None
    """Why the task last became RESUMING (``orphaned``, ``released``, ``woken``), None
    before it ever did: the recovery hooks' ``reason``."""
    interruptions: int = 0
    """Runs that lost their connection and went on in place (``run_interrupted``)."""


# msgspec allows a frozen struct to inherit fields from a mutable one; mypy's dataclass
# rules do not know that, and sharing one field list is what keeps the draft in step.
class AgentState(_StateFields, frozen=True):  # type: ignore[misc]
    """The state of one task at ``last_seq``; equal logs fold to equal (and byte-equal) states."""

    @property
    def terminal(self) -> bool:
        """Whether the task is COMPLETED or FAILED."""
        return self.status in TERMINAL

    @property
    def tool_results(self) -> dict[str, Any]:
        """Recorded tool results by call id."""
        return _results(self.calls, CallKind.TOOL)

    @property
    def llm_results(self) -> dict[str, Any]:
        """Recorded LLM responses by call id."""
        return _results(self.calls, CallKind.LLM)

    @property
    def in_doubt(self) -> list[CallRecord]:
        """Calls intended without an outcome, in intent order (retry with the same key)."""
        return [self.calls[call_id] for call_id in self.pending]


def _results(calls: dict[str, CallRecord], kind: CallKind) -> dict[str, Any]:
    return {
        call_id: record.result
        for call_id, record in calls.items()
        if record.kind is kind and record.status is CallStatus.COMPLETED
    }


def args_hash(value: Any) -> str:
    """Stable hash of a call's arguments: sha256 hex of their canonical JSON encoding.

    Equal plain values hash equal whatever the order of their keys; a value that could not
    be stored in the log raises :class:`~wal_engine.errors.InvalidPayload`.
    """
    return hashlib.sha256(encode_payload(value)).hexdigest()


def budget_usage(state: _StateFields, *, runtime_s: float = 0.0) -> budgets.Usage:
    """What the budget arithmetic (:func:`wal_engine.budgets.first_trip`) counts as used in
    ``state``: steps are the step index, tokens input plus output, each plus what the
    task's ``share`` children were charged for. ``runtime_s`` is not in the log (it is
    measured on the database clock), so the caller gives it."""
    spend = total_spend(state)
    return budgets.Usage(
        steps=spend.steps, tokens=spend.tokens, runtime_s=runtime_s, cost_usd=spend.cost_usd,
        tool_calls=spend.tool_calls, attempts=state.attempts,
    )


def total_spend(state: _StateFields) -> ChildSpend:
    """The task's own spend and its ``share`` children's: what it charges its own parent
    when that parent records its outcome under ``share``."""
    usage = state.usage
    return state.children_spend.plus(ChildSpend(
        steps=state.step, tokens=usage.input_tokens + usage.output_tokens,
        cost_usd=usage.cost_usd, tool_calls=usage.tool_calls))


def initial_state(task_id: str) -> AgentState:
    """The state before seq 1: no status, nothing folded."""
    return AgentState(task_id=task_id)
