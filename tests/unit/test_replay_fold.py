"""The fold: what each event does to the state, and every impossible event it refuses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from replay import AgentState, CallKind, CallStatus, StateBuilder, apply, fold
from replay.fold import rule_gaps
from replay.state import args_hash
from wal_engine import events as ev
from wal_engine.errors import CorruptionError, ReplayError
from wal_engine.state_machine import Status

SUBMITTED = ev.TaskSubmitted(agent="agent", input={"q": 1}, budget=ev.Budget(max_steps=5))
CLAIMED = ev.TaskClaimed(worker_id="w1", attempt=1)


def numbered(*events: ev.Event) -> list[tuple[int, ev.Event]]:
    """Number events from seq 1."""
    return list(enumerate(events, start=1))


def running(*events: ev.Event) -> AgentState:
    """Fold a submitted, claimed task followed by ``events``."""
    return fold(numbered(SUBMITTED, CLAIMED, *events), task_id="t1")


def tool_intent(call_id: str = "c1", tool: str = "search", args: Any = None,
                **fields: Any) -> ev.ToolCallIntended:
    """A tool intent with a consistent args hash."""
    return ev.ToolCallIntended(call_id=call_id, tool=tool, args=args, args_hash=args_hash(args),
                               idempotency_key=f"idem:t1:{call_id}", **fields)


def refused(*events: ev.Event) -> ReplayError:
    """The ReplayError raised by folding a claimed task followed by ``events``."""
    with pytest.raises(ReplayError) as caught:
        running(*events)
    return caught.value


def test_every_event_type_has_a_fold_rule() -> None:
    """The fold is total: no event type of the vocabulary lacks a rule."""
    assert rule_gaps() == set()


def test_submission_and_claim_set_identity_status_and_attempts() -> None:
    """task_submitted and task_claimed fill in agent, input, budget, status and attempt."""
    state = running()
    assert (state.task_id, state.agent, state.input) == ("t1", "agent", {"q": 1})
    assert state.budget.max_steps == 5
    assert (state.status, state.attempts, state.last_seq) == (Status.RUNNING, 1, 2)


def test_empty_fold_is_the_initial_state() -> None:
    """Folding nothing gives the state before seq 1."""
    state = fold([], task_id="t1")
    assert state.status is None and state.last_seq == 0 and state.task_id == "t1"


def test_tool_call_lifecycle_records_result_and_usage() -> None:
    """An intent makes a pending call; its result completes it and leaves the in-doubt set."""
    intended = running(tool_intent(args={"q": "x"}))
    assert intended.pending == {"c1": 3}
    assert [r.call_id for r in intended.in_doubt] == ["c1"]
    done = running(tool_intent(args={"q": "x"}), ev.ToolCallCompleted(call_id="c1", result=[1]))
    record = done.calls["c1"]
    assert (record.kind, record.status, record.result, record.seq, record.outcome_seq) == (
        CallKind.TOOL, CallStatus.COMPLETED, [1], 3, 4)
    assert done.pending == {} and done.tool_results == {"c1": [1]}
    assert done.usage.tool_calls == 1


def test_llm_call_accumulates_tokens_and_cost() -> None:
    """LLM responses are journaled with their token usage and cost."""
    state = running(
        ev.LlmCallIntended(call_id="l1", model="m", request_hash="h", idempotency_key="k"),
        ev.LlmCallCompleted(call_id="l1", response="hi", input_tokens=10, output_tokens=3,
                            cost_usd=0.5),
        ev.LlmCallIntended(call_id="l2", model="m", request_hash="h", idempotency_key="k2"),
        ev.LlmCallCompleted(call_id="l2", response="yo", input_tokens=1, output_tokens=2,
                            cost_usd=0.25),
    )
    assert state.llm_results == {"l1": "hi", "l2": "yo"}
    assert (state.usage.input_tokens, state.usage.output_tokens) == (11, 5)
    assert state.usage.cost_usd == 0.75 and state.usage.llm_calls == 2


def test_retryable_failure_then_retry_then_success() -> None:
    """A retryable failure schedules a retry; the next attempt's intent reuses the call id."""
    state = running(
        tool_intent(),
        ev.ToolCallFailed(call_id="c1", attempt=1, error="503", error_type="Http",
                          retryable=True, retry_at_ms=99),
    )
    record = state.calls["c1"]
    assert (record.status, record.due_at_ms, record.error is not None) == (
        CallStatus.RETRYING, 99, True)
    state = running(
        tool_intent(),
        ev.ToolCallFailed(call_id="c1", attempt=1, error="503", error_type="Http",
                          retryable=True, retry_at_ms=99),
        tool_intent(attempt=2),
        ev.ToolCallCompleted(call_id="c1", result="ok"),
    )
    record = state.calls["c1"]
    assert (record.status, record.attempt, record.seq, record.retry_seq) == (
        CallStatus.COMPLETED, 2, 3, 5)
    assert state.usage.tool_calls == 2


def test_final_failure_and_escalation() -> None:
    """A non-retryable failure is final; an escalated call leaves the in-doubt set."""
    failed = running(tool_intent(), ev.ToolCallFailed(call_id="c1", attempt=1, error="no",
                                                      error_type="E"))
    assert failed.calls["c1"].status is CallStatus.FAILED
    escalated = running(tool_intent(idempotent=False),
                        ev.ToolCallUncertain(call_id="c1", policy="escalate"))
    assert escalated.calls["c1"].status is CallStatus.UNCERTAIN and escalated.pending == {}


def test_messages_env_plan_values_and_signals() -> None:
    """Observations land in messages, env, plan, journaled values and consumed signals."""
    state = running(
        ev.MessageAppended(role="user", content="hello"),
        ev.EnvironmentSet(values={"A": "1", "B": "2"}),
        ev.EnvironmentSet(values={"A": None}),
        ev.PlanUpdated(nodes=[ev.PlanNode(node_id="a"),
                              ev.PlanNode(node_id="b", depends_on=["a"])]),
        ev.PlanNodeCompleted(node_id="a"),
        ev.ValueRecorded(call_id="v1", kind="now", value=1234),
        ev.SignalReceived(name="go", payload={"ok": True}, signal_id=7),
    )
    assert [m.content for m in state.messages] == ["hello"]
    assert state.env == {"B": "2"}
    assert list(state.plan) == ["a", "b"] and state.plan_completed == ["a"]
    assert state.calls["v1"].result == 1234
    assert state.signal_ids == [7]
    assert state.calls["signal#7"].result == {"ok": True}


def test_timer_wait_wake_resume_fire() -> None:
    """A durable sleep is a journal entry that completes when its timer fires."""
    state = running(
        ev.TimerStarted(timer_id="z", wake_at_ms=500, duration_ms=100),
        ev.TaskWoken(reason="timer"),
        ev.TaskResumed(worker_id="w2", attempt=2),
    )
    assert state.status is Status.RUNNING and state.waiting_on is not None
    assert state.calls["z"].status is CallStatus.PENDING
    fired = apply(state, ev.TimerFired(timer_id="z"))
    assert fired.calls["z"].status is CallStatus.COMPLETED and fired.waiting_on is None


def test_signal_wait_times_out() -> None:
    """A signal wait woken by its timeout records a timeout failure for the wait."""
    state = running(ev.SignalAwaited(name="approve", timeout_ms=10), ev.TaskWoken(reason="timeout"))
    record = state.calls["signal@3"]
    assert record.status is CallStatus.FAILED and record.error is not None
    assert record.error.error_type == "SignalTimeout" and state.waiting_on is None


def test_signal_wait_completed_by_delivery() -> None:
    """A signal delivered after a wait completes that wait's journal entry."""
    state = running(
        ev.SignalAwaited(name="approve"), ev.TaskWoken(reason="signal"),
        ev.TaskResumed(worker_id="w1", attempt=2),
        ev.SignalReceived(name="approve", payload="yes", signal_id=1),
    )
    assert list(state.calls) == ["signal@3"]
    assert state.calls["signal@3"].result == "yes" and state.waiting_on is None


def test_approval_gates_the_exact_call() -> None:
    """An approved call may be intended with the approved tool and arguments only."""
    ask = ev.ApprovalRequested(call_id="c1", tool="search", args_hash=args_hash(None),
                               signal_name="approve")
    ok = ev.ApprovalDecided(call_id="c1", approved=True, approver="ops",
                            args_hash=args_hash(None))
    state = running(ask, ok, tool_intent())
    assert state.approvals["c1"].approved is True and "c1" in state.calls
    assert "needs an approval" in refused(ask, tool_intent()).reason
    no = ev.ApprovalDecided(call_id="c1", approved=False, approver="ops",
                            args_hash=args_hash(None))
    assert "refused" in refused(ask, no, tool_intent()).reason
    assert "differs" in refused(ask, ok, tool_intent(args=1)).reason


def test_checkpoint_sets_step_and_next_action() -> None:
    """A checkpoint records the step and the next planned action."""
    state = running(ev.StepCheckpointed(step=1, next_action={"do": "x"}))
    assert (state.status, state.step, state.next_action) == (
        Status.CHECKPOINTED, 1, {"do": "x"})
    assert apply(state, ev.StepStarted(step=2)).status is Status.RUNNING


def test_terminal_outcomes() -> None:
    """Completion keeps the output; failure and cancellation keep the reason."""
    assert running(ev.TaskCompleted(output=42)).output == 42
    failed = running(ev.TaskFailed(reason="budget", error="E"))
    assert failed.failure is not None and failed.failure.reason == "budget"
    cancelled = running(ev.TaskCancelled(requested_by="ops"))
    assert cancelled.failure is not None and cancelled.failure.cancelled
    assert cancelled.terminal and cancelled.status is Status.FAILED


def test_fork_and_budget_events_allowed_outside_running() -> None:
    """task_forked and budget_exceeded fold while QUEUED, unlike observations."""
    state = fold(numbered(SUBMITTED, ev.TaskForked(parent_task_id="p", parent_seq=4),
                          ev.BudgetExceeded(budget="tokens", limit=1, used=2)), task_id="t1")
    assert (state.parent_task_id, state.parent_seq) == ("p", 4)
    assert state.budget_exceeded is not None and state.status is Status.QUEUED


def test_apply_does_not_modify_its_argument() -> None:
    """apply returns a new state and leaves the old one as it was."""
    before = running(ev.MessageAppended(role="user", content="a"))
    after = apply(before, ev.MessageAppended(role="user", content="b"))
    assert len(before.messages) == 1 and len(after.messages) == 2
    assert before.last_seq == 3 and after.last_seq == 4


def test_fold_from_start_does_not_modify_the_start() -> None:
    """Folding onto a start state copies it instead of mutating it."""
    start = running(tool_intent())
    fold([(4, ev.ToolCallCompleted(call_id="c1", result=1))], start=start)
    assert start.pending == {"c1": 3} and start.calls["c1"].status is CallStatus.PENDING


def test_state_is_frozen() -> None:
    """AgentState refuses attribute assignment."""
    state = running()
    with pytest.raises(AttributeError):
        state.step = 3  # type: ignore[misc]


def test_state_builder_matches_fold() -> None:
    """A StateBuilder fed one event at a time gives the fold's state, with hashes kept."""
    history = numbered(SUBMITTED, CLAIMED, ev.MessageAppended(role="user", content="x"))
    builder = StateBuilder(task_id="t1")
    for seq, event in history:
        builder.apply(event, seq=seq, event_hash=bytes([seq]) * 32)
    state = builder.state()
    assert state.last_hash == bytes([3]) * 32
    assert msgspec.structs.replace(state, last_hash=b"") == fold(history, task_id="t1")


def test_hashes_from_triples_are_tracked() -> None:
    """(seq, event, hash) items carry the chain hash into last_hash."""
    state = fold([(1, SUBMITTED, b"a" * 32), (2, CLAIMED, b"b" * 32)], task_id="t1")
    assert state.last_hash == b"b" * 32


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("events", "seq", "words"),
    [
        ((CLAIMED,), 1, "first event must be task_submitted"),
        ((SUBMITTED, SUBMITTED), 2, "task_submitted cannot move"),
        ((SUBMITTED, ev.MessageAppended(role="u")), 2, "observations need RUNNING"),
        ((SUBMITTED, ev.TaskResumed(worker_id="w")), 2, "cannot move QUEUED -> RUNNING"),
        ((SUBMITTED, ev.TaskCompleted()), 2, "cannot move QUEUED -> COMPLETED"),
    ],
)
def test_impossible_openings(events: tuple[ev.Event, ...], seq: int, words: str) -> None:
    """A history must open with task_submitted and then move legally."""
    with pytest.raises(ReplayError) as caught:
        fold(numbered(*events), task_id="t1")
    assert caught.value.seq == seq and words in str(caught.value)


def test_seq_gap_and_repeat_are_refused() -> None:
    """A seq that is not last + 1 names the seq and what was expected."""
    with pytest.raises(ReplayError, match="expected seq 2") as caught:
        fold([(1, SUBMITTED), (3, CLAIMED)], task_id="t1")
    assert caught.value.seq == 3
    with pytest.raises(ReplayError, match="expected seq 2"):
        fold([(1, SUBMITTED), (1, CLAIMED)], task_id="t1")


def test_event_after_terminal_is_refused() -> None:
    """Nothing follows COMPLETED or FAILED, not even a fork or a budget trip."""
    for tail in (ev.MessageAppended(role="u"), ev.TaskForked(parent_task_id="p", parent_seq=1),
                 ev.TaskFailed(reason="again")):
        error = refused(ev.TaskCompleted(), tail)
        assert error.seq == 4 and "after the terminal status COMPLETED" in error.reason


@pytest.mark.parametrize(
    ("events", "words"),
    [
        ((ev.ToolCallCompleted(call_id="nope"),), "never intended"),
        ((ev.LlmCallCompleted(call_id="nope"),), "never intended"),
        ((ev.ToolCallFailed(call_id="nope", attempt=1, error="e", error_type="E"),),
         "never intended"),
        ((ev.TimerFired(timer_id="nope"),), "never intended"),
        ((tool_intent(), ev.ToolCallCompleted(call_id="c1"), ev.ToolCallCompleted(call_id="c1")),
         "which is completed"),
        ((tool_intent(), tool_intent()), "already taken"),
        ((tool_intent(attempt=2),), "starts at attempt 2"),
        ((tool_intent(), ev.ToolCallFailed(call_id="c1", attempt=1, error="e", error_type="E",
                                           retryable=True, retry_at_ms=1),
          tool_intent(tool="other", attempt=2)), "changes the call"),
        ((tool_intent(), ev.ToolCallFailed(call_id="c1", attempt=2, error="e", error_type="E")),
         "failure of attempt 2"),
        ((tool_intent(), ev.LlmCallCompleted(call_id="c1")), "never intended"),
        ((ev.ValueRecorded(call_id="v", kind="now"), ev.ValueRecorded(call_id="v", kind="now")),
         "already taken"),
        ((ev.SignalReceived(name="s", signal_id=1), ev.SignalReceived(name="s", signal_id=1)),
         "already consumed"),
        ((ev.ApprovalDecided(call_id="c", approved=True, approver="a", args_hash="h"),),
         "never requested"),
        ((ev.PlanNodeCompleted(node_id="x"),), "not in the plan"),
        ((ev.PlanUpdated(nodes=[ev.PlanNode(node_id="a", depends_on=["b"]),
                                ev.PlanNode(node_id="b", depends_on=["a"])]),), "cycle"),
        ((ev.PlanUpdated(nodes=[ev.PlanNode(node_id="a", depends_on=["z"])]),), "unknown node"),
        ((ev.PlanUpdated(nodes=[ev.PlanNode(node_id="a"), ev.PlanNode(node_id="a")]),),
         "repeats"),
        ((ev.PlanUpdated(nodes=[ev.PlanNode(node_id="a"),
                                ev.PlanNode(node_id="b", depends_on=["a"])]),
          ev.PlanNodeCompleted(node_id="b")), "completed before 'a'"),
        ((ev.StepCheckpointed(step=3), ev.StepStarted(step=2)), "started after step 3"),
        ((ev.TaskOrphaned(), ev.TaskResumed(worker_id="w", attempt=1)), "does not follow"),
        ((ev.TimerStarted(timer_id="z", wake_at_ms=1, duration_ms=1), ev.TaskWoken(reason="t"),
          ev.TaskResumed(worker_id="w", attempt=2), ev.TimerFired(timer_id="z"),
          ev.TimerFired(timer_id="z")), "which is completed"),
    ],
)
def test_impossible_observations(events: tuple[ev.Event, ...], words: str) -> None:
    """Each impossible observation raises a ReplayError naming the offending seq."""
    error = refused(*events)
    assert words in error.reason
    assert error.seq == 2 + len(events)
    assert isinstance(error, CorruptionError)


@pytest.mark.parametrize(
    "event",
    [ev.TaskWoken(reason="x"), ev.StepStarted(step=1), ev.TaskClaimed(worker_id="w", attempt=2),
     ev.TaskResumed(worker_id="w", attempt=2)],
)
def test_moves_the_table_allows_but_the_event_cannot_make(event: ev.Event) -> None:
    """task_woken needs WAITING, step_started CHECKPOINTED, claims QUEUED or RESUMING."""
    error = refused(event)
    assert error.seq == 3 and "cannot move RUNNING" in error.reason


def test_observation_while_checkpointed_is_refused() -> None:
    """Observations need RUNNING: a tool result while CHECKPOINTED is refused."""
    error = refused(tool_intent(), ev.StepCheckpointed(step=0),
                    ev.ToolCallCompleted(call_id="c1"))
    assert error.seq == 5 and "while CHECKPOINTED" in error.reason


def test_error_names_the_task() -> None:
    """A ReplayError's message names the seq and the task."""
    error = refused(ev.ToolCallCompleted(call_id="nope"))
    assert "seq 3" in str(error) and "'t1'" in str(error) and error.task_id == "t1"
