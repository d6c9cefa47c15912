"""What the store returns: event rows and task heads (plain data)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from wal_engine import events as vocabulary
from wal_engine.state_machine import Status


class EventRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One stored row of ``wal_events``, payload still encoded."""

    task_id: str
    seq: int
    type: str
    version: int
    epoch: int
    payload: bytes
    """The event's full canonical encoding: its large values put back (decision 61)."""
    idempotency_key: str | None
    """The event's key (an intent's), derived when its row of chain version 3 leaves it out
    (``wal_engine.chain.effective_key``, decision 71)."""
    hash: bytes
    recorded_at: dt.datetime | None = None
    chain_version: int = 1
    """How ``hash`` was computed (``wal_engine.chain``): 2 and 3 also cover ``recorded_at``
    and ``idempotency_key``."""
    row_payload: bytes | None = None
    """The row's own bytes when they differ from ``payload`` (the event has large values in
    ``wal_blobs``, referenced by digest): what the chain hash covers."""

    payload_cut: bool = False
    """Set on the last record of a page of reads that ended early so that it would not
    hold too many bytes of large values (``limits.blob_page_value_bytes_max``)."""

    @property
    def stored_payload(self) -> bytes:
        """The bytes of the row, the ones the hash covers."""
        return self.payload if self.row_payload is None else self.row_payload

    def decode(self) -> vocabulary.Event:
        """Decode the payload into its event; fails closed on unknown type or version."""
        return vocabulary.decode_event(self.type, self.version, self.payload, self.seq)


class TaskHead(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``wal_tasks``: the head of a task's log and its lease."""

    task_id: str
    agent: str
    status: Status
    head_seq: int
    head_hash: bytes
    lease_owner: str | None
    lease_epoch: int
    lease_expires_at: dt.datetime | None
    wake_at: dt.datetime | None
    waiting_signal: str | None
    budget: dict[str, Any]
    parent_task_id: str | None
    parent_seq: int | None
    attempts: int
    created_at: dt.datetime
    started_at: dt.datetime | None
    updated_at: dt.datetime
    agent_version: str | None = None
    """The version of the agent code that started the task (None until a claim pins it)."""


class AppendResult(msgspec.Struct, frozen=True, kw_only=True):
    """The head after an accepted append."""

    task_id: str
    first_seq: int
    head_seq: int
    head_hash: bytes
    status: Status | None
    """The status after the append if it moved, else None."""


class PendingAppend(msgspec.Struct, frozen=True, kw_only=True):
    """One task's batch for a group commit (see ``Store.append_many``)."""

    task_id: str
    epoch: int
    expected_seq: int
    prev_hash: bytes
    events: list[vocabulary.Event]
    encoded: list[tuple[str, int, bytes]] | None = None
    """The events already encoded (``events.encode_event``), when the caller validated them."""
    recorded_at: dt.datetime = msgspec.field(default_factory=lambda: dt.datetime.now(dt.UTC))
    """The time stamped on the events (covered by their hash): fixed when the append is made,
    so that an append whose commit was lost is recognised by its hashes."""
