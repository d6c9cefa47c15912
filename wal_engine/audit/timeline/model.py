"""What a timeline draws, computed from stored events (pure: no I/O, no clock).

Every span is drawn from its first to its last event, by time (``recorded_at``, the
committing transaction's database clock) or by seq. Durations are the time between the
intent and the outcome as recorded, so they include the commit of the intent and exclude
nothing the worker did in between.

Usage (tokens, cost, tool and LLM calls, steps) is never read from payload text: the replay
fold (:mod:`replay.fold`) runs alongside, one event at a time, and each figure is the fold's
state after the event (:class:`UsageFold`), so the page shows what the budget arithmetic
counts. A log the fold refuses (a corrupt or undecodable event) is still drawn; its usage
stops at the event before, and ``budget.fold_stopped`` says where and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec
import orjson

from replay.fold import StateBuilder
from replay.state import AgentState, BudgetTrip, budget_usage
from replay.upcasting import UpcasterRegistry, upcasters
from wal_engine.chain import StoredEvent
from wal_engine.errors import WalError
from wal_engine.events import target_status
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.store import EventRecord, TaskHead

payload_bytes_embedded_max: Final = 64 * 1024
"""Larger payloads are embedded cut to this size, with a note on how to read them whole."""

CLAIMS: Final = frozenset({"task_claimed", "task_resumed"})
LEASE_ENDS: Final = frozenset({"task_released", "task_orphaned", "timer_started",
                               "signal_awaited", "task_completed", "task_failed",
                               "task_cancelled"})
ENDINGS: Final = frozenset({"task_completed", "task_failed", "task_cancelled"})
MARKERS: Final = frozenset({"task_claimed", "task_resumed", "task_orphaned", "task_released",
                            "task_woken", "task_forked", "task_completed", "task_failed",
                            "task_cancelled", "budget_exceeded"})

_CATEGORIES: Final = (
    ("tool_", "tool"), ("llm_", "llm"), ("timer_", "wait"), ("signal_", "wait"),
    ("approval_", "approval"), ("step_", "step"), ("budget_", "budget"), ("graph_", "graph"),
    ("message_", "data"), ("value_", "data"), ("environment_", "data"), ("plan_", "data"),
)


def category(event_type: str) -> str:
    """The colour group of an event type."""
    for prefix, name in _CATEGORIES:
        if event_type.startswith(prefix):
            return name
    return "lifecycle"


class UsageFold:
    """The replay fold run beside a timeline: the usage figures after each event it folds.

    Start it on the state before the first event drawn (``start``; None for seq 1) and
    :meth:`advance` it through the events in seq order. The first event the fold refuses
    (it raises :class:`~wal_engine.errors.WalError`: a ReplayError, an unknown type or
    version, an undecodable payload) stops it for good; :attr:`stopped` says where and why.
    """

    def __init__(self, start: AgentState | None = None, *, task_id: str = "",
                 registry: UpcasterRegistry = upcasters) -> None:
        self._builder = StateBuilder(start, task_id=task_id, registry=registry)
        self._registry = registry
        self.stopped: dict[str, Any] | None = None
        """``{"seq", "error"}`` of the event the fold refused, or None."""

    def advance(self, record: StoredEvent) -> bool:
        """Fold ``record``; False (and nothing folded) once the fold has stopped."""
        if self.stopped is not None:
            return False
        try:
            event = self._registry.decode_record(record.type, record.version, record.payload,
                                                 record.seq)
            self._builder.apply(event, seq=record.seq, event_hash=record.hash)
        except WalError as error:
            self.stopped = {"seq": record.seq, "error": str(error)}
            return False
        return True

    def figures(self) -> dict[str, Any]:
        """Usage so far, as the budget arithmetic counts it (plus LLM calls)."""
        view = self._builder.view
        used = budget_usage(view)
        return {"tokens": used.tokens, "cost_usd": used.cost_usd,
                "tool_calls": used.tool_calls, "llm_calls": view.usage.llm_calls,
                "steps": used.steps}

    @property
    def limits(self) -> dict[str, Any] | None:
        """The budget's limits that are set, or None before ``task_submitted`` is folded."""
        view = self._builder.view
        if view.last_seq == 0:
            return None
        limits: dict[str, Any] = msgspec.to_builtins(view.budget)
        return limits

    @property
    def trip(self) -> BudgetTrip | None:
        """The latest budget trip folded."""
        return self._builder.view.budget_exceeded


class _Event:
    __slots__ = ("epoch", "payload", "seq", "t", "tokens", "trip", "type", "used")

    def __init__(self, record: EventRecord, payload: Any, t: float) -> None:
        self.seq = record.seq
        self.type = record.type
        self.epoch = record.epoch
        self.payload = payload if isinstance(payload, dict) else {}
        self.t = t
        self.used: dict[str, Any] | None = None
        """The fold's usage figures after this event; None once the fold has stopped."""
        self.tokens: int | None = None
        """Tokens this event added, by the fold (None if it did not fold)."""
        self.trip: BudgetTrip | None = None
        """The budget trip this event recorded, as folded."""


def _at(event: _Event) -> dict[str, Any]:
    return {"seq": event.seq, "t": event.t}


def _span(start: _Event, end: _Event, **fields: Any) -> dict[str, Any]:
    return {"start": _at(start), "end": _at(end), **fields}


def build_model(head: TaskHead | None, records: Sequence[EventRecord],
                usage: UsageFold | None = None) -> dict[str, Any]:
    """The timeline of ``records`` (one task, seq order) as plain JSON for the page.

    ``usage`` is the fold advanced to the event before ``records[0]`` (see
    :func:`~wal_engine.audit.timeline.read_timeline`); by default a fold from seq 1.
    """
    task_id = head.task_id if head else (records[0].task_id if records else "")
    usage = usage if usage is not None else UsageFold(task_id=task_id)
    events: list[_Event] = []
    marks: list[dict[str, Any]] = []
    last_t = 0.0
    before = None if usage.stopped else usage.figures()
    for record in records:
        payload, note = _embedded_payload(record)
        stamp = record.recorded_at
        last_t = last_t if stamp is None else stamp.timestamp() * 1000
        event = _Event(record, payload, last_t)
        before = _fold_one(usage, record, event, before)
        events.append(event)
        marks.append({"seq": record.seq, "type": record.type, "cat": category(record.type),
                      "epoch": record.epoch, "t": last_t, "payload": payload, "note": note,
                      "hash": record.hash.hex()[:16],
                      "recorded_at": None if stamp is None else stamp.isoformat()})
    return {
        "task": _task(head, records),
        "events": marks,
        "stretches": _stretches(events),
        "statuses": _statuses(events),
        "steps": _steps(events),
        "calls": _calls(events),
        "waits": _waits(events),
        "budget": _budget(head, events, usage),
        "markers": [_marker(e) for e in events if e.type in MARKERS],
    }


def _fold_one(usage: UsageFold, record: EventRecord, event: _Event,
              before: dict[str, Any] | None) -> dict[str, Any] | None:
    """Advance the fold over ``record``; note on ``event`` its figures, tokens and trip."""
    trip = usage.trip
    if not usage.advance(record):
        return None
    event.used = usage.figures()
    if before is not None:
        event.tokens = event.used["tokens"] - before["tokens"]
    if usage.trip is not trip:
        event.trip = usage.trip
    return event.used


def _embedded_payload(record: EventRecord) -> tuple[Any, str | None]:
    size = len(record.payload)
    if size > payload_bytes_embedded_max:
        text = record.payload[:payload_bytes_embedded_max].decode("utf-8", "replace")
        return text, (f"payload of {size} bytes cut to {payload_bytes_embedded_max}; read it "
                      f"whole with `wal-engine history {record.task_id} --from {record.seq} "
                      f"--to {record.seq} --json`")
    try:
        return orjson.loads(record.payload), None
    except orjson.JSONDecodeError:
        return record.payload.hex(), "payload is not JSON (hex shown)"


def _task(head: TaskHead | None, records: Sequence[EventRecord]) -> dict[str, Any]:
    first = records[0] if records else None
    last = records[-1] if records else None
    return {
        "task_id": head.task_id if head else (first.task_id if first else ""),
        "agent": head.agent if head else "",
        "status": str(head.status) if head else "",
        "head_seq": head.head_seq if head else (last.seq if last else 0),
        "first_seq": first.seq if first else 0,
        "last_seq": last.seq if last else 0,
        "parent_task_id": head.parent_task_id if head else None,
        "parent_seq": head.parent_seq if head else None,
        "start": _iso(first), "end": _iso(last),
    }


def _iso(record: EventRecord | None) -> str | None:
    return None if record is None or record.recorded_at is None else \
        record.recorded_at.isoformat()


def _stretches(events: list[_Event]) -> list[dict[str, Any]]:
    """Who held the lease when: from a claim to the event that gave the lease up."""
    spans: list[dict[str, Any]] = []
    current: tuple[_Event, str] | None = None
    for index, event in enumerate(events):
        if event.type in CLAIMS:
            if current is not None:
                spans.append(_span(current[0], event, worker=current[1],
                                   epoch=current[0].epoch, ended="claimed again"))
            current = (event, str(event.payload.get("worker_id") or "?"))
        elif index == 0 and event.epoch > 0 and event.type not in LEASE_ENDS:
            current = (event, "?")  # The window (--from) opens inside a stretch.
        elif current is not None and event.type in LEASE_ENDS:
            spans.append(_span(current[0], event, worker=current[1], epoch=current[0].epoch,
                               ended=event.type))
            current = None
    if current is not None and events:
        spans.append(_span(current[0], events[-1], worker=current[1], epoch=current[0].epoch,
                           ended=None))
    return spans


def _status_of(event_type: str) -> Status | None:
    try:
        return target_status(event_type)
    except WalError:
        return None


def _statuses(events: list[_Event]) -> list[dict[str, Any]]:
    spans: list[dict[str, Any]] = []
    current: tuple[_Event, Status] | None = None
    for event in events:
        status = _status_of(event.type)
        if status is None:
            continue
        if current is not None:
            spans.append(_span(current[0], event, status=str(current[1])))
        current = (event, status)
    if current is not None:
        spans.append(_span(current[0], events[-1], status=str(current[1]),
                           final=current[1] in TERMINAL))
    return spans


def _steps(events: list[_Event]) -> list[dict[str, Any]]:
    """Steps run from a claim (or the step after a checkpoint) to the next checkpoint."""
    spans: list[dict[str, Any]] = []
    start: _Event | None = None
    for event in events:
        if start is None and (event.type in CLAIMS or event.type == "step_started"):
            start = event
        if event.type == "step_checkpointed":
            label = f"step {event.payload.get('step')}"
            spans.append(_span(start or event, event, label=label,
                               next_action=event.payload.get("next_action")))
            start = None
        elif event.type in ENDINGS and start is not None:
            spans.append(_span(start, event, label="last step", next_action=None))
            start = None
    if start is not None:
        spans.append(_span(start, events[-1], label="step in progress", next_action=None,
                           open=True))
    return spans


_OUTCOMES: Final = {"tool_call_completed": "ok", "llm_call_completed": "ok",
                    "tool_call_failed": "failed", "llm_call_failed": "failed",
                    "tool_call_uncertain": "uncertain"}


def _calls(events: list[_Event]) -> list[dict[str, Any]]:
    """Each attempt of each tool or LLM call: intent to outcome, with its duration."""
    attempts: list[dict[str, Any]] = []
    open_by_call: dict[str, tuple[_Event, dict[str, Any]]] = {}
    for event in events:
        call_id = event.payload.get("call_id")
        if event.type in ("tool_call_intended", "llm_call_intended"):
            previous = open_by_call.pop(str(call_id), None)
            if previous is not None:
                attempts.append(_attempt(previous, event, "in doubt"))
            kind = "tool" if event.type.startswith("tool") else "llm"
            name = event.payload.get("tool") or event.payload.get("model")
            open_by_call[str(call_id)] = (event, {
                "call_id": call_id, "kind": kind, "name": name,
                "attempt": event.payload.get("attempt", 1)})
        elif event.type in _OUTCOMES and str(call_id) in open_by_call:
            opened = open_by_call.pop(str(call_id))
            outcome = _OUTCOMES[event.type]
            if outcome == "failed" and event.payload.get("retryable"):
                outcome = "retrying"
            attempts.append(_attempt(opened, event, outcome))
    for opened in open_by_call.values():
        attempts.append(_attempt(opened, events[-1], "in doubt", open_end=True))
    attempts.sort(key=lambda a: a["start"]["seq"])
    return attempts


def _attempt(opened: tuple[_Event, dict[str, Any]], end: _Event, outcome: str,
             open_end: bool = False) -> dict[str, Any]:
    start, fields = opened
    extra: dict[str, Any] = {}
    if end.type == "llm_call_completed" and end.tokens is not None:
        extra["tokens"] = end.tokens
    if outcome in ("failed", "retrying"):
        extra["error"] = end.payload.get("error_type")
    if end.epoch != start.epoch and not open_end:
        # The worker that made the intent lost the task before the outcome: the call was in
        # doubt until another lease (epoch) resolved it.
        extra["epochs"] = [start.epoch, end.epoch]
    return _span(start, end, **fields, **extra, outcome=outcome, open=open_end,
                 duration_ms=round(end.t - start.t, 3))


_WAIT_OPENERS: Final = {"timer_started": ("timer", "timer_id"),
                        "signal_awaited": ("signal", "name"),
                        "approval_requested": ("approval", "call_id")}
_WAIT_CLOSERS: Final = {"timer_fired": ("timer", "timer_id"),
                        "signal_received": ("signal", "name"),
                        "approval_decided": ("approval", "call_id")}


def _waits(events: list[_Event]) -> list[dict[str, Any]]:
    """Durable timers, signal waits and approvals, from their start to what ended them."""
    spans: list[dict[str, Any]] = []
    waiting: dict[tuple[str, str], _Event] = {}
    for event in events:
        opener = _WAIT_OPENERS.get(event.type)
        closer = _WAIT_CLOSERS.get(event.type)
        if opener is not None:
            waiting[(opener[0], str(event.payload.get(opener[1])))] = event
        elif closer is not None:
            key = (closer[0], str(event.payload.get(closer[1])))
            start = waiting.pop(key, None)
            if start is not None:
                spans.append(_span(start, event, kind=key[0], name=_wait_name(*key),
                                   outcome=_wait_outcome(event),
                                   duration_ms=round(event.t - start.t, 3)))
    for (kind, name), start in waiting.items():
        spans.append(_span(start, events[-1], kind=kind, name=_wait_name(kind, name),
                           outcome="waiting", open=True,
                           duration_ms=round(events[-1].t - start.t, 3)))
    spans.sort(key=lambda s: s["start"]["seq"])
    return spans


def _wait_name(kind: str, name: str) -> str:
    if name.startswith("~retry:"):
        return "retry backoff " + name.removeprefix("~retry:")
    return f"{kind} {name.removeprefix('~')}"


def _wait_outcome(event: _Event) -> str:
    if event.type == "approval_decided":
        return "approved" if event.payload.get("approved") else "refused"
    return "done"


def _budget(head: TaskHead | None, events: list[_Event], usage: UsageFold) -> dict[str, Any]:
    """Cumulative use after each event that changed it (from the fold), and the limits."""
    limits = usage.limits
    if limits is None:  # The fold never reached task_submitted: the head's copy.
        limits = {k: v for k, v in (head.budget if head else {}).items() if v is not None}
    series: list[dict[str, Any]] = []
    trips: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for event in events:
        if event.trip is not None:
            trips.append({**_at(event), "budget": event.trip.budget, "limit": event.trip.limit,
                          "used": event.trip.used})
        if event.used is not None and (event.used != previous or not series):
            series.append({**_at(event), **event.used})
            previous = event.used
    return {"limits": limits, "series": series, "trips": trips,
            "fold_stopped": usage.stopped}


def _marker(event: _Event) -> dict[str, Any]:
    payload = event.payload
    labels = {
        "task_claimed": f"claimed by {payload.get('worker_id')} (epoch {event.epoch})",
        "task_resumed": f"resumed by {payload.get('worker_id')} (epoch {event.epoch})",
        "task_orphaned": f"orphaned: {payload.get('previous_owner')} stopped renewing "
                         f"epoch {payload.get('previous_epoch')}",
        "task_released": f"released: {payload.get('reason')}",
        "task_woken": f"woken: {payload.get('reason')}",
        "task_forked": f"forked from {payload.get('parent_task_id')} at seq "
                       f"{payload.get('parent_seq')}",
        "task_completed": "completed",
        "task_failed": f"failed: {payload.get('reason')}",
        "task_cancelled": f"cancelled: {payload.get('reason')}",
        "budget_exceeded": f"budget {payload.get('budget')} exceeded",
    }
    return {**_at(event), "kind": event.type, "label": labels.get(event.type, event.type)}
