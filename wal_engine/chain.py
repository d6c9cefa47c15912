"""The per-task hash chain (pure): how an event's hash is computed and how a chain is checked.

``hash_n = sha256(hash_{n-1} || header || payload)`` where ``header`` is the UTF-8 text
``"{task_id}\\n{seq}\\n{type}\\n{version}\\n{epoch}\\n"`` and ``payload`` is the exact stored
bytes of the event's payload (``bytea``). The genesis ``hash_0`` is 32 zero bytes. The same
function exists in SQL (``wal_event_hash`` in ``schema.sql``) for events the database writes
itself (claims, orphaning); a test checks that the two agree.

Because the hash covers stored bytes, never a re-encoding, :func:`verify_records` can
recompute every chain from the rows alone (DESIGN.md invariant 4).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final, Protocol

import msgspec

from wal_engine.errors import WalError
from wal_engine.state_machine import Status, is_legal

GENESIS_HASH: Final = bytes(32)


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
    @property
    def prev_hash(self) -> bytes: ...


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """The first thing wrong with a task's log."""

    seq: int
    kind: str
    """One of: gap, prev_hash, hash, epoch, unknown_type, transition, head."""
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

    Checks contiguous seqs from 1, ``prev_hash`` linkage, the recomputed hash, monotonic
    epochs and legal status moves. Stops checking at the first violation.
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
        if row.prev_hash != self.last_hash:
            return Violation(seq=seq, kind="prev_hash", detail="prev_hash does not link")
        recomputed = event_hash(
            self.last_hash, self.task_id, seq, row.type, row.version, row.epoch, row.payload
        )
        if recomputed != row.hash:
            return Violation(seq=seq, kind="hash", detail="stored hash does not match content")
        if row.epoch < self.last_epoch:
            return Violation(
                seq=seq, kind="epoch", detail=f"epoch {row.epoch} after {self.last_epoch}"
            )
        return self._check_transition(row)

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
