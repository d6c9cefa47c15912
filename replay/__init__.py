"""The pure half of wal-engine: fold a task's log into its state, and check code against it.

Nothing here does I/O, reads a clock, draws randomness or logs: ``replay`` imports only
msgspec, the standard library and the pure modules of ``wal_engine`` (events, state
machine, payloads, errors, ids, limits). A test checks that importing it loads no asyncpg.

* :mod:`replay.state`: :class:`AgentState`, the checkpoint content.
* :mod:`replay.fold`: :func:`fold`, :func:`apply`, :class:`StateBuilder` (strict, total).
* :mod:`replay.upcasting`: lifting stored payloads of old event versions.
* :mod:`replay.snapshot`: :func:`encode_state` / :func:`decode_state` (the whole state as one
  msgpack blob); ``encode_snapshot`` / ``decode_snapshot`` (segmented, as stored).
* :mod:`replay.journal`: the journal cursor matching re-run code to recorded calls.
* :mod:`replay.divergence`: :class:`NonDeterminismError`.
"""

from replay.divergence import CallSignature, NonDeterminismError
from replay.fold import FoldItem, StateBuilder, StoredEvent, apply, fold
from replay.journal import Fresh, InDoubt, Journal, Outcome, Recorded, Retry
from replay.snapshot import STATE_FORMAT, decode_state, encode_state
from replay.state import (
    AgentState,
    Approval,
    BudgetTrip,
    CallError,
    CallKind,
    CallRecord,
    CallStatus,
    Failure,
    Usage,
    Wait,
    args_hash,
    initial_state,
)
from replay.upcasting import UpcasterRegistry, decode_record, upcasters

__all__ = [
    "STATE_FORMAT",
    "AgentState",
    "Approval",
    "BudgetTrip",
    "CallError",
    "CallKind",
    "CallRecord",
    "CallSignature",
    "CallStatus",
    "Failure",
    "FoldItem",
    "Fresh",
    "InDoubt",
    "Journal",
    "NonDeterminismError",
    "Outcome",
    "Recorded",
    "Retry",
    "StateBuilder",
    "StoredEvent",
    "UpcasterRegistry",
    "Usage",
    "Wait",
    "apply",
    "args_hash",
    "decode_record",
    "decode_state",
    "encode_state",
    "fold",
    "initial_state",
    "upcasters",
]
