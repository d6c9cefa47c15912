"""``WalCheckpointSaver``: a LangGraph checkpointer whose storage is wal-engine's log.

Each LangGraph thread is one wal-engine task (see :mod:`.thread_log` for the lease rules).
``put`` appends a ``graph_checkpoint_saved`` event holding the checkpoint without its channel
values, its metadata, the channel values whose version changed (LangGraph's
``new_versions``) and, for every other channel, the seq of the earlier event that holds its
value (``refs``, known from the parent checkpoint, which the saver keeps in memory after
reading or writing it). Storage per checkpoint therefore does not grow with the thread's
history, and ``get_tuple`` reads the checkpoint, the few events it refers to and its writes
in one round trip, whatever the thread's length. Values are found by seq, not by version,
so channel versions are LangGraph's default integers. ``put_writes`` appends a
``graph_writes_saved`` event. A thread gets the log's hash chain, ``verify``, history and
audit views for free.

Retention on an append-only log
-------------------------------
``delete_thread``, ``prune`` and ``delete_for_runs`` append a ``graph_checkpoints_removed``
event recording exactly what they remove and, in the same transaction, delete the removed
checkpoints from the derived index tables that every read goes through. Readers no longer
see them; the events themselves stay, so ``verify`` passes on the thread's task after every
retention operation, and the log still shows what was removed, when and by whom. Physical
erasure (for example of personal data) is deliberately not done here: it is a separate,
audited archival step that removes or redacts a task's whole history outside the hot path.
The index tables are derived data: replaying a task's events (checkpoints and writes add
rows, each removal event drops the rows before it that it names) rebuilds them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, cast

import orjson
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

from wal_engine import events as vocabulary
from wal_engine.integrations.langgraph import queries
from wal_engine.integrations.langgraph.codec import (
    ValueCodec,
    contains,
    lift_big_ints,
    next_version,
    split_checkpoint,
    thread_task_id,
    version_key,
)
from wal_engine.integrations.langgraph.connection import open_database
from wal_engine.integrations.langgraph.reading import (
    ChannelMap,
    StoredCheckpoint,
    decode_row,
    decode_writes,
    expand_rows,
    migrate_sends,
    needs_sends_migration,
    parent_map,
    to_tuple,
    writes_events_max,
)
from wal_engine.integrations.langgraph.retention import Retention
from wal_engine.integrations.langgraph.thread_log import ThreadLog, checkpoint_index, writes_index
from wal_engine.store import Store

list_page_checkpoints: Final = 100
"""Checkpoints read per round trip by ``alist`` when no limit (or a larger one) is given."""

list_checkpoints_max: Final = 1_000_000
"""Most checkpoints one ``alist`` call yields."""

channel_maps_max: Final = 4096
"""Checkpoints whose channel map the saver keeps in memory (its children's puts need it)."""


def default_serde() -> SerializerProtocol:
    """LangGraph's serializer exactly as LangGraph's own savers build it: ``JsonPlusSerializer()``.

    Its msgpack allowlist therefore follows LangGraph's settings. By default (permissive, as
    ``InMemorySaver`` and ``AsyncPostgresSaver`` behave) the graph's own types come back as
    themselves: dataclasses, Pydantic models, Enums, LangChain's ``AgentAction`` and the
    like, each type LangGraph has not registered logged once by LangGraph as a warning. With
    ``LANGGRAPH_STRICT_MSGPACK=true`` in the environment when LangGraph is imported, only
    LangGraph's safe types and the types of the graph's own schemas (which LangGraph adds
    through ``with_allowlist`` when the graph is compiled) are ever constructed from a stored
    value; any other comes back as its plain data. For an explicit allowlist pass
    ``serde=JsonPlusSerializer(allowed_msgpack_modules=[("module", "Class"), ...])``
    (``None`` for the safe types only). Pickle is never used.
    """
    return JsonPlusSerializer()


def default_worker_id() -> str:
    """``langgraph:<host>:<pid>:<random>``: who wrote, as recorded in claim events.

    The random part (8 hex digits from ``os.urandom``, never ``uuid4`` or ``random``, whose
    sequences applications seed or patch) tells apart two processes that reuse a pid on one
    host, as containers do. The saver calls this on its first write, never when it is built.
    """
    return f"langgraph:{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


class WalCheckpointSaver(BaseCheckpointSaver[int]):
    """A LangGraph checkpointer storing every thread as a wal-engine task.

    Use it like LangGraph's ``AsyncPostgresSaver``::

        async with WalCheckpointSaver.from_dsn(dsn) as saver:
            graph = builder.compile(checkpointer=saver)
            await graph.ainvoke(inputs, {"configurable": {"thread_id": "t-1"}})

    Args:
        store: The wal-engine store to write to (its database must hold the schema).
        serde: LangGraph serializer; defaults to :func:`default_serde`.
        worker_id: This writer's identity in the log; defaults to :func:`default_worker_id`,
            drawn on the saver's first write.
    """

    def __init__(
        self,
        store: Store,
        *,
        serde: SerializerProtocol | None = None,
        worker_id: str | None = None,
    ) -> None:
        super().__init__(serde=serde or default_serde())
        self.store = store
        self.database = store.database
        self.thread_log = ThreadLog(store, worker_id or default_worker_id)
        self.retention = Retention(self.thread_log)
        self._channel_maps: OrderedDict[tuple[str, str, str], ChannelMap] = OrderedDict()
        self._setup_done = False
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    @property
    def _codec(self) -> ValueCodec:
        # Built on use: LangGraph swaps ``serde`` on a shallow copy (``with_allowlist``).
        return ValueCodec(self.serde, inline_json=isinstance(self.serde, JsonPlusSerializer))

    @classmethod
    @asynccontextmanager
    async def from_dsn(
        cls, dsn: str | None = None, *, serde: SerializerProtocol | None = None,
        worker_id: str | None = None, tenant: str | None = None,
    ) -> AsyncIterator[WalCheckpointSaver]:
        """Open a pool on ``dsn`` (wal-engine's DSN rules), set up, yield a saver, close.

        The pool keeps sessions on release (see :func:`.connection.open_database`): one round
        trip per statement instead of two. Its connections are bound to ``tenant`` (default
        ``WAL_ENGINE_TENANT``, else ``"default"``), like an engine's.
        """
        database = await open_database(dsn, tenant=tenant)
        try:
            saver = cls(Store(database), serde=serde, worker_id=worker_id)
            await saver.setup()
            yield saver
        finally:
            await database.close()

    async def setup(self) -> None:
        """Create the saver's index tables if missing (idempotent, safe to run concurrently)."""
        async with self.database.acquire() as connection:
            async with connection.transaction():
                await connection.execute(queries.SETUP_LOCK)
                await connection.execute(queries.SETUP)
        self._setup_done = True

    async def _ready(self) -> None:
        if not self._setup_done:
            await self.setup()

    def get_next_version(self, current: Any, channel: None) -> Any:
        """The next channel version: an integer, like LangGraph's default.

        Values are found through the seqs recorded in each checkpoint, not by version, so
        versions need not differ between forks. A thread whose versions are strings (one
        copied from another saver) keeps getting strings (:func:`codec.next_version`).
        """
        if isinstance(current, str):
            return next_version(current)
        return 1 if current is None else int(current) + 1

    def _remember(self, key: tuple[str, str, str], channels: ChannelMap) -> None:
        self._channel_maps[key] = channels
        self._channel_maps.move_to_end(key)
        while len(self._channel_maps) > channel_maps_max:
            self._channel_maps.popitem(last=False)

    async def _parent_channels(self, task_id: str, namespace: str,
                               parent_id: str | None) -> ChannelMap:
        """Where the parent checkpoint's values are: from memory, else one read."""
        if parent_id is None:
            return {}
        key = (task_id, namespace, parent_id)
        cached = self._channel_maps.get(key)
        if cached is not None:
            return cached
        row = await self.database.fetchrow(queries.READ_PARENT, task_id, namespace, parent_id,
                                           task_id=task_id)
        if row is None:
            return {}  # Unknown or removed parent: the put stores every value itself.
        expanded = await expand_rows(self.database, [{**row, "task_id": task_id}],
                                     ("payload",))
        channels = parent_map(int(row["seq"]), row["version"],
                              expanded.get(row["payload"], row["payload"]))
        self._remember(key, channels)
        return channels

    # ------------------------------------------------------------------ writes

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Append the checkpoint with the values of the channels in ``new_versions``.

        Args:
            config: Thread id, namespace and (as parent) the checkpoint it follows.
            checkpoint: The checkpoint to store.
            metadata: Its metadata (plain JSON).
            new_versions: The channels whose values changed since the parent.

        Returns:
            The config of the stored checkpoint.
        """
        await self._ready()
        configurable = config["configurable"]
        thread_id = configurable["thread_id"]
        task_id = thread_task_id(str(thread_id))
        namespace = configurable.get("checkpoint_ns", "")
        parent_id = configurable.get("checkpoint_id")
        inherited = await self._parent_channels(task_id, namespace, parent_id)
        values, refs = self._split_values(checkpoint, new_versions, inherited)
        stored_metadata, big_ints = lift_big_ints(
            dict(get_serializable_checkpoint_metadata(config, metadata)))
        run_id = stored_metadata.get("run_id")
        skeleton = split_checkpoint(dict(checkpoint))
        del skeleton["id"]  # It is the event's checkpoint_id.
        event = vocabulary.GraphCheckpointSaved(
            checkpoint_ns=namespace, checkpoint_id=checkpoint["id"],
            parent_checkpoint_id=parent_id, checkpoint=skeleton, metadata=stored_metadata,
            values=values, refs=refs, big_ints=big_ints,
        )
        seq = await self.thread_log.append(str(thread_id), event, checkpoint_index(
            namespace, checkpoint["id"], None if run_id is None else str(run_id),
            sorted(set(refs.values())),
        ))
        channels: ChannelMap = {channel: (version_key(entry["v"]), seq)
                                for channel, entry in values.items()}
        versions = checkpoint["channel_versions"]
        channels.update({channel: (version_key(versions[channel]), ref_seq)
                         for channel, ref_seq in refs.items()})
        self._remember((task_id, namespace, checkpoint["id"]), channels)
        return {"configurable": {
            "thread_id": thread_id, "checkpoint_ns": namespace, "checkpoint_id": checkpoint["id"],
        }}

    def _split_values(
        self, checkpoint: Checkpoint, new_versions: ChannelVersions, inherited: ChannelMap
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """The values this checkpoint stores itself, and the refs of the others.

        A channel in ``new_versions`` is stored. Any other channel with a value is referred
        to the event holding it when the parent has that very version; otherwise (a put that
        does not follow its parent, as LangGraph's loop always does) it is stored too.
        """
        codec = self._codec
        channel_values = checkpoint["channel_values"]
        values = {
            channel: {"v": version, **codec.encode(channel_values[channel])}
            for channel, version in new_versions.items()
            if channel in channel_values
        }
        refs: dict[str, int] = {}
        for channel, version in checkpoint["channel_versions"].items():
            if channel in values or channel not in channel_values:
                continue
            known = inherited.get(channel)
            if known is not None and known[0] == version_key(version):
                refs[channel] = known[1]
            else:
                values[channel] = {"v": version, **codec.encode(channel_values[channel])}
        return values, refs

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Append one task's pending writes against a checkpoint.

        Readers keep one write per (task, index), as LangGraph's savers do, so saving the same
        writes twice changes nothing they see (the log records both calls).

        Args:
            config: The checkpoint the writes belong to.
            writes: ``(channel, value)`` pairs.
            task_id: The LangGraph task that made them.
            task_path: The task's path, which orders the writes of one step.
        """
        if not writes:
            return
        await self._ready()
        configurable = config["configurable"]
        codec = self._codec
        entries = [
            {"i": WRITES_IDX_MAP.get(channel, index), "c": channel, **codec.encode(value)}
            for index, (channel, value) in enumerate(writes)
        ]
        upsert = all(channel in WRITES_IDX_MAP for channel, _ in writes)
        namespace = configurable.get("checkpoint_ns", "")
        checkpoint_id = configurable["checkpoint_id"]
        event = vocabulary.GraphWritesSaved(
            checkpoint_ns=namespace, checkpoint_id=checkpoint_id, graph_task_id=task_id,
            task_path=task_path, writes=entries, upsert=upsert,
        )
        await self.thread_log.append(
            str(configurable["thread_id"]), event, writes_index(namespace, checkpoint_id)
        )

    # ------------------------------------------------------------------ reads

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint named by ``config``, or the newest of its namespace; None if absent.

        Args:
            config: Thread id, namespace and optionally the checkpoint id.

        Returns:
            The checkpoint tuple with its pending writes in ``writes_sort_key`` order.
        """
        await self._ready()
        configurable = config["configurable"]
        thread_id = configurable["thread_id"]
        task_id = thread_task_id(str(thread_id))
        namespace = configurable.get("checkpoint_ns", "")
        checkpoint_id = get_checkpoint_id(config)
        if checkpoint_id is None:
            row = await self.database.fetchrow(
                queries.READ_LATEST, task_id, namespace, writes_events_max, task_id=task_id)
        else:
            row = await self.database.fetchrow(
                queries.READ_BY_ID, task_id, namespace, checkpoint_id, writes_events_max,
                task_id=task_id)
        if row is None:
            return None
        item = decode_row(row, thread_id, await expand_rows(self.database, [row]))
        return (await self._with_sends([item]))[0]

    def _loaded(self, item: StoredCheckpoint) -> CheckpointTuple:
        """The tuple of a read checkpoint; its channel map is kept for a child's put."""
        self._remember((item.task_id, item.event.checkpoint_ns, item.event.checkpoint_id),
                       item.channel_map())
        return to_tuple(item, self._codec)

    async def _with_sends(self, items: list[StoredCheckpoint]) -> list[CheckpointTuple]:
        """The tuples of read checkpoints, those before format 4 with their sends migrated.

        One more round trip per thread and namespace among them, and none when every
        checkpoint is of format 4 or later (every checkpoint LangGraph 1.x writes).
        """
        tuples = [self._loaded(item) for item in items]
        old: dict[tuple[str, str], list[int]] = {}
        for position, item in enumerate(items):
            if needs_sends_migration(item):
                old.setdefault((item.task_id, item.event.checkpoint_ns), []).append(position)
        for (task_id, namespace), positions in old.items():
            parents = sorted({str(items[i].event.parent_checkpoint_id) for i in positions})
            rows = await self.database.fetch(queries.PARENT_WRITES, task_id, namespace, parents,
                                             writes_events_max, task_id=task_id)
            expanded = await expand_rows(
                self.database, [{**row, "task_id": task_id} for row in rows], ("payload",))
            writes: dict[str, list[vocabulary.GraphWritesSaved]] = {}
            for row in rows:
                writes.setdefault(row["checkpoint_id"], []).append(decode_writes(
                    row["version"], expanded.get(row["payload"], row["payload"]),
                    int(row["seq"])))
            for position in positions:
                parent = str(items[position].event.parent_checkpoint_id)
                checkpoint = cast(dict[str, Any], tuples[position].checkpoint)
                migrate_sends(checkpoint, writes.get(parent, []), self._codec,
                              self.get_next_version(None, None))
        return tuples

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,  # LangGraph's parameter name
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints newest first, filtered like LangGraph's Postgres saver.

        Args:
            config: Thread (and optionally namespace and checkpoint id); None for all threads.
            filter: Metadata the checkpoints must contain (JSON containment).
            before: Only checkpoints with an id before this config's checkpoint id.
            limit: Most checkpoints to yield.

        Yields:
            Checkpoint tuples, paged :data:`list_page_checkpoints` at a time.
        """
        await self._ready()
        if config is not None and get_checkpoint_id(config) is not None:
            async for found in self._list_one(config, filter, before):
                yield found
            return
        remaining = list_checkpoints_max if limit is None else max(0, int(limit))
        lifted, big_ints = lift_big_ints(filter or {})
        metadata_filter = None if not filter else orjson.dumps(lifted).decode()
        before_id = None if before is None else get_checkpoint_id(before)
        cursor: StoredCheckpoint | None = None
        while remaining > 0:
            page_size = min(remaining, list_page_checkpoints)
            page = await self._list_page(config, metadata_filter, before_id, cursor, page_size)
            for item, found in zip(page, await self._with_sends(page), strict=True):
                # A big int stored as its text matches that text as a string and the other
                # way round (codec.lift_big_ints): then the filter is checked exactly.
                if (filter and (big_ints or item.event.big_ints)
                        and not contains(dict(found.metadata), filter)):
                    continue
                yield found
                remaining -= 1
                if remaining == 0:
                    return
            if len(page) < page_size:
                return
            cursor = page[-1]

    async def _list_one(
        self, config: RunnableConfig, filter: dict[str, Any] | None,
        before: RunnableConfig | None,
    ) -> AsyncIterator[CheckpointTuple]:
        """``alist`` of a config naming one checkpoint: that one, if it passes the filters."""
        found = await self.aget_tuple(config)
        before_id = None if before is None else get_checkpoint_id(before)
        if found is None or (before_id is not None
                             and found.checkpoint["id"] >= before_id):
            return
        metadata: dict[str, Any] = dict(found.metadata)
        if filter and any(metadata.get(key) != value for key, value in filter.items()):
            return
        yield found

    async def _list_page(
        self, config: RunnableConfig | None, metadata_filter: str | None,
        before_id: str | None, cursor: StoredCheckpoint | None, page_size: int,
    ) -> list[StoredCheckpoint]:
        """One page of ``alist``, newest first, in one round trip."""
        last_id = None if cursor is None else cursor.event.checkpoint_id
        if config is None:
            rows = await self.database.fetch(
                queries.LIST_ALL, before_id, metadata_filter, last_id,
                None if cursor is None else cursor.task_id,
                None if cursor is None else cursor.event.checkpoint_ns,
                page_size, writes_events_max,
            )
            thread_ids = await self._thread_ids({row["task_id"] for row in rows})
            expanded = await expand_rows(self.database, rows)
            return [decode_row(row, thread_ids.get(row["task_id"]), expanded) for row in rows]
        configurable = config["configurable"]
        thread_id = configurable["thread_id"]
        task_id = thread_task_id(str(thread_id))
        namespace = configurable.get("checkpoint_ns")
        if namespace is None:
            # Below the cursor's position; ``before`` alone is the position (before_id, '').
            below = ((cursor.event.checkpoint_id, cursor.event.checkpoint_ns)
                     if cursor is not None else None if before_id is None else (before_id, ""))
            if below is None:
                rows = await self.database.fetch(
                    queries.LIST_THREAD, task_id, metadata_filter, page_size,
                    writes_events_max, task_id=task_id)
            else:
                rows = await self.database.fetch(
                    queries.LIST_THREAD_BELOW, task_id, *below, metadata_filter, page_size,
                    writes_events_max, task_id=task_id)
        else:
            upper = min((i for i in (before_id, last_id) if i is not None), default=None)
            if upper is None:
                rows = await self.database.fetch(
                    queries.LIST_NAMESPACE, task_id, namespace, metadata_filter, page_size,
                    writes_events_max, task_id=task_id)
            else:
                rows = await self.database.fetch(
                    queries.LIST_NAMESPACE_BELOW, task_id, namespace, upper, metadata_filter,
                    page_size, writes_events_max, task_id=task_id)
        expanded = await expand_rows(self.database, rows)
        return [decode_row(row, thread_id, expanded) for row in rows]

    async def _thread_ids(self, task_ids: set[str]) -> dict[str, str]:
        if not task_ids:
            return {}
        rows = await self.database.fetch(queries.THREAD_IDS, sorted(task_ids))
        return {row["task_id"]: row["thread_id"] for row in rows}

    # ------------------------------------------------------------------ retention and copy

    async def adelete_thread(self, thread_id: str) -> None:
        """Hide every checkpoint and write of the thread (a recorded retention event).

        Args:
            thread_id: The thread; a thread that does not exist is a no-op.
        """
        await self._ready()
        await self.retention.delete_thread(str(thread_id), operation="delete_thread")

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Hide the checkpoints written by these runs, and their writes, in every thread.

        Args:
            run_ids: Run ids as found in checkpoint metadata (``run_id``).
        """
        await self._ready()
        await self.retention.delete_for_runs([str(run_id) for run_id in run_ids])

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Prune threads: ``keep_latest`` keeps the newest checkpoint per namespace,
        ``delete`` hides them all.

        Args:
            thread_ids: The threads to prune (missing ones are skipped).
            strategy: ``"keep_latest"`` or ``"delete"``.

        Raises:
            TypeError: ``thread_ids`` is a single string.
            ValueError: Unknown strategy.
            NotImplementedError: ``keep_latest`` on a thread using a ``DeltaChannel``, whose
                reconstruction needs the ancestors (as LangGraph's Postgres saver refuses).
        """
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a sequence of thread ids, not a str")
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"unknown prune strategy: {strategy!r}")
        await self._ready()
        for thread_id in thread_ids:
            if strategy == "delete":
                await self.retention.delete_thread(str(thread_id), operation="prune_delete")
            else:
                await self.retention.keep_latest(str(thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy the source thread's visible checkpoints and writes onto the target thread.

        The copy is one transaction on the target's task, which records the source task and
        its head as its parent when the copy creates it. A missing source is a no-op.

        Args:
            source_thread_id: The thread to copy from.
            target_thread_id: The thread to copy to.
        """
        await self._ready()
        await self.retention.copy_thread(str(source_thread_id), str(target_thread_id))

    async def rebuild_index(self, thread_id: str) -> int:
        """Rebuild the thread's index rows from its events (a repair tool; see retention).

        Args:
            thread_id: The thread.

        Returns:
            The number of events read.
        """
        await self._ready()
        self._channel_maps.clear()
        return await self.retention.rebuild_index(str(thread_id))

    # ------------------------------------------------------------------ sync bridges

    def _sync(self, coroutine: Any) -> Any:
        """Run a coroutine on the saver's loop from another thread and wait for it."""
        loop = self.loop
        if loop is None:
            coroutine.close()
            raise asyncio.InvalidStateError(
                "WalCheckpointSaver was created outside an event loop: use its async methods"
            )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coroutine.close()
            raise asyncio.InvalidStateError(
                "synchronous calls to WalCheckpointSaver are only allowed from another "
                "thread; from the event loop use the async methods (await graph.ainvoke)"
            )
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Sync bridge to :meth:`aget_tuple` (from a thread other than the saver's loop)."""
        result: CheckpointTuple | None = self._sync(self.aget_tuple(config))
        return result

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,  # LangGraph's parameter name
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Sync bridge to :meth:`alist`."""
        iterator = self.alist(config, filter=filter, before=before, limit=limit)
        while True:
            try:
                yield self._sync(anext(iterator))
            except StopAsyncIteration:
                return

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Sync bridge to :meth:`aput`."""
        result: RunnableConfig = self._sync(
            self.aput(config, checkpoint, metadata, new_versions)
        )
        return result

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Sync bridge to :meth:`aput_writes`."""
        self._sync(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        """Sync bridge to :meth:`adelete_thread`."""
        self._sync(self.adelete_thread(thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Sync bridge to :meth:`adelete_for_runs`."""
        self._sync(self.adelete_for_runs(run_ids))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Sync bridge to :meth:`acopy_thread`."""
        self._sync(self.acopy_thread(source_thread_id, target_thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Sync bridge to :meth:`aprune`."""
        self._sync(self.aprune(thread_ids, strategy=strategy))


__all__ = ["WalCheckpointSaver", "default_serde", "default_worker_id"]
