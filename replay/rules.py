"""The fold's rule for each event type: the statuses it may be folded in, and what it does.

Every handler is registered with :func:`_on` in ``_rules``, which :mod:`replay.fold`
dispatches on; :func:`rule_gaps` (kept empty by a test) lists the event types without one.
The handlers mutate a :class:`_Draft`, the private mutable twin of the state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from replay.state import (
    CHILD_VALUE_PREFIX,
    Approval,
    BudgetTrip,
    CallError,
    CallKind,
    CallRecord,
    CallStatus,
    ChildSpend,
    Failure,
    Wait,
    _StateFields,
    args_hash,
)
from wal_engine import events as ev
from wal_engine.errors import ReplayError
from wal_engine.state_machine import LEASED, TERMINAL, Status, is_legal

replace = msgspec.structs.replace


class _Draft(_StateFields):
    """The mutable twin of :class:`AgentState` that the fold works on (never escapes)."""


# ----------------------------------------------------------------------------- the registry

_Handler = Callable[[_Draft, Any, int], None]
_Rule = tuple[_Handler, frozenset[Status | None], Status | None]
_rules: dict[type[ev.Event], _Rule] = {}

_non_terminal: Final[frozenset[Status | None]] = frozenset(
    status for status in Status if status not in TERMINAL
)
_running: Final[frozenset[Status | None]] = frozenset({Status.RUNNING})
_leased: Final[frozenset[Status | None]] = frozenset(LEASED)

_E = TypeVar("_E", bound=ev.Event)


def _on(
    cls: type[_E], sources: frozenset[Status | None] | None = None
) -> Callable[[Callable[[_Draft, _E, int], None]], Callable[[_Draft, _E, int], None]]:
    """Register the handler of ``cls`` and the statuses it may be folded in.

    For a transition, the statuses are those the state machine allows a move from
    (narrowed by ``sources``); for an observation, RUNNING unless ``sources`` says otherwise.
    """
    target = cls.TARGET_STATUS
    if target is None:
        allowed = _running if sources is None else sources
    else:
        legal: frozenset[Status | None] = frozenset(s for s in Status if is_legal(s, target))
        if target is Status.QUEUED:
            legal = frozenset({None})  # Only the first event makes a task QUEUED.
        allowed = legal if sources is None else legal & sources

    def register(handler: Callable[[_Draft, _E, int], None]) -> Callable[[_Draft, _E, int], None]:
        _rules[cls] = (handler, allowed, target)
        return handler

    return register


# ----------------------------------------------------------------------------- transitions


@_on(ev.TaskSubmitted, frozenset({None}))
def _submitted(d: _Draft, e: ev.TaskSubmitted, seq: int) -> None:
    if seq != 1:
        raise ReplayError(seq, "task_submitted must be seq 1", d.task_id)
    d.agent = e.agent
    d.input = e.input
    d.budget = e.budget
    d.parent_task_id = e.parent_task_id
    d.parent_seq = e.parent_seq
    d.agent_version = e.agent_version


def _claim(d: _Draft, attempt: int, seq: int) -> None:
    if attempt <= d.attempts:
        raise ReplayError(seq, f"attempt {attempt} does not follow attempt {d.attempts}",
                          d.task_id)
    d.attempts = attempt


@_on(ev.TaskClaimed, frozenset({Status.QUEUED}))
def _claimed(d: _Draft, e: ev.TaskClaimed, seq: int) -> None:
    _claim(d, e.attempt, seq)
    if d.agent_version is None:
        d.agent_version = e.agent_version


@_on(ev.TaskResumed, frozenset({Status.RESUMING}))
def _resumed(d: _Draft, e: ev.TaskResumed, seq: int) -> None:
    _claim(d, e.attempt, seq)
    if d.agent_version is None:
        d.agent_version = e.agent_version


@_on(ev.StepStarted, frozenset({Status.CHECKPOINTED}))
def _step_started(d: _Draft, e: ev.StepStarted, seq: int) -> None:
    if e.step < d.step:
        raise ReplayError(seq, f"step {e.step} started after step {d.step}", d.task_id)
    d.step = e.step


@_on(ev.StepCheckpointed)
def _checkpointed(d: _Draft, e: ev.StepCheckpointed, seq: int) -> None:
    d.commands["step_checkpointed"] = d.commands.get("step_checkpointed", 0) + 1
    if e.step < d.step:
        raise ReplayError(seq, f"step {e.step} checkpointed after step {d.step}", d.task_id)
    d.step = e.step
    d.next_action = e.next_action


@_on(ev.TimerStarted, _leased)
def _timer_started(d: _Draft, e: ev.TimerStarted, seq: int) -> None:
    record = d.calls.get(e.timer_id)
    if record is None:
        d.calls[e.timer_id] = CallRecord(
            call_id=e.timer_id, kind=CallKind.TIMER, name="sleep",
            args_hash=args_hash(e.duration_ms), seq=seq, due_at_ms=e.wake_at_ms,
        )
    elif record.kind is CallKind.TIMER and record.status is CallStatus.PENDING:
        # Sleeping again on a timer that has not fired (after a fork or a hand-off).
        d.calls[e.timer_id] = replace(record, due_at_ms=e.wake_at_ms)
    else:
        raise ReplayError(seq, f"timer id {e.timer_id!r} is already taken", d.task_id)
    d.waiting_on = Wait(call_id=e.timer_id, timer_id=e.timer_id, wake_at_ms=e.wake_at_ms)


@_on(ev.SignalAwaited, _leased)
def _signal_awaited(d: _Draft, e: ev.SignalAwaited, seq: int) -> None:
    current = d.waiting_on
    if current is not None and current.signal == e.name:
        # Waiting again for the same signal (woken, nothing delivered): the same entry.
        d.waiting_on = replace(current, timeout_ms=e.timeout_ms)
        return
    call_id = f"signal@{seq}"
    d.calls[call_id] = CallRecord(call_id=call_id, kind=CallKind.SIGNAL, name=e.name, seq=seq)
    d.waiting_on = Wait(call_id=call_id, signal=e.name, timeout_ms=e.timeout_ms)


@_on(ev.TaskWoken, frozenset({Status.WAITING}))
def _woken(d: _Draft, e: ev.TaskWoken, seq: int) -> None:
    wait = d.waiting_on
    if e.reason == "timeout" and wait is not None and wait.signal is not None:
        record = d.calls[wait.call_id]
        d.calls[wait.call_id] = replace(
            record, status=CallStatus.FAILED, outcome_seq=seq,
            error=CallError(error=f"no signal {wait.signal!r} before the timeout",
                            error_type="SignalTimeout"),
        )
        d.waiting_on = None
    d.handed_over = "woken"


@_on(ev.TaskOrphaned, _leased)
def _orphaned(d: _Draft, e: ev.TaskOrphaned, seq: int) -> None:
    """The next claim bumps the attempt."""
    d.handed_over = "orphaned"


@_on(ev.TaskReleased, _leased)
def _released(d: _Draft, e: ev.TaskReleased, seq: int) -> None:
    d.handed_over = "released"


@_on(ev.PatchMarked, _leased)
def _patch_marked(d: _Draft, e: ev.PatchMarked, seq: int) -> None:
    if e.change_id in d.patches:
        raise ReplayError(seq, f"patch {e.change_id!r} is already marked", d.task_id)
    d.patches.append(e.change_id)


@_on(ev.RunInterrupted, _leased)
def _run_interrupted(d: _Draft, e: ev.RunInterrupted, seq: int) -> None:
    d.interruptions += 1


@_on(ev.HookFailed, _leased)
def _hook_failed(d: _Draft, e: ev.HookFailed, seq: int) -> None:
    """Recorded for audit: a hook's failure changes nothing the agent sees."""


@_on(ev.TaskCompleted)
def _completed(d: _Draft, e: ev.TaskCompleted, seq: int) -> None:
    d.output = e.output


@_on(ev.TaskFailed)
def _failed(d: _Draft, e: ev.TaskFailed, seq: int) -> None:
    d.failure = Failure(reason=e.reason, error=e.error, diagnostic=e.diagnostic, seq=seq)


@_on(ev.TaskCancelled)
def _cancelled(d: _Draft, e: ev.TaskCancelled, seq: int) -> None:
    d.failure = Failure(reason=e.reason, cancelled=True, requested_by=e.requested_by, seq=seq)


# ----------------------------------------------------------------------------- external calls


def _intend(
    d: _Draft, seq: int, call_id: str, kind: CallKind, name: str, hash_hex: str,
    key: str, idempotent: bool, attempt: int,
) -> None:
    record = d.calls.get(call_id)
    if record is None:
        if attempt != 1:
            raise ReplayError(seq, f"call {call_id!r} starts at attempt {attempt}", d.task_id)
        d.calls[call_id] = CallRecord(
            call_id=call_id, kind=kind, name=name, args_hash=hash_hex, seq=seq,
            idempotency_key=key, idempotent=idempotent,
        )
    else:
        _check_retry(d, seq, record, kind, name, hash_hex, attempt)
        d.calls[call_id] = replace(
            record, status=CallStatus.PENDING, attempt=attempt, retry_seq=seq,
            idempotency_key=key, error=None, outcome_seq=None, due_at_ms=None,
        )
    d.pending[call_id] = seq


def _check_retry(
    d: _Draft, seq: int, record: CallRecord, kind: CallKind, name: str, hash_hex: str,
    attempt: int,
) -> None:
    if record.status is not CallStatus.RETRYING:
        raise ReplayError(seq, f"call id {record.call_id!r} is already taken "
                               f"({record.kind} {record.name!r}, {record.status})", d.task_id)
    if (record.kind, record.name, record.args_hash) != (kind, name, hash_hex):
        raise ReplayError(seq, f"retry of call {record.call_id!r} changes the call", d.task_id)
    if attempt != record.attempt + 1:
        raise ReplayError(seq, f"call {record.call_id!r}: attempt {attempt} after attempt "
                               f"{record.attempt}", d.task_id)


def _open_call(d: _Draft, seq: int, call_id: str, kind: CallKind, what: str) -> CallRecord:
    """The call an outcome event refers to; it must be in flight."""
    record = d.calls.get(call_id)
    if record is None or record.kind is not kind:
        raise ReplayError(seq, f"{what} for {kind} call {call_id!r}, which was never intended",
                          d.task_id)
    if record.status is not CallStatus.PENDING and record.status is not CallStatus.UNCERTAIN:
        raise ReplayError(seq, f"{what} for call {call_id!r}, which is {record.status}",
                          d.task_id)
    return record


def _settle(
    d: _Draft, seq: int, record: CallRecord, attempt: int, error: str, error_type: str,
    retryable: bool, retry_at_ms: int | None,
) -> None:
    if attempt != record.attempt:
        raise ReplayError(seq, f"failure of attempt {attempt} of call {record.call_id!r}, "
                               f"which is at attempt {record.attempt}", d.task_id)
    retrying = retryable and retry_at_ms is not None
    d.calls[record.call_id] = replace(
        record, status=CallStatus.RETRYING if retrying else CallStatus.FAILED, outcome_seq=seq,
        error=CallError(error=error, error_type=error_type, retryable=retryable),
        due_at_ms=retry_at_ms if retrying else None,
    )
    d.pending.pop(record.call_id, None)


@_on(ev.ToolCallIntended)
def _tool_intended(d: _Draft, e: ev.ToolCallIntended, seq: int) -> None:
    if d.approvals:
        _check_approved(d, seq, e)
    _intend(d, seq, e.call_id, CallKind.TOOL, e.tool, e.args_hash, e.idempotency_key,
            e.idempotent, e.attempt)
    d.usage = replace(d.usage, tool_calls=d.usage.tool_calls + 1)


def _check_approved(d: _Draft, seq: int, e: ev.ToolCallIntended) -> None:
    approval = d.approvals.get(e.call_id)
    if approval is None:
        return
    if approval.approved is not True:
        state = "refused" if approval.approved is False else "not decided"
        raise ReplayError(seq, f"tool call {e.call_id!r} needs an approval ({state})", d.task_id)
    if (approval.tool, approval.args_hash) != (e.tool, e.args_hash):
        raise ReplayError(seq, f"tool call {e.call_id!r} differs from the approved call",
                          d.task_id)


@_on(ev.ToolCallCompleted)
def _tool_completed(d: _Draft, e: ev.ToolCallCompleted, seq: int) -> None:
    record = _open_call(d, seq, e.call_id, CallKind.TOOL, "a result")
    d.calls[e.call_id] = replace(record, status=CallStatus.COMPLETED, result=e.result,
                                 outcome_seq=seq)
    d.pending.pop(e.call_id, None)


@_on(ev.ToolCallFailed)
def _tool_failed(d: _Draft, e: ev.ToolCallFailed, seq: int) -> None:
    record = _open_call(d, seq, e.call_id, CallKind.TOOL, "a failure")
    _settle(d, seq, record, e.attempt, e.error, e.error_type, e.retryable, e.retry_at_ms)


@_on(ev.ToolCallUncertain)
def _tool_uncertain(d: _Draft, e: ev.ToolCallUncertain, seq: int) -> None:
    record = _open_call(d, seq, e.call_id, CallKind.TOOL, "an escalation")
    if record.status is not CallStatus.PENDING:
        raise ReplayError(seq, f"call {e.call_id!r} is already escalated", d.task_id)
    error = record.error if e.error_type is None else CallError(
        error=e.error or "", error_type=e.error_type)
    d.calls[e.call_id] = replace(record, status=CallStatus.UNCERTAIN, outcome_seq=seq,
                                 error=error)
    d.pending.pop(e.call_id, None)


@_on(ev.LlmCallIntended)
def _llm_intended(d: _Draft, e: ev.LlmCallIntended, seq: int) -> None:
    _intend(d, seq, e.call_id, CallKind.LLM, e.model, e.request_hash, e.idempotency_key,
            True, e.attempt)
    d.usage = replace(d.usage, llm_calls=d.usage.llm_calls + 1)


@_on(ev.LlmCallCompleted)
def _llm_completed(d: _Draft, e: ev.LlmCallCompleted, seq: int) -> None:
    record = _open_call(d, seq, e.call_id, CallKind.LLM, "a response")
    d.calls[e.call_id] = replace(record, status=CallStatus.COMPLETED, result=e.response,
                                 outcome_seq=seq)
    d.pending.pop(e.call_id, None)
    usage = d.usage
    d.usage = replace(
        usage, input_tokens=usage.input_tokens + e.input_tokens,
        output_tokens=usage.output_tokens + e.output_tokens,
        cost_usd=usage.cost_usd + e.cost_usd,
    )


@_on(ev.LlmCallFailed)
def _llm_failed(d: _Draft, e: ev.LlmCallFailed, seq: int) -> None:
    record = _open_call(d, seq, e.call_id, CallKind.LLM, "a failure")
    _settle(d, seq, record, e.attempt, e.error, e.error_type, e.retryable, e.retry_at_ms)


@_on(ev.ValueRecorded)
def _value(d: _Draft, e: ev.ValueRecorded, seq: int) -> None:
    if e.call_id in d.calls:
        raise ReplayError(seq, f"call id {e.call_id!r} is already taken", d.task_id)
    d.calls[e.call_id] = CallRecord(
        call_id=e.call_id, kind=CallKind.VALUE, name=e.kind, seq=seq,
        status=CallStatus.COMPLETED, result=e.value, outcome_seq=seq,
    )
    if e.kind.startswith(CHILD_VALUE_PREFIX) and isinstance(e.value, dict) \
            and "charge" in e.value:
        # A child spawned with the budget policy "share": its spend, as read from its log
        # when its outcome was recorded, counts against this task's budget, once (the
        # value is recorded once; a re-run answers from it).
        try:
            charge = msgspec.convert(e.value["charge"], ChildSpend)
        except msgspec.ValidationError as error:
            raise ReplayError(seq, f"child outcome {e.call_id!r} has a bad charge: {error}",
                              d.task_id) from error
        d.children_spend = d.children_spend.plus(charge)


@_on(ev.TimerFired)
def _timer_fired(d: _Draft, e: ev.TimerFired, seq: int) -> None:
    record = _open_call(d, seq, e.timer_id, CallKind.TIMER, "a firing")
    d.calls[e.timer_id] = replace(record, status=CallStatus.COMPLETED, outcome_seq=seq)
    if d.waiting_on is not None and d.waiting_on.call_id == e.timer_id:
        d.waiting_on = None


@_on(ev.SignalReceived)
def _signal_received(d: _Draft, e: ev.SignalReceived, seq: int) -> None:
    if e.signal_id in d.signal_ids:
        raise ReplayError(seq, f"signal {e.signal_id} was already consumed", d.task_id)
    d.signal_ids.append(e.signal_id)
    wait = d.waiting_on
    if wait is not None and wait.signal == e.name:
        record = d.calls[wait.call_id]
        d.waiting_on = None
    else:
        # Delivered without a recorded wait (it was already in the inbox when asked for).
        call_id = f"signal#{e.signal_id}"
        record = CallRecord(call_id=call_id, kind=CallKind.SIGNAL, name=e.name, seq=seq)
    d.calls[record.call_id] = replace(record, status=CallStatus.COMPLETED, result=e.payload,
                                      outcome_seq=seq)


# ----------------------------------------------------------------------------- other observations


@_on(ev.MessageAppended)
def _message(d: _Draft, e: ev.MessageAppended, seq: int) -> None:
    d.commands["message_appended"] = d.commands.get("message_appended", 0) + 1
    d.messages.append(e)


@_on(ev.ApprovalRequested)
def _approval_requested(d: _Draft, e: ev.ApprovalRequested, seq: int) -> None:
    if e.call_id in d.approvals or e.call_id in d.calls:
        raise ReplayError(seq, f"approval requested for call {e.call_id!r}, which exists",
                          d.task_id)
    d.approvals[e.call_id] = Approval(
        tool=e.tool, args_hash=e.args_hash, signal_name=e.signal_name, requested_seq=seq
    )


@_on(ev.ApprovalDecided)
def _approval_decided(d: _Draft, e: ev.ApprovalDecided, seq: int) -> None:
    approval = d.approvals.get(e.call_id)
    if approval is None or approval.approved is not None:
        state = "never requested" if approval is None else "already decided"
        raise ReplayError(seq, f"decision on call {e.call_id!r}, {state}", d.task_id)
    if approval.args_hash != e.args_hash:
        raise ReplayError(seq, f"decision on call {e.call_id!r} for other arguments", d.task_id)
    d.approvals[e.call_id] = replace(
        approval, approved=e.approved, approver=e.approver, comment=e.comment, decided_seq=seq
    )


@_on(ev.EnvironmentSet)
def _environment(d: _Draft, e: ev.EnvironmentSet, seq: int) -> None:
    d.commands["environment_set"] = d.commands.get("environment_set", 0) + 1
    for name, value in e.values.items():
        if value is None:
            d.env.pop(name, None)
        else:
            d.env[name] = value


@_on(ev.PlanUpdated)
def _plan_updated(d: _Draft, e: ev.PlanUpdated, seq: int) -> None:
    d.commands["plan_updated"] = d.commands.get("plan_updated", 0) + 1
    plan = {node.node_id: node for node in e.nodes}
    if len(plan) != len(e.nodes):
        raise ReplayError(seq, "plan repeats a node id", d.task_id)
    done = set(d.plan_completed)
    for node in e.nodes:
        for dependency in node.depends_on:
            if dependency not in plan and dependency not in done:
                raise ReplayError(seq, f"plan node {node.node_id!r} depends on unknown "
                                       f"node {dependency!r}", d.task_id)
    cycle = _find_cycle(plan)
    if cycle is not None:
        raise ReplayError(seq, f"plan has a cycle through node {cycle!r}", d.task_id)
    d.plan = plan


def _find_cycle(plan: dict[str, ev.PlanNode]) -> str | None:
    """A node on a cycle of the plan's dependencies, or None (Kahn's algorithm)."""
    blocking = {node_id: sum(dep in plan for dep in node.depends_on)
                for node_id, node in plan.items()}
    dependents: dict[str, list[str]] = {node_id: [] for node_id in plan}
    for node_id, node in plan.items():
        for dependency in node.depends_on:
            if dependency in plan:
                dependents[dependency].append(node_id)
    ready = [node_id for node_id, count in blocking.items() if count == 0]
    while ready:
        for dependent in dependents[ready.pop()]:
            blocking[dependent] -= 1
            if blocking[dependent] == 0:
                ready.append(dependent)
    return next((node_id for node_id, count in blocking.items() if count > 0), None)


@_on(ev.PlanNodeCompleted)
def _plan_node_completed(d: _Draft, e: ev.PlanNodeCompleted, seq: int) -> None:
    d.commands["plan_node_completed"] = d.commands.get("plan_node_completed", 0) + 1
    node = d.plan.get(e.node_id)
    if node is None or e.node_id in d.plan_completed:
        state = "not in the plan" if node is None else "already completed"
        raise ReplayError(seq, f"plan node {e.node_id!r} is {state}", d.task_id)
    waiting = [dep for dep in node.depends_on if dep not in d.plan_completed]
    if waiting:
        raise ReplayError(seq, f"plan node {e.node_id!r} completed before {waiting[0]!r}",
                          d.task_id)
    d.plan_completed.append(e.node_id)


@_on(ev.BudgetExceeded, _non_terminal)
def _budget_exceeded(d: _Draft, e: ev.BudgetExceeded, seq: int) -> None:
    d.budget_exceeded = BudgetTrip(budget=e.budget, limit=e.limit, used=e.used, seq=seq)


@_on(ev.TaskForked, _non_terminal)
def _forked(d: _Draft, e: ev.TaskForked, seq: int) -> None:
    d.parent_task_id = e.parent_task_id
    d.parent_seq = e.parent_seq
    # A fork runs on the code that claims it (the way onto new code after a divergence):
    # its first claim pins that code's version, as for a submission without one.
    d.agent_version = None


# ----------------------------------------------------------------------------- LangGraph threads


def _opaque(d: _Draft, e: ev.Event, seq: int) -> None:
    """Graph checkpoints are read by the LangGraph integration; the task state only counts
    them in ``last_seq``."""


for _graph_event in (ev.GraphCheckpointSaved, ev.GraphWritesSaved, ev.GraphCheckpointsRemoved):
    _on(_graph_event, _non_terminal)(_opaque)


def rule_gaps() -> set[str]:
    """Event types of the vocabulary that have no fold rule (a test keeps this empty)."""
    return {tag for tag, cls in ev.EVENT_TYPES.items() if cls not in _rules}
