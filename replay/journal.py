"""The journal cursor: re-running agent code against its recorded external calls (pure).

After a resume the agent code runs again from the top. Each external call it makes (tool,
LLM, journaled value, durable sleep, signal wait) asks the cursor first, with the call's
kind, name and args hash (:func:`args_hash`). The k-th call is matched against the k-th
recorded one (``AgentState.calls`` keeps them in the order of their first intent):

* same kind, name and args hash, outcome recorded: :class:`Recorded` (the result, or the
  final error); nothing is called;
* same call, intent recorded without an outcome: :class:`InDoubt`. For a tool or LLM call
  the crash fell between intent and result: retry it with the recorded idempotency key, or
  escalate it when the tool is not idempotent (``escalated`` is set once that was recorded).
  For a timer or signal wait it means "started, not yet over": wait on, until
  ``due_at_ms`` for a timer;
* same call, last attempt failed and another is scheduled: :class:`Retry`;
* past the last recorded call: :class:`Fresh` with a deterministic call id;
* anything else raises :class:`~replay.divergence.NonDeterminismError`: another kind, name
  or args hash; a call past the end of a finished (terminal) history; and, from
  :meth:`Journal.finish`, recorded calls the code never asked for.

Args hashes: tools use ``args_hash(args)``, LLM calls ``args_hash(request)``, timers
``args_hash(duration_ms)``; values (name = the value kind) and signal waits (name = the
signal name) use ``""``.

Names are recorded redacted (a tool named after a token must not store the token): given a
``name_form`` (the runtime's redactor, remembered per name), the cursor compares a recorded
name with the form of the name the code asks for, and errors show that form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from replay.divergence import CallSignature, NonDeterminismError
from replay.fold import FoldItem, fold
from replay.state import AgentState, CallError, CallKind, CallRecord, CallStatus, args_hash

__all__ = [
    "Fresh",
    "InDoubt",
    "Journal",
    "Outcome",
    "Recorded",
    "Retry",
    "args_hash",
]


class Recorded(msgspec.Struct, frozen=True, kw_only=True):
    """The call has its outcome in the log: return it, call nothing."""

    call_id: str
    seq: int
    result: Any = None
    error: CallError | None = None
    """Set when the call failed for good: raise it again in the agent code."""


class InDoubt(msgspec.Struct, frozen=True, kw_only=True):
    """Intended (or started) without an outcome: retry with the same key, or keep waiting."""

    call_id: str
    seq: int
    """Seq of the latest intent of the call."""
    idempotency_key: str | None
    idempotent: bool = True
    escalated: bool = False
    """A non-idempotent call already escalated (``tool_call_uncertain``): never re-run it."""
    attempt: int = 1
    due_at_ms: int | None = None
    """For a timer: when it fires."""


class Retry(msgspec.Struct, frozen=True, kw_only=True):
    """The latest attempt failed and another is due: record a new intent, same key."""

    call_id: str
    seq: int
    attempt: int
    """The attempt to make next."""
    idempotency_key: str | None
    due_at_ms: int | None


class Fresh(msgspec.Struct, frozen=True, kw_only=True):
    """Nothing recorded for this call yet: record the intent, then act."""

    call_id: str


Outcome = Recorded | InDoubt | Retry | Fresh


class Journal:
    """Cursor over a task's recorded external calls, in order."""

    def __init__(
        self,
        calls: Iterable[CallRecord],
        *,
        end_seq: int,
        closed: bool,
        task_id: str | None = None,
        name_form: Callable[[str], str] | None = None,
    ) -> None:
        """Build a cursor.

        Args:
            calls: The recorded calls in order of first intent.
            end_seq: Seq of the last recorded event.
            closed: Whether the history is finished (terminal): no call may follow.
            task_id: Names the task in errors.
            name_form: A name as the log records it (the runtime's redactor): names are
                stored redacted, so the name the code asks for is compared in that form.
                A history that holds the name as given (recorded before names were
                redacted, or with redaction off) matches too. None: names as given.
        """
        self._calls = list(calls)
        self._name_form = name_form
        self._ids = {record.call_id for record in self._calls}
        self._position = 0
        self.end_seq = end_seq
        self.closed = closed
        self.task_id = task_id

    @classmethod
    def from_state(cls, state: AgentState) -> Journal:
        """The cursor over the calls of a folded state."""
        return cls(state.calls.values(), end_seq=state.last_seq, closed=state.terminal,
                   task_id=state.task_id or None)

    @classmethod
    def from_events(cls, events: Iterable[FoldItem], *, task_id: str = "") -> Journal:
        """Fold ``events`` and return the cursor over their calls."""
        return cls.from_state(fold(events, task_id=task_id))

    @property
    def position(self) -> int:
        """How many calls the code has made so far."""
        return self._position

    @property
    def remaining(self) -> int:
        """Recorded calls not yet asked for."""
        return max(0, len(self._calls) - self._position)

    def next_call(self, kind: CallKind | str, name: str, args_hash: str = "") -> Outcome:
        """Match the code's next external call against the next recorded one.

        Raises:
            NonDeterminismError: the call differs from the recorded one, or the history is
                finished and records no further call.
        """
        index = self._position
        given = name
        if self._name_form is not None:
            name = self._name_form(name)
        requested = CallSignature(kind=str(kind), name=name, args_hash=args_hash)
        if index >= len(self._calls):
            if self.closed:
                raise NonDeterminismError(
                    seq=self.end_seq, recorded=None, requested=requested,
                    fork_point=self.end_seq - 1, call_index=index, task_id=self.task_id,
                )
            self._position += 1
            return Fresh(call_id=self._fresh_id(str(kind), index))
        record = self._calls[index]
        if (record.kind != requested.kind or record.args_hash != args_hash
                or (record.name != name and record.name != given)):
            raise NonDeterminismError(
                seq=record.seq, recorded=_signature(record), requested=requested,
                fork_point=record.seq - 1, call_index=index, task_id=self.task_id,
            )
        self._position += 1
        return _outcome(record)

    def finish(self) -> None:
        """Check, when the code is done, that it asked for every recorded call.

        Raises:
            NonDeterminismError: recorded calls remain (the code made fewer calls).
        """
        if self._position < len(self._calls):
            record = self._calls[self._position]
            raise NonDeterminismError(
                seq=record.seq, recorded=_signature(record), requested=None,
                fork_point=record.seq - 1, call_index=self._position, task_id=self.task_id,
            )

    def _fresh_id(self, kind: str, index: int) -> str:
        """A call id from the call's position: the same on every run of the same code."""
        call_id = f"{kind}-{index}"
        suffix = 0
        while call_id in self._ids:
            suffix += 1
            call_id = f"{kind}-{index}.{suffix}"
        self._ids.add(call_id)
        return call_id


def _signature(record: CallRecord) -> CallSignature:
    return CallSignature(kind=str(record.kind), name=record.name, args_hash=record.args_hash)


def _outcome(record: CallRecord) -> Outcome:
    status = record.status
    if status is CallStatus.COMPLETED:
        return Recorded(call_id=record.call_id, seq=record.seq, result=record.result)
    if status is CallStatus.FAILED:
        return Recorded(call_id=record.call_id, seq=record.seq, error=record.error)
    if status is CallStatus.RETRYING:
        return Retry(
            call_id=record.call_id, seq=record.retry_seq or record.seq,
            attempt=record.attempt + 1, idempotency_key=record.idempotency_key,
            due_at_ms=record.due_at_ms,
        )
    return InDoubt(
        call_id=record.call_id, seq=record.retry_seq or record.seq,
        idempotency_key=record.idempotency_key, idempotent=record.idempotent,
        escalated=status is CallStatus.UNCERTAIN, attempt=record.attempt,
        due_at_ms=record.due_at_ms,
    )
