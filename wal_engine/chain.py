"""The per-task hash chain (pure): how an event's hash is computed and how a chain is checked.

``hash_n = sha256(hash_{n-1} || header || payload)`` where ``payload`` is the exact stored
bytes of the event's payload (``bytea``) and ``header`` depends on the row's chain version:

* version 1: the UTF-8 text ``"{task_id}\\n{seq}\\n{type}\\n{version}\\n{epoch}\\n"``;
* version 2 (:func:`event_hash_v2`) also covers ``recorded_at`` (microseconds since the Unix
  epoch) and the idempotency key, each free-text field length-prefixed:
  ``"2\\n{len}:{task_id}\\n{seq}\\n{len}:{type}\\n{version}\\n{epoch}\\n{µs}\\n{len}:{key}|-\\n"``;
* version 3 (decision 71) hashes what version 2 does, tagged ``3``; its rows store the
  idempotency key only when it is not the intent's own (:func:`stored_key`), and the
  key the hash covers is the derived one (:func:`effective_key`).

``payload`` is the row's content: a row stored as a zstd frame (``wal_engine.blobs``,
decision 71) is hashed as the bytes it decompresses to. A row does not store its
predecessor's hash (schema version 5): ``hash_{n-1}`` is the previous row's stored hash.

The genesis ``hash_0`` is 32 zero bytes. The same functions exist in SQL (``wal_event_hash``
and ``wal_event_hash_v2`` in ``schema.sql``) for events the database writes itself (claims,
orphaning); a test checks that they agree.

Because the hash covers stored bytes, never a re-encoding, :func:`verify_records` can
recompute every chain from the rows alone (DESIGN.md invariant 4).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Iterable
from typing import Final, Protocol

import msgspec

from wal_engine.errors import WalError
from wal_engine.ids import idempotency_key as intent_key
from wal_engine.state_machine import TERMINAL, Status, is_legal

GENESIS_HASH: Final = bytes(32)

CHAIN_VERSION: Final = 3
"""The chain version the engine writes; rows of versions 1 and 2 still verify under theirs
(the database's own events are written as version 2 by ``wal_emit``)."""

KEYED_EVENT_TYPES: Final = frozenset({"tool_call_intended", "llm_call_intended"})
"""The events that carry an idempotency key (a test checks them against the vocabulary)."""

EPOCH_EVENT_TYPES: Final = frozenset({"task_claimed", "task_resumed", "task_orphaned",
                                      "task_cancelled"})
"""The events that change a task's lease epoch (each by one); the database writes them."""

_UNIX_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_MICROSECOND: Final = dt.timedelta(microseconds=1)


def microseconds(stamp: dt.datetime) -> int:
    """``stamp`` as whole microseconds since the Unix epoch (exact: PostgreSQL's precision)."""
    return (stamp - _UNIX_EPOCH) // _MICROSECOND


def event_hash(
    prev_hash: bytes,
    task_id: str,
    seq: int,
    event_type: str,
    version: int,
    epoch: int,
    payload: bytes,
) -> bytes:
    """Return the chain hash of one event."""
    digest = hashlib.sha256(prev_hash)
    digest.update(f"{task_id}\n{seq}\n{event_type}\n{version}\n{epoch}\n".encode())
    digest.update(payload)
    return digest.digest()


def _framed_hash(tag: bytes, prev_hash: bytes, task_id: str, seq: int, event_type: str,
                 version: int, epoch: int, recorded_at: dt.datetime,
                 idempotency_key: str | None, payload: bytes) -> bytes:
    """The chain hash of versions 2 and 3, which differ only by their leading tag: every
    free-text field length-prefixed, the time in microseconds, then the payload."""
    task = task_id.encode()
    kind = event_type.encode()
    key = b"-" if idempotency_key is None else \
        b"%d:%s" % (len(idempotency_key.encode()), idempotency_key.encode())
    digest = hashlib.sha256(prev_hash)
    digest.update(b"%s\n%d:%s\n%d\n%d:%s\n%d\n%d\n%d\n%s\n" % (
        tag, len(task), task, seq, len(kind), kind, version, epoch, microseconds(recorded_at),
        key))
    digest.update(payload)
    return digest.digest()


def event_hash_v2(
    prev_hash: bytes,
    task_id: str,
    seq: int,
    event_type: str,
    version: int,
    epoch: int,
    recorded_at: dt.datetime,
    idempotency_key: str | None,
    payload: bytes,
) -> bytes:
    """Return the chain hash (version 2) of one event: also covers the time and the key."""
    return _framed_hash(b"2", prev_hash, task_id, seq, event_type, version, epoch,
                        recorded_at, idempotency_key, payload)


def event_hash_v3(
    prev_hash: bytes,
    task_id: str,
    seq: int,
    event_type: str,
    version: int,
    epoch: int,
    recorded_at: dt.datetime,
    idempotency_key: str | None,
    payload: bytes,
) -> bytes:
    """Return the chain hash (version 3) of one event: version 2's, tagged ``3``; the key is
    the event's own (:func:`effective_key`), whether or not its row stores it."""
    return _framed_hash(b"3", prev_hash, task_id, seq, event_type, version, epoch,
                        recorded_at, idempotency_key, payload)


def stored_key(task_id: str, seq: int, event_type: str, key: str | None) -> str | None:
    """What a row of chain version 3 stores of its event's idempotency key: ``''`` for none
    and for an intent's own key (``idem:<task>:<seq>``, derived on read), else the key (a
    retry's intent reuses its call's first key). ``''`` rather than NULL: a row with no NULL
    column has no null bitmap (8 bytes a row)."""
    if key is None:
        return "" if event_type not in KEYED_EVENT_TYPES else None
    if event_type in KEYED_EVENT_TYPES and key == intent_key(task_id, seq):
        return ""
    return key


def effective_key(chain_version: int, task_id: str, seq: int, event_type: str,
                  stored: str | None) -> str | None:
    """The idempotency key of a stored row (the inverse of :func:`stored_key`; rows of
    versions 1 and 2 store theirs as it is). ``wal_event_key`` in schema.sql is the same."""
    if chain_version < 3 or stored != "":
        return stored
    return intent_key(task_id, seq) if event_type in KEYED_EVENT_TYPES else None


def row_hash(prev_hash: bytes, row: ChainRow) -> bytes:
    """Recompute a stored row's hash under its own chain version."""
    version = getattr(row, "chain_version", 1)
    # A row whose large values live in wal_blobs: the hash covers its own bytes (their
    # digests), not the expanded payload.
    payload = getattr(row, "row_payload", None) or row.payload
    if version in (2, 3):
        recorded_at = getattr(row, "recorded_at", None)
        if recorded_at is None:
            return b""  # A row of version 2 or 3 without its time cannot be checked: it fails.
        function = event_hash_v2 if version == 2 else event_hash_v3
        return function(prev_hash, row.task_id, row.seq, row.type, row.version, row.epoch,
                        recorded_at, getattr(row, "idempotency_key", None), payload)
    if version != 1:
        return b""
    return event_hash(prev_hash, row.task_id, row.seq, row.type, row.version, row.epoch,
                      payload)


class StoredEvent(Protocol):
    """A stored event row as the store returns it (``wal_engine.store.EventRecord``): what
    reading it needs (``replay.fold`` folds such rows)."""

    @property
    def seq(self) -> int: ...
    @property
    def type(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def hash(self) -> bytes: ...


class ChainRow(StoredEvent, Protocol):
    """What verification needs of a stored event row: the row and its links in the chain."""

    @property
    def task_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """The first thing wrong with a task's log."""

    seq: int
    kind: str
    """One of: gap, hash, epoch, unknown_type, transition, head; and, from the
    semantic checks (:mod:`wal_engine.verification`): after_terminal, semantics (the event
    is impossible where it stands, or its payload does not decode into its type), seq (a
    row outside 1..head), orphan (events of a task with no task row); blob (a large value
    the event refers to is missing, altered or malformed in ``wal_blobs``)."""
    detail: str


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of verifying one task's chain."""

    task_id: str
    events: int
    head_seq: int
    head_hash: bytes
    violation: Violation | None = None

    @property
    def ok(self) -> bool:
        """Whether the chain, the seqs and the transitions all check out."""
        return self.violation is None


class ChainVerifier:
    """Incremental verifier: feed rows in seq order, read the first violation.

    Checks contiguous seqs from 1, the recomputed hash (under each row's chain version, from
    the previous row's hash: what links each row to its predecessor), epochs (never
    decreasing, changed only by the events that take or break a lease, by one), nothing
    after a terminal event, and legal status moves. Stops checking at the first violation.
    """

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.events = 0
        self.last_seq = 0
        self.last_hash = GENESIS_HASH
        self.last_epoch = 0
        self.status: Status | None = None
        self.violation: Violation | None = None

    def feed(self, row: ChainRow) -> bool:
        """Check one row; return False once a violation has been found."""
        if self.violation is not None:
            return False
        self.violation = self._check(row)
        if self.violation is None:
            self.events += 1
            self.last_seq = row.seq
            self.last_hash = row.hash
            self.last_epoch = row.epoch
        return self.violation is None

    def _check(self, row: ChainRow) -> Violation | None:
        seq = row.seq
        if seq != self.last_seq + 1:
            return Violation(seq=self.last_seq + 1, kind="gap", detail=f"next stored seq is {seq}")
        if row.task_id != self.task_id or row_hash(self.last_hash, row) != row.hash:
            return Violation(seq=seq, kind="hash", detail="stored hash does not match content")
        if self.status in TERMINAL:
            return Violation(seq=seq, kind="after_terminal",
                             detail=f"{row.type} after the terminal status {self.status}")
        return self._check_epoch(row) or self._check_transition(row)

    def _check_epoch(self, row: ChainRow) -> Violation | None:
        epoch, last = row.epoch, self.last_epoch
        if epoch < last:
            return Violation(seq=row.seq, kind="epoch", detail=f"epoch {epoch} after {last}")
        if epoch > last and (row.type not in EPOCH_EVENT_TYPES or epoch != last + 1):
            return Violation(seq=row.seq, kind="epoch",
                             detail=f"epoch {last} -> {epoch} at {row.type}; only a claim, "
                                    f"resume, orphaning or cancellation moves it, by one")
        return None

    def _check_transition(self, row: ChainRow) -> Violation | None:
        from wal_engine.events import target_status  # local: events imports this module's deps

        try:
            target = target_status(row.type)
        except WalError:
            return Violation(seq=row.seq, kind="unknown_type", detail=f"type {row.type!r}")
        if target is None:
            return None
        if self.status is None:
            legal = row.seq == 1 and target is Status.QUEUED
        else:
            legal = is_legal(self.status, target)
        if not legal:
            return Violation(
                seq=row.seq, kind="transition", detail=f"{self.status} -> {target}"
            )
        self.status = target
        return None

    def report(self, head_seq: int | None = None, head_hash: bytes | None = None) -> VerifyReport:
        """Finish: optionally compare with the task head (catches a truncated tail)."""
        violation = self.violation
        if violation is None and head_seq is not None and head_seq != self.last_seq:
            violation = Violation(
                seq=min(head_seq, self.last_seq) + 1,
                kind="head",
                detail=f"head says seq {head_seq}, log ends at {self.last_seq}",
            )
        if violation is None and head_hash is not None and head_hash != self.last_hash:
            violation = Violation(seq=self.last_seq, kind="head", detail="head hash differs")
        return VerifyReport(
            task_id=self.task_id,
            events=self.events,
            head_seq=self.last_seq,
            head_hash=self.last_hash,
            violation=violation,
        )


def verify_records(task_id: str, rows: Iterable[ChainRow]) -> VerifyReport:
    """Verify a whole chain held in memory."""
    verifier = ChainVerifier(task_id)
    for row in rows:
        if not verifier.feed(row):
            break
    return verifier.report()
