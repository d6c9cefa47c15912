"""The timeline's usage is the replay fold's: for any valid history, and any window."""

from __future__ import annotations

import datetime as dt

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from replay import fold
from replay.state import AgentState
from tests.strategies import chained, histories
from wal_engine import events as ev
from wal_engine.audit.timeline import UsageFold, build_model, render_page
from wal_engine.store import EventRecord

TASK = "task-1"
T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


def records_of(history: list[tuple[int, ev.Event]]) -> list[EventRecord]:
    """The history as stored rows (chain hashes, one millisecond apart)."""
    rows: list[EventRecord] = []
    for seq, event, digest in chained(TASK, history):
        kind, version, payload = ev.encode_event(event)
        rows.append(EventRecord(task_id=TASK, seq=seq, type=kind, version=version, epoch=0,
                                payload=payload, idempotency_key=None, hash=digest,
                                recorded_at=T0 + dt.timedelta(milliseconds=seq)))
    return rows


def expected(state: AgentState) -> dict[str, object]:
    usage = state.usage
    return {"tokens": usage.input_tokens + usage.output_tokens, "cost_usd": usage.cost_usd,
            "tool_calls": usage.tool_calls, "llm_calls": usage.llm_calls, "steps": state.step}


def totals(series: list[dict[str, object]]) -> dict[str, object]:
    return {name: series[-1][name] for name in ("tokens", "cost_usd", "tool_calls",
                                                "llm_calls", "steps")}


@given(histories())
def test_timeline_totals_are_the_folds(history: list[tuple[int, ev.Event]]) -> None:
    """Last point of the budget series, per-call tokens, limits and trips: all the fold's."""
    records = records_of(history)
    state = fold(records, task_id=TASK)
    model = build_model(None, records)
    budget = model["budget"]
    assert budget["fold_stopped"] is None
    assert totals(budget["series"]) == expected(state)
    assert budget["limits"] == msgspec.to_builtins(state.budget)
    tokens = [call.get("tokens", 0) for call in model["calls"]]
    assert sum(tokens) == state.usage.input_tokens + state.usage.output_tokens
    trips = [seq for seq, event in history if isinstance(event, ev.BudgetExceeded)]
    assert [trip["seq"] for trip in budget["trips"]] == trips
    if state.budget_exceeded is not None:
        last = budget["trips"][-1]
        assert (last["budget"], last["limit"], last["used"]) == (
            state.budget_exceeded.budget, state.budget_exceeded.limit,
            state.budget_exceeded.used)
    for point in budget["series"]:  # Each point is the fold's state after its event.
        prefix = fold(records[:point["seq"]], task_id=TASK)
        assert {k: point[k] for k in expected(prefix)} == expected(prefix)


@given(histories(), st.data())
def test_a_window_shows_usage_cumulative_from_seq_1(
        history: list[tuple[int, ev.Event]], data: st.DataObject) -> None:
    """A window (``--from``) folds what comes before it: its totals are the whole log's."""
    records = records_of(history)
    k = data.draw(st.integers(0, len(records) - 1), label="k")
    usage = UsageFold(task_id=TASK)
    assert all(usage.advance(record) for record in records[:k])
    window = build_model(None, records[k:], usage)
    whole = build_model(None, records)
    assert totals(window["budget"]["series"]) == totals(whole["budget"]["series"])
    assert window["budget"]["limits"] == whole["budget"]["limits"]


@given(histories(max_events=30), st.data())
def test_a_refused_event_stops_the_usage_and_the_page_is_still_drawn(
        history: list[tuple[int, ev.Event]], data: st.DataObject) -> None:
    """An undecodable payload: usage stops at the event before, which says where and why."""
    records = records_of(history)
    bad = data.draw(st.integers(0, len(records) - 1), label="bad")
    records[bad] = msgspec.structs.replace(records[bad], payload=b"\xff not json")
    model = build_model(None, records)
    stopped = model["budget"]["fold_stopped"]
    assert stopped["seq"] == bad + 1 and str(bad + 1) in stopped["error"]
    assert all(point["seq"] <= bad for point in model["budget"]["series"])
    if bad > 0:
        assert totals(model["budget"]["series"]) == expected(fold(records[:bad],
                                                                  task_id=TASK))
    assert len(model["events"]) == len(records)
    assert "fold_stopped" in render_page(model)
