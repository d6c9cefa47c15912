"""The journal cursor: recorded, in-doubt, retry and fresh calls, and each kind of divergence."""

from __future__ import annotations

import pytest

from replay import (
    CallKind,
    Fresh,
    InDoubt,
    Journal,
    NonDeterminismError,
    Recorded,
    Retry,
    args_hash,
    fold,
)
from wal_engine import events as ev
from wal_engine.errors import WalError

SUBMITTED = ev.TaskSubmitted(agent="agent")
CLAIMED = ev.TaskClaimed(worker_id="w1", attempt=1)
SEARCH_ARGS = {"q": "cats"}


def journal(*events: ev.Event) -> Journal:
    """The cursor over a claimed task followed by ``events``."""
    return Journal.from_state(fold(list(enumerate((SUBMITTED, CLAIMED, *events), 1)),
                                   task_id="t1"))


def search(call_id: str = "c1", args: object = SEARCH_ARGS, *, idempotent: bool = True,
           attempt: int = 1) -> ev.Event:
    """A search intent."""
    return ev.ToolCallIntended(call_id=call_id, tool="search", args=args,
                               args_hash=args_hash(args), idempotency_key=f"k-{call_id}",
                               idempotent=idempotent, attempt=attempt)


def test_args_hash_is_stable_and_key_order_free() -> None:
    """The args hash depends on the value, not on dict key order, and is hex sha256."""
    assert args_hash({"a": 1, "b": [1, 2]}) == args_hash({"b": [1, 2], "a": 1})
    assert args_hash({"a": 1}) != args_hash({"a": 2})
    assert len(args_hash(None)) == 64


def test_recorded_result_is_returned() -> None:
    """A completed call is returned from the log, nothing to call."""
    cursor = journal(search(), ev.ToolCallCompleted(call_id="c1", result=[1, 2]))
    outcome = cursor.next_call(CallKind.TOOL, "search", args_hash(SEARCH_ARGS))
    assert outcome == Recorded(call_id="c1", seq=3, result=[1, 2])
    cursor.finish()


def test_final_failure_is_returned_as_recorded_error() -> None:
    """A call that failed for good replays its error."""
    cursor = journal(search(), ev.ToolCallFailed(call_id="c1", attempt=1, error="no",
                                                 error_type="E"))
    outcome = cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    assert isinstance(outcome, Recorded) and outcome.error is not None
    assert outcome.error.error == "no"


def test_intent_without_result_is_in_doubt_with_its_key() -> None:
    """An intent with no outcome is in doubt and carries the recorded idempotency key."""
    cursor = journal(search())
    outcome = cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    assert outcome == InDoubt(call_id="c1", seq=3, idempotency_key="k-c1")


def test_escalated_call_is_in_doubt_and_escalated() -> None:
    """A non-idempotent call escalated after a crash is reported escalated."""
    cursor = journal(search(idempotent=False), ev.ToolCallUncertain(call_id="c1", policy="x"))
    outcome = cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    assert isinstance(outcome, InDoubt) and outcome.escalated and not outcome.idempotent


def test_retrying_call_asks_for_the_next_attempt() -> None:
    """A retryable failure makes the cursor ask for attempt 2 at the recorded time."""
    cursor = journal(search(), ev.ToolCallFailed(call_id="c1", attempt=1, error="e",
                                                 error_type="E", retryable=True,
                                                 retry_at_ms=77))
    outcome = cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    assert outcome == Retry(call_id="c1", seq=3, attempt=2, idempotency_key="k-c1",
                            due_at_ms=77)


def test_calls_past_the_log_are_fresh_with_deterministic_ids() -> None:
    """Past the last recorded call every call is fresh, its id derived from its position."""
    cursor = journal(search(call_id="tool-1"), ev.ToolCallCompleted(call_id="tool-1"))
    cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    assert cursor.next_call("tool", "fetch", "") == Fresh(call_id="tool-1.1")
    assert cursor.next_call("llm", "m", "") == Fresh(call_id="llm-2")
    assert cursor.position == 3 and cursor.remaining == 0
    cursor.finish()


def test_values_timers_and_signals_are_journal_entries() -> None:
    """Journaled values, sleeps and signal waits take their place in the call order."""
    cursor = journal(
        ev.ValueRecorded(call_id="v1", kind="now", value=5),
        ev.TimerStarted(timer_id="z", wake_at_ms=900, duration_ms=100),
        ev.TaskWoken(reason="timer"), ev.TaskResumed(worker_id="w", attempt=2),
        ev.SignalReceived(name="go", payload=1, signal_id=3),
    )
    assert cursor.next_call("value", "now") == Recorded(call_id="v1", seq=3, result=5)
    timer = cursor.next_call("timer", "sleep", args_hash(100))
    assert isinstance(timer, InDoubt) and timer.due_at_ms == 900
    assert cursor.next_call("signal", "go") == Recorded(call_id="signal#3", seq=7, result=1)


def test_other_tool_is_nondeterminism_naming_both_sides_and_fork_point() -> None:
    """A different tool at the same position raises with seq, both calls and the fork point."""
    cursor = journal(ev.MessageAppended(role="u"), search(), ev.ToolCallCompleted(call_id="c1"))
    with pytest.raises(NonDeterminismError) as caught:
        cursor.next_call("tool", "fetch", args_hash(SEARCH_ARGS))
    error = caught.value
    assert (error.seq, error.fork_point, error.call_index) == (4, 3, 0)
    assert error.recorded is not None and error.recorded.name == "search"
    assert error.requested is not None and error.requested.name == "fetch"
    text = str(error)
    for part in ("seq 4", "'search'", "'fetch'", "fork at seq 3", "'t1'"):
        assert part in text
    assert isinstance(error, WalError)


def test_other_arguments_are_nondeterminism() -> None:
    """Same tool with other arguments is caught by the args hash."""
    cursor = journal(search())
    with pytest.raises(NonDeterminismError) as caught:
        cursor.next_call("tool", "search", args_hash({"q": "dogs"}))
    assert caught.value.seq == 3
    assert caught.value.requested is not None
    assert caught.value.requested.args_hash == args_hash({"q": "dogs"})


def test_other_kind_is_nondeterminism() -> None:
    """An LLM call where a tool call was recorded is caught."""
    with pytest.raises(NonDeterminismError):
        journal(search()).next_call("llm", "search", args_hash(SEARCH_ARGS))


def test_fewer_calls_are_caught_by_finish() -> None:
    """Finishing with recorded calls left names the first one never asked for."""
    cursor = journal(search(), ev.ToolCallCompleted(call_id="c1"), search(call_id="c2"))
    cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    with pytest.raises(NonDeterminismError) as caught:
        cursor.finish()
    error = caught.value
    assert (error.seq, error.fork_point, error.call_index, error.requested) == (5, 4, 1, None)
    assert "it finished" in str(error)


def test_more_calls_than_a_finished_history_are_caught() -> None:
    """A call past the end of a completed history diverges at the terminal event."""
    cursor = journal(search(), ev.ToolCallCompleted(call_id="c1"), ev.TaskCompleted())
    cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    with pytest.raises(NonDeterminismError) as caught:
        cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    error = caught.value
    assert (error.seq, error.fork_point, error.recorded) == (5, 4, None)
    assert "no further call" in str(error)


def test_more_calls_than_an_unfinished_history_are_fresh() -> None:
    """A history still running simply continues: extra calls are fresh."""
    cursor = journal(search(), ev.ToolCallCompleted(call_id="c1"))
    cursor.next_call("tool", "search", args_hash(SEARCH_ARGS))
    assert isinstance(cursor.next_call("tool", "search", ""), Fresh)


def test_retries_do_not_shift_positions() -> None:
    """A retried call is still one journal entry; its fork point is before its first intent."""
    cursor = journal(
        search(), ev.ToolCallFailed(call_id="c1", attempt=1, error="e", error_type="E",
                                    retryable=True, retry_at_ms=1),
        search(attempt=2), ev.ToolCallCompleted(call_id="c1", result="ok"),
        search(call_id="c2"),
    )
    assert cursor.next_call("tool", "search", args_hash(SEARCH_ARGS)) == Recorded(
        call_id="c1", seq=3, result="ok")
    with pytest.raises(NonDeterminismError) as caught:
        cursor.next_call("tool", "other", "")
    assert (caught.value.seq, caught.value.fork_point) == (7, 6)


TOKEN = "ghp_" + "aB3dE5" * 6


def _named(tool: str, *extra: ev.Event) -> Journal:
    """A cursor over one completed call of ``tool``, names compared redacted."""
    from wal_engine.security.redaction import NameForms, default_redactor

    state = fold(list(enumerate((SUBMITTED, CLAIMED, ev.ToolCallIntended(
        call_id="c1", tool=tool, args=None, args_hash=args_hash(None), idempotency_key="k"),
        ev.ToolCallCompleted(call_id="c1", result=1), *extra), 1)), task_id="t1")
    return Journal(state.calls.values(), end_seq=state.last_seq, closed=False, task_id="t1",
                   name_form=NameForms(default_redactor))


def test_a_name_holding_a_secret_matches_its_redacted_record() -> None:
    """Names are recorded redacted: the code's name is compared in that form, and a history
    that holds the name as given (recorded before names were redacted, or with redaction
    off) matches as well."""
    redacted = _named("call_[REDACTED:github_token]")
    assert isinstance(redacted.next_call("tool", f"call_{TOKEN}", args_hash(None)), Recorded)
    as_given = _named(f"call_{TOKEN}")
    assert isinstance(as_given.next_call("tool", f"call_{TOKEN}", args_hash(None)), Recorded)


def test_a_divergence_shows_the_redacted_name_never_the_secret() -> None:
    """Another tool name is still a divergence, and the error names the requested call in
    its redacted form."""
    cursor = _named("call_[REDACTED:github_token]")
    with pytest.raises(NonDeterminismError) as caught:
        cursor.next_call("tool", f"other password={TOKEN}", args_hash(None))
    assert caught.value.requested is not None
    assert caught.value.requested.name == "other password=[REDACTED:github_token]"
    assert TOKEN not in str(caught.value)


def test_names_of_events_are_redacted_on_append_and_remembered() -> None:
    """redact_event redacts the names the journal matches on (tool, model, signal wait and
    receipt, message, approval, value kind), with a run's NameForms remembering each."""
    from wal_engine.security.redaction import NameForms, default_redactor, redact_event

    names = NameForms(default_redactor)
    events = [
        ev.ToolCallIntended(call_id="c", tool=f"t {TOKEN}", args_hash="h", idempotency_key="k"),
        ev.LlmCallIntended(call_id="c", model=f"m {TOKEN}", request_hash="h",
                           idempotency_key="k"),
        ev.SignalAwaited(name=f"s {TOKEN}"),
        ev.SignalReceived(name=f"s {TOKEN}", signal_id=1),
        ev.MessageAppended(role="user", content="hi", name=f"n {TOKEN}"),
        ev.ApprovalRequested(call_id="c", tool=f"a {TOKEN}", args_hash="h", signal_name="x"),
        ev.ValueRecorded(call_id="c", kind=f"approval:{TOKEN}", value=1),
    ]
    stored = [redact_event(event, default_redactor, names=names) for event in events]
    assert all(TOKEN not in repr(event) for event in stored)
    assert stored[2] == ev.SignalAwaited(name="s [REDACTED:github_token]")
    plain = ev.ToolCallIntended(call_id="c", tool="search", args_hash="h", idempotency_key="k")
    assert redact_event(plain, default_redactor, names=names) is plain
    assert names(f"s {TOKEN}") is names(f"s {TOKEN}")
