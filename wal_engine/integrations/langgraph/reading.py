"""Read side of the saver: checkpoint rows -> LangGraph ``CheckpointTuple`` objects.

A checkpoint event stores the channel values that changed (``values``) and, for every other
channel with a value, the seq of the earlier event holding it (``refs``). Every read query
returns, with each checkpoint, exactly those referenced events and the checkpoint's writes
events, so a read is one round trip whatever the thread's length.

A :data:`ChannelMap` (channel -> (version key, seq of the event holding the value)) is what a
``put`` needs of its parent to store only what changed; reads hand it to the saver's cache.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    PendingWrite,
    writes_sort_key,
)
from langgraph.checkpoint.serde.types import TASKS

from wal_engine import blobs
from wal_engine import events as vocabulary
from wal_engine.errors import CorruptionError
from wal_engine.integrations.langgraph.codec import ValueCodec, restore_big_ints, version_key
from wal_engine.store.blob_reads import expand_payloads

if TYPE_CHECKING:
    from wal_engine.store import Database

Expanded = Mapping[bytes, bytes]
"""Row bytes -> full payload, for the rows of a read that hold large values in ``wal_blobs``
(decision 61): their channel values and writes, put back before decoding."""

writes_events_max: Final = 10_000
"""Most ``graph_writes_saved`` events read for one checkpoint."""

ChannelMap = dict[str, tuple[str, int]]
"""Channel -> (version key, seq of the event whose ``values`` holds that version's value)."""


@dataclass(slots=True)
class StoredCheckpoint:
    """One checkpoint: its decoded event, the entries of all its values, its writes."""

    task_id: str
    thread_id: Any
    seq: int
    event: vocabulary.GraphCheckpointSaved
    writes: list[vocabulary.GraphWritesSaved]
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Channel -> stored entry (``{"v": version, ...encoded value}``)."""
    sources: dict[str, int] = field(default_factory=dict)
    """Channel -> seq of the event the entry was read from."""

    def channel_map(self) -> ChannelMap:
        """Where each of this checkpoint's values is stored (for a child's ``put``)."""
        return {channel: (version_key(entry.get("v")), self.sources[channel])
                for channel, entry in self.entries.items()}


def decode_checkpoint(version: int, payload: bytes, seq: int) -> vocabulary.GraphCheckpointSaved:
    """A stored ``graph_checkpoint_saved`` payload (fails closed on unknown versions)."""
    event = vocabulary.decode_event("graph_checkpoint_saved", version, payload, seq)
    assert isinstance(event, vocabulary.GraphCheckpointSaved)
    return event


def _payloads(row: Any) -> list[bytes]:
    """Every payload of a checkpoint row: its event's, its refs' and its writes'."""
    return [row["payload"], *(payload for _seq, _version, payload in row["refs"]),
            *(payload for _seq, _version, payload in row["writes"])]


async def expand_rows(database: Database, rows: Sequence[Any],
                      columns: tuple[str, ...] = ()) -> Expanded:
    """The full payloads of the rows' payloads that hold large values (no round trip when
    none does; else a page of chunks per round trip and task). ``columns``: the payload
    column of plain rows; by default checkpoint rows (event, refs, writes)."""
    by_task: dict[str, list[bytes]] = {}
    for row in rows:
        found = [row[name] for name in columns] if columns else _payloads(row)
        held = [payload for payload in found if payload.startswith(blobs.ROW_PREFIX)]
        if held:
            by_task.setdefault(row["task_id"], []).extend(held)
    expanded: dict[bytes, bytes] = {}
    for task_id, payloads in by_task.items():
        expanded.update(await expand_payloads(database, task_id, payloads))
    return expanded


def decode_row(row: Any, thread_id: Any, expanded: Expanded | None = None) -> StoredCheckpoint:
    """A checkpoint row of a read query, its values resolved through its refs (``expanded``:
    the full payloads of its rows that hold large values, :func:`expand_rows`)."""
    full = (lambda payload: payload) if not expanded else (
        lambda payload: expanded.get(payload, payload))
    seq = int(row["seq"])
    event = decode_checkpoint(row["version"], full(row["payload"]), seq)
    stored = StoredCheckpoint(task_id=row["task_id"], thread_id=thread_id, seq=seq,
                              event=event, writes=[])
    for channel, entry in event.values.items():
        stored.entries[channel] = entry
        stored.sources[channel] = seq
    holders = {int(ref_seq): decode_checkpoint(ref_version, full(ref_payload), ref_seq)
               for ref_seq, ref_version, ref_payload in row["refs"]}
    for channel, ref_seq in event.refs.items():
        holder = holders.get(ref_seq)
        entry = None if holder is None else holder.values.get(channel)
        if entry is None:
            raise CorruptionError(
                f"checkpoint at seq {seq} of task {row['task_id']!r} refers channel "
                f"{channel!r} to seq {ref_seq}, which does not hold it"
            )
        stored.entries[channel] = entry
        stored.sources[channel] = ref_seq
    for write_seq, write_version, write_payload in row["writes"]:
        stored.writes.append(decode_writes(write_version, full(write_payload), write_seq))
    return stored


def decode_writes(version: int, payload: bytes, seq: int) -> vocabulary.GraphWritesSaved:
    """A stored ``graph_writes_saved`` payload (fails closed on unknown versions)."""
    event = vocabulary.decode_event("graph_writes_saved", version, payload, seq)
    assert isinstance(event, vocabulary.GraphWritesSaved)
    return event


def parent_map(seq: int, version: int, payload: bytes) -> ChannelMap:
    """The channel map of a checkpoint from its own event alone (``READ_PARENT``)."""
    event = decode_checkpoint(version, payload, seq)
    versions = event.checkpoint.get("channel_versions") or {}
    found: ChannelMap = {channel: (version_key(entry.get("v")), seq)
                         for channel, entry in event.values.items()}
    for channel, ref_seq in event.refs.items():
        found[channel] = (version_key(versions.get(channel)), int(ref_seq))
    return found


def merge_writes(
    events: Sequence[vocabulary.GraphWritesSaved], codec: ValueCodec
) -> list[PendingWrite]:
    """The pending writes of one checkpoint, as LangGraph's Postgres saver keeps them.

    One write per (writer task, index): an ordinary write keeps the first value stored, a
    special write (error, interrupt, ...) the last. Sorted by ``writes_sort_key``.
    """
    return [(task, channel, codec.decode(entry)) for task, channel, entry in _merged(events)]


def _merged(
    events: Sequence[vocabulary.GraphWritesSaved],
) -> list[tuple[str, str, dict[str, Any]]]:
    """(task, channel, stored entry) of :func:`merge_writes`, in its order, not decoded."""
    merged: dict[tuple[str, int], tuple[str, str, dict[str, Any]]] = {}
    for event in events:
        for entry in event.writes:
            key = (event.graph_task_id, int(entry["i"]))
            if event.upsert or key not in merged:
                merged[key] = (event.task_path, str(entry["c"]), entry)
    ordered = sorted(
        merged.items(), key=lambda item: writes_sort_key(item[1][0], item[0][0], item[0][1])
    )
    return [(task, channel, entry) for (task, _index), (_path, channel, entry) in ordered]


def needs_sends_migration(item: StoredCheckpoint) -> bool:
    """Whether the checkpoint predates format 4, whose sends live in the parent's writes.

    Before format 4 LangGraph kept ``Send`` packets as writes to the ``__pregel_tasks``
    channel of the parent checkpoint (``pending_sends``); from 4 on they are a channel value.
    """
    version = item.event.checkpoint.get("v")
    return (isinstance(version, int) and version < 4
            and item.event.parent_checkpoint_id is not None)


def migrate_sends(
    checkpoint: dict[str, Any], parent_writes: Sequence[vocabulary.GraphWritesSaved],
    codec: ValueCodec, first_version: Any,
) -> None:
    """Move the parent's ``__pregel_tasks`` writes into ``checkpoint`` as that channel.

    As LangGraph's Postgres saver migrates them on read: the sends in ``writes_sort_key``
    order become the channel's value, at the checkpoint's highest channel version (or
    ``first_version`` when it has none). Nothing changes when the parent sent nothing.
    """
    sends = [codec.decode(entry) for _task, channel, entry in _merged(parent_writes)
             if channel == TASKS]
    if not sends:
        return
    checkpoint["channel_values"][TASKS] = sends
    versions = checkpoint["channel_versions"]
    versions[TASKS] = max(versions.values()) if versions else first_version


def to_tuple(item: StoredCheckpoint, codec: ValueCodec) -> CheckpointTuple:
    """The LangGraph tuple of a stored checkpoint."""
    event = item.event
    configurable = {
        "thread_id": item.thread_id,
        "checkpoint_ns": event.checkpoint_ns,
        "checkpoint_id": event.checkpoint_id,
    }
    stored_checkpoint: dict[str, Any] = dict(event.checkpoint)
    stored_checkpoint["id"] = event.checkpoint_id
    stored_checkpoint["channel_values"] = {
        channel: codec.decode(entry) for channel, entry in item.entries.items()
    }
    # The stored skeleton is LangGraph's own checkpoint dict, id and values put back.
    checkpoint = cast(Checkpoint, stored_checkpoint)
    parent: RunnableConfig | None = None
    if event.parent_checkpoint_id:
        parent = {"configurable": {**configurable, "checkpoint_id": event.parent_checkpoint_id}}
    # Stored as LangGraph gave it, big integers as their text (codec.lift_big_ints).
    stored_metadata = dict(event.metadata)
    if event.big_ints:
        stored_metadata = restore_big_ints(copy.deepcopy(stored_metadata), event.big_ints)
    metadata = cast(CheckpointMetadata, stored_metadata)
    return CheckpointTuple(
        config={"configurable": configurable},
        checkpoint=checkpoint,
        metadata=metadata,
        parent_config=parent,
        pending_writes=merge_writes(item.writes, codec),
    )
