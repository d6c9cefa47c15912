"""Read side of the saver: checkpoint rows -> LangGraph ``CheckpointTuple`` objects.

A checkpoint event stores only the channels whose version changed. For every other channel
the value is in the newest event at or before the checkpoint that stored that channel's
version (``wal_graph_blobs``); :func:`resolve_values` finds those in one statement for a
whole page of checkpoints, so reading is two round trips whatever the thread's length.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    PendingWrite,
    writes_sort_key,
)

from wal_engine import events as vocabulary
from wal_engine.errors import CorruptionError
from wal_engine.integrations.langgraph import queries
from wal_engine.integrations.langgraph.codec import ValueCodec, version_key

Fetch = Callable[..., Awaitable[list[Any]]]
"""Runs one query with positional arguments and returns its rows."""

writes_events_max: Final = 10_000
"""Most ``graph_writes_saved`` events read for one checkpoint."""


@dataclass(slots=True)
class StoredCheckpoint:
    """One checkpoint row with its decoded event and the writes stored against it."""

    task_id: str
    thread_id: Any
    seq: int
    event: vocabulary.GraphCheckpointSaved
    writes: list[vocabulary.GraphWritesSaved]
    values: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Channel -> stored entry, filled by :func:`resolve_values`."""
    sources: dict[str, int] = field(default_factory=dict)
    """Channel -> seq of the event its entry was read from."""


def decode_row(row: Any, task_id: str, thread_id: Any) -> StoredCheckpoint:
    """A ``READ_CHECKPOINT`` / ``LIST_*`` row decoded (fails closed on unknown versions)."""
    seq = int(row["seq"])
    event = vocabulary.decode_event("graph_checkpoint_saved", row["version"], row["payload"], seq)
    assert isinstance(event, vocabulary.GraphCheckpointSaved)
    writes: list[vocabulary.GraphWritesSaved] = []
    for version, payload in zip(row["write_versions"], row["write_payloads"], strict=True):
        decoded = vocabulary.decode_event("graph_writes_saved", version, payload)
        assert isinstance(decoded, vocabulary.GraphWritesSaved)
        writes.append(decoded)
    return StoredCheckpoint(task_id=task_id, thread_id=thread_id, seq=seq, event=event,
                            writes=writes)


async def resolve_values(fetch: Fetch, stored: Sequence[StoredCheckpoint]) -> None:
    """Fill each checkpoint's ``values`` (and ``sources``) for every channel it has a version of.

    ``fetch`` runs a query: ``Database.fetch`` on the pool, or a transaction's connection.
    """
    keys: list[tuple[int, str, str]] = []  # (checkpoint index, channel, version key)
    task_ids: list[str] = []
    namespaces: list[str] = []
    channels: list[str] = []
    version_keys: list[str] = []
    before_seqs: list[int] = []
    for index, item in enumerate(stored):
        own = item.event.values
        versions = item.event.checkpoint.get("channel_versions") or {}
        for channel, version in versions.items():
            key = version_key(version)
            entry = own.get(channel)
            if entry is not None and version_key(entry.get("v")) == key:
                item.values[channel] = entry
                item.sources[channel] = item.seq
                continue
            keys.append((index, channel, key))
            task_ids.append(item.task_id)
            namespaces.append(item.event.checkpoint_ns)
            channels.append(channel)
            version_keys.append(key)
            before_seqs.append(item.seq)
    if not keys:
        return
    rows = await fetch(
        queries.RESOLVE_VALUES, task_ids, namespaces, channels, version_keys, before_seqs
    )
    for row in rows:
        event = vocabulary.decode_event(
            "graph_checkpoint_saved", row["version"], row["payload"], row["seq"]
        )
        assert isinstance(event, vocabulary.GraphCheckpointSaved)
        for ordinal in row["ords"]:
            index, channel, key = keys[ordinal - 1]
            entry = event.values.get(channel)
            if entry is None or version_key(entry.get("v")) != key:
                raise CorruptionError(
                    f"index points task {row['task_id']!r} seq {row['seq']} at channel "
                    f"{channel!r} version {key!r}, which that event does not store"
                )
            stored[index].values[channel] = entry
            stored[index].sources[channel] = int(row["seq"])


def merge_writes(
    events: Sequence[vocabulary.GraphWritesSaved], codec: ValueCodec
) -> list[PendingWrite]:
    """The pending writes of one checkpoint, as LangGraph's Postgres saver keeps them.

    One write per (writer task, index): an ordinary write keeps the first value stored, a
    special write (error, interrupt, ...) the last. Sorted by ``writes_sort_key``.
    """
    merged: dict[tuple[str, int], tuple[str, str, dict[str, Any]]] = {}
    for event in events:
        for entry in event.writes:
            key = (event.graph_task_id, int(entry["i"]))
            if event.upsert or key not in merged:
                merged[key] = (event.task_path, str(entry["c"]), entry)
    ordered = sorted(
        merged.items(), key=lambda item: writes_sort_key(item[1][0], item[0][0], item[0][1])
    )
    return [(task, channel, codec.decode(entry))
            for (task, _index), (_path, channel, entry) in ordered]


def to_tuple(item: StoredCheckpoint, codec: ValueCodec) -> CheckpointTuple:
    """The LangGraph tuple of a stored checkpoint whose values were resolved."""
    event = item.event
    configurable = {
        "thread_id": item.thread_id,
        "checkpoint_ns": event.checkpoint_ns,
        "checkpoint_id": event.checkpoint_id,
    }
    stored_checkpoint: dict[str, Any] = dict(event.checkpoint)
    stored_checkpoint["channel_values"] = {
        channel: codec.decode(entry) for channel, entry in item.values.items()
    }
    # The stored skeleton is LangGraph's own checkpoint dict, values put back.
    checkpoint = cast(Checkpoint, stored_checkpoint)
    parent: RunnableConfig | None = None
    if event.parent_checkpoint_id:
        parent = {"configurable": {**configurable, "checkpoint_id": event.parent_checkpoint_id}}
    metadata = cast(CheckpointMetadata, event.metadata)  # stored as LangGraph gave it
    return CheckpointTuple(
        config={"configurable": configurable},
        checkpoint=checkpoint,
        metadata=metadata,
        parent_config=parent,
        pending_writes=merge_writes(item.writes, codec),
    )
