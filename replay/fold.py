"""Fold a task's events into its :class:`~replay.state.AgentState` (pure, strict, total).

``fold(events, start=None)`` and ``apply(state, event)`` are total over the vocabulary and
deterministic: the same events always give equal states whose snapshots are byte-equal.
They are strict: an event that is impossible where it stands raises
:class:`~wal_engine.errors.ReplayError` naming its seq, instead of folding a wrong state.

What is impossible:

* a seq that is not ``last_seq + 1``, or a first event that is not ``task_submitted``;
* any event after a terminal status (COMPLETED, FAILED);
* a status move outside ``state_machine.TRANSITIONS``, and moves the table allows but the
  event cannot make: ``task_claimed`` only from QUEUED, ``task_resumed`` only from
  RESUMING, ``step_started`` only from CHECKPOINTED, ``task_woken`` only from WAITING,
  ``task_orphaned`` and ``task_released`` only while leased (RUNNING, CHECKPOINTED);
* an observation (tool, LLM, message, timer, signal, approval, value, environment, plan)
  while the task is not RUNNING: only the lease holder records observations, and it holds
  the task RUNNING while it acts. ``task_forked`` and ``budget_exceeded`` are accepted in
  any non-terminal status, because they are written from outside a step (a fork, a budget
  check before a claim) and change no status;
* a result, failure or escalation for a call never intended, or for a call that already has
  its outcome; an intent whose call id is taken (unless it is the next attempt of a call
  whose last attempt failed retryably, for the same tool and arguments); a tool intent for a
  call that awaits an approval, was refused, or was approved for other arguments;
* a claim or resume whose attempt number does not grow; a step index that goes back;
* a timer fired that was never started or already fired (starting a timer again under the
  id of one still pending re-arms it); a signal consumed twice;
* a LangGraph checkpoint event (``graph_*``) after a terminal status; these are accepted in
  any other status (a thread's task need not be claimed) and read only by the LangGraph
  integration, which keeps its own view of them;
* a plan whose nodes repeat, depend on unknown nodes or form a cycle; a node completed
  before its dependencies, twice, or outside the plan.

The fast path: :func:`fold` copies the start state's containers once into a private mutable
draft, mutates it event by event and freezes it at the end, so folding n events costs O(n),
not O(n * state), with the cyclic garbage collector paused (see
:func:`replay.snapshot.gc_paused`). :func:`apply` is the same step on a copy (O(state)); a
live runtime that applies its own events one by one keeps a :class:`StateBuilder` instead.

The rule of each event type (the statuses it may be folded in, what it does to the state)
is in :mod:`replay.rules`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from replay.rules import _Draft, _rules
from replay.rules import rule_gaps as rule_gaps
from replay.snapshot import gc_paused
from replay.state import AgentState, _StateFields
from replay.upcasting import UpcasterRegistry, upcasters
from wal_engine import events as ev
from wal_engine.chain import StoredEvent as StoredEvent
from wal_engine.errors import ReplayError
from wal_engine.state_machine import TERMINAL

FoldItem = tuple[int, ev.Event] | tuple[int, ev.Event, bytes] | StoredEvent
"""``(seq, event)``, ``(seq, event, chain hash)``, or a stored row.

Stored rows are decoded through the upcaster registry, so an old version of an event folds
like the current one.
"""


_containers: Final = (
    "messages", "calls", "pending", "plan", "plan_completed", "env", "signal_ids", "approvals",
    "commands", "patches",
)
"""The fields holding lists or dicts: copied when a state is thawed or frozen as a copy."""


def _thaw(state: AgentState) -> _Draft:
    values = msgspec.structs.asdict(state)
    for name in _containers:
        values[name] = values[name].copy()
    return _Draft(**values)


def _freeze(draft: _Draft, *, copy: bool) -> AgentState:
    values = msgspec.structs.asdict(draft)
    if copy:
        for name in _containers:
            values[name] = values[name].copy()
    return AgentState(**values)


# ----------------------------------------------------------------------------- the step


def _step(draft: _Draft, seq: int, event: ev.Event, digest: bytes) -> None:
    """Fold one event into ``draft`` (the checks here are inlined in :func:`_fold_into`)."""
    if seq != draft.last_seq + 1:
        raise _bad_seq(draft, seq)
    rule = _rules.get(type(event))
    if rule is None:
        raise ReplayError(seq, f"{type(event).__name__} is not an event", draft.task_id)
    handler, allowed, target = rule
    if draft.status not in allowed:
        raise _not_allowed(draft, seq, event)
    handler(draft, event, seq)
    if target is not None:
        draft.status = target
    draft.last_seq = seq
    draft.last_hash = digest


def _fold_into(draft: _Draft, items: Iterable[FoldItem], registry: UpcasterRegistry) -> None:
    """The hot loop: decode if needed, check seq and status, dispatch."""
    rules = _rules
    decode = registry.decode_record
    for item in items:
        if isinstance(item, tuple):
            if len(item) == 2:
                seq, event = item
                digest = b""
            else:
                seq, event, digest = item
        else:
            seq = item.seq
            event = decode(item.type, item.version, item.payload, seq)
            digest = item.hash
        if seq != draft.last_seq + 1:
            raise _bad_seq(draft, seq)
        rule = rules.get(type(event))
        if rule is None:
            raise ReplayError(seq, f"{type(event).__name__} is not an event", draft.task_id)
        handler, allowed, target = rule
        if draft.status not in allowed:
            raise _not_allowed(draft, seq, event)
        handler(draft, event, seq)
        if target is not None:
            draft.status = target
        draft.last_seq = seq
        draft.last_hash = digest


def _bad_seq(draft: _Draft, seq: int) -> ReplayError:
    return ReplayError(seq, f"expected seq {draft.last_seq + 1} after {draft.last_seq}",
                       draft.task_id)


def _not_allowed(draft: _Draft, seq: int, event: ev.Event) -> ReplayError:
    kind = ev.event_type(event)
    if draft.status is None:
        return ReplayError(seq, f"the first event must be task_submitted, not {kind}",
                           draft.task_id)
    if draft.status in TERMINAL:
        return ReplayError(seq, f"{kind} after the terminal status {draft.status}", draft.task_id)
    target = type(event).TARGET_STATUS
    if target is None:
        return ReplayError(seq, f"{kind} while {draft.status} (observations need RUNNING)",
                           draft.task_id)
    return ReplayError(seq, f"{kind} cannot move {draft.status} -> {target}", draft.task_id)


# ----------------------------------------------------------------------------- public API


class StateBuilder:
    """Incremental fold for a live runtime: apply events as they are appended.

    Applying is O(1) per event (amortised); :meth:`state` returns a frozen copy.
    """

    def __init__(
        self,
        start: AgentState | None = None,
        *,
        task_id: str = "",
        registry: UpcasterRegistry = upcasters,
    ) -> None:
        self._draft = _thaw(start) if start is not None else _Draft(task_id=task_id)
        self._registry = registry

    @property
    def last_seq(self) -> int:
        """Seq of the latest event folded."""
        return self._draft.last_seq

    @property
    def view(self) -> _StateFields:
        """The state so far without a copy: read it, never mutate it, never keep it.

        For a live runtime's per-command checks (status, step, usage), which must not cost
        a copy of the whole state.
        """
        return self._draft

    def apply(self, event: ev.Event, *, seq: int | None = None, event_hash: bytes = b"") -> None:
        """Fold one event at ``seq`` (default: the next seq); raises ReplayError."""
        draft = self._draft
        _step(draft, draft.last_seq + 1 if seq is None else seq, event, event_hash)

    def extend(self, items: Iterable[FoldItem]) -> None:
        """Fold many events (see :func:`fold`)."""
        with gc_paused():
            _fold_into(self._draft, items, self._registry)

    def state(self) -> AgentState:
        """The state so far, as an independent frozen copy."""
        return _freeze(self._draft, copy=True)

    def finish(self) -> AgentState:
        """The state so far, without a copy; the builder must not be used afterwards."""
        state = _freeze(self._draft, copy=False)
        del self._draft
        return state


def fold(
    events: Iterable[FoldItem],
    start: AgentState | None = None,
    *,
    task_id: str = "",
    registry: UpcasterRegistry = upcasters,
) -> AgentState:
    """Fold ``events`` onto ``start`` (or onto the empty state of ``task_id``).

    Args:
        events: ``(seq, event)`` or ``(seq, event, hash)`` pairs, or stored rows
            (:class:`StoredEvent`), in seq order, starting right after ``start.last_seq``.
        start: A state to continue from (a snapshot); it is not modified.
        task_id: The task id of the empty start state (ignored when ``start`` is given).
        registry: The upcasters that stored rows of old versions are read through.

    Returns:
        The state after the last event.

    Raises:
        ReplayError: an event is impossible where it stands (see the module docstring).
        UnknownEventType, UnknownEventVersion, UndecodableEvent: a stored row cannot be read.
    """
    draft = _thaw(start) if start is not None else _Draft(task_id=task_id)
    with gc_paused():
        _fold_into(draft, events, registry)
    return _freeze(draft, copy=False)


def apply(
    state: AgentState, event: ev.Event, *, seq: int | None = None, event_hash: bytes = b""
) -> AgentState:
    """Return the state after ``event`` at ``seq`` (default ``state.last_seq + 1``).

    ``state`` is not modified. Costs a copy of the state's containers; use :func:`fold` or
    :class:`StateBuilder` for many events.
    """
    draft = _thaw(state)
    _step(draft, state.last_seq + 1 if seq is None else seq, event, event_hash)
    return _freeze(draft, copy=False)
