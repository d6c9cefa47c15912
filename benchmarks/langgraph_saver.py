"""LangGraph checkpointers: wal-engine's ``WalCheckpointSaver`` against LangGraph's own
``AsyncPostgresSaver``, on the same PostgreSQL, in the same run, interleaved in rounds.

Workloads, per graph step (``AsyncPostgresSaver`` is the reference of each ratio):

* ``put``: one ``aput`` of the next checkpoint of a ReAct-like thread.
* ``put_writes``: one ``aput_writes`` of an agent node's output (two writes).
* ``get@100`` / ``get@1000``: ``aget_tuple`` of the newest checkpoint of a thread of 100 /
  1,000 steps (what a resume reads).
* ``get_mid@1000``: ``aget_tuple`` by id of the checkpoint in the middle of that thread.

Bytes per step: while each saver writes its 1,000-step thread (one ``aput`` and one
``aput_writes`` per step, one saver at a time), the growth of all the tables it writes,
with their indexes and TOAST (``pg_total_relation_size``), divided by 1,000.

The thread's state is what a ReAct agent's looks like to a checkpointer: ``messages`` (a
window of the last four LangChain messages of about 300 characters of varied words, about
1.5 kB serialized; LangGraph's ``add_messages`` would keep every message, and both savers
then store the whole list at every step alike), ``step`` (an integer), ``context`` (a 2 kB
dict written once, at step 0) and a ``branch:to:*`` trigger channel. Each saver mints its
own channel versions (``get_next_version``), as in a real run.

Both savers are opened as their documentation says: ``AsyncPostgresSaver.from_conn_string``
(one psycopg connection, autocommit) and ``WalCheckpointSaver`` on the pool of
``WalCheckpointSaver.from_dsn`` (asyncpg). Without ``--dsn`` the run uses its own database
(``wal_bench_langgraph``), so that no other writer's rows count in the table growth.

Usage: ``python -m benchmarks.langgraph_saver [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any, Final

import asyncpg
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.base import BaseCheckpointSaver, Checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from benchmarks import harness
from wal_engine.integrations.langgraph import WalCheckpointSaver
from wal_engine.integrations.langgraph.connection import open_database
from wal_engine.store import Store

NAME: Final = "langgraph_saver"
BENCH_DATABASE: Final = "wal_bench_langgraph"
"""Its own database: table growth must not count rows other benchmarks write meanwhile."""
WAL: Final = "wal-engine WalCheckpointSaver"
LANGGRAPH: Final = "langgraph AsyncPostgresSaver"
LONG_STEPS: Final = 1000
SHORT_STEPS: Final = 100
WINDOW_MESSAGES: Final = 4
WORDS: Final = (
    "the agent tool result search query page found returned error retry value table row "
    "user asked answer because which should could would first second third file open read "
    "write list item price order date time city weather report summary plan next step done"
).split()
MESSAGE_WORDS: Final = 50
"""Words per message: about 300 characters of text that compresses like prose, not a
repeated sentence (which would flatter both savers' compression)."""
CONTEXT: Final = {f"key_{index}": f"value {index} " + "x" * 40 for index in range(40)}

WAL_TABLES: Final = ("wal_events", "wal_tasks", "wal_graph_threads", "wal_graph_checkpoints",
                     "wal_graph_writes")
LANGGRAPH_TABLES: Final = ("checkpoints", "checkpoint_blobs", "checkpoint_writes")
LANGGRAPH_PACKAGES: Final = ("langgraph", "langgraph-checkpoint", "langgraph-checkpoint-postgres",
                              "langchain-core", "psycopg")
"""Versions printed with the figures (the harness header lists wal-engine's own)."""

TABLE_BYTES: Final = """
SELECT coalesce(sum(pg_total_relation_size(to_regclass(name))), 0)::int8 AS bytes
  FROM unnest($1::text[]) AS t(name)
"""


class AgentThread:
    """A synthetic ReAct-like thread written step by step to one saver."""

    def __init__(self, saver: BaseCheckpointSaver[Any], thread_id: str) -> None:
        self.saver = saver
        self.thread_id = thread_id
        self.parent: str | None = None
        self.versions: dict[str, Any] = {}
        self.values: dict[str, Any] = {}
        self.seen: dict[str, dict[str, Any]] = {}
        self.window: deque[BaseMessage] = deque(maxlen=WINDOW_MESSAGES)
        self.step = -1
        self.checkpoint_ids: list[str] = []

    def _message(self) -> BaseMessage:
        words = random.Random(f"{self.thread_id}/{self.step}").choices(WORDS, k=MESSAGE_WORDS)
        text = f"step {self.step}: " + " ".join(words)
        if self.step % 2:
            return ToolMessage(content=text, tool_call_id=f"call-{self.step}", id=f"m{self.step}")
        if self.step == 0:
            return HumanMessage(content=text, id="m0")
        return AIMessage(content=text, id=f"m{self.step}")

    def _next_checkpoint(self) -> tuple[Any, Checkpoint, Any, dict[str, Any]]:
        self.step += 1
        self.window.append(self._message())
        changes: dict[str, Any] = {"messages": list(self.window), "step": self.step,
                                   f"branch:to:{'tools' if self.step % 2 else 'agent'}": None}
        if self.step == 0:
            changes["context"] = CONTEXT
        current = max(self.versions.values(), default=None)
        for channel, value in changes.items():
            self.versions[channel] = self.saver.get_next_version(current, None)
            self.values[channel] = value
        node = "tools" if self.step % 2 else "agent"
        self.seen[node] = {channel: self.versions[channel] for channel in changes}
        checkpoint: Checkpoint = {
            "v": 4, "id": str(uuid6(clock_seq=self.step)),
            "ts": dt.datetime.now(dt.UTC).isoformat(),
            "channel_values": dict(self.values), "channel_versions": dict(self.versions),
            "versions_seen": {name: dict(seen) for name, seen in self.seen.items()},
            "updated_channels": sorted(changes),
        }
        configurable = {"thread_id": self.thread_id, "checkpoint_ns": ""}
        if self.parent is not None:
            configurable["checkpoint_id"] = self.parent
        metadata = {"source": "loop", "step": self.step, "parents": {},
                    "run_id": "run-" + self.thread_id}
        new_versions = {channel: self.versions[channel] for channel in changes}
        return {"configurable": configurable}, checkpoint, metadata, new_versions

    async def put(self) -> int:
        """Store the next checkpoint; return the ns the ``aput`` call took."""
        config, checkpoint, metadata, new_versions = self._next_checkpoint()
        start = time.perf_counter_ns()
        stored = await self.saver.aput(config, checkpoint, metadata, new_versions)
        elapsed = time.perf_counter_ns() - start
        self.parent = stored["configurable"]["checkpoint_id"]
        self.checkpoint_ids.append(checkpoint["id"])
        return elapsed

    async def put_writes(self) -> int:
        """Store one node's writes against the newest checkpoint; return the ns it took."""
        config: Any = {"configurable": {"thread_id": self.thread_id, "checkpoint_ns": "",
                                        "checkpoint_id": self.parent}}
        task_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{self.thread_id}/{time.time_ns()}"))
        writes = [("messages", [self._message()]), ("branch:to:agent", None)]
        start = time.perf_counter_ns()
        await self.saver.aput_writes(config, writes, task_id, "~__pregel_pull, agent")
        return time.perf_counter_ns() - start

    async def get(self, checkpoint_id: str | None = None) -> None:
        """Read the newest checkpoint (or one by id) and check it came back whole."""
        configurable = {"thread_id": self.thread_id, "checkpoint_ns": ""}
        if checkpoint_id is not None:
            configurable["checkpoint_id"] = checkpoint_id
        config: Any = {"configurable": configurable}
        loaded = await self.saver.aget_tuple(config)
        assert loaded is not None and "context" in loaded.checkpoint["channel_values"]


class Bench:
    """Both savers, their threads, and the pool that measures table sizes."""

    def __init__(self, wal: WalCheckpointSaver, langgraph: AsyncPostgresSaver,
                 pool: asyncpg.Pool, run_id: str) -> None:
        self.savers: dict[str, BaseCheckpointSaver[Any]] = {WAL: wal, LANGGRAPH: langgraph}
        self.pool = pool
        self.run_id = run_id
        self.bytes_per_step: dict[str, float] = {}

    def thread(self, contender: str, purpose: str) -> AgentThread:
        """A new thread of ``contender``'s saver."""
        tag = "wal" if contender == WAL else "lg"
        return AgentThread(self.savers[contender], f"bench-{tag}-{purpose}-{self.run_id}")

    async def build(self, contender: str, purpose: str, steps: int, *,
                    measure: bool = False) -> AgentThread:
        """Write a thread of ``steps`` steps (untimed); optionally measure bytes per step."""
        tables = list(WAL_TABLES if contender == WAL else LANGGRAPH_TABLES)
        before = await self.pool.fetchval(TABLE_BYTES, tables)
        thread = self.thread(contender, purpose)
        for _ in range(steps):
            await thread.put()
            await thread.put_writes()
        if measure:
            after = await self.pool.fetchval(TABLE_BYTES, tables)
            self.bytes_per_step[contender] = (after - before) / steps
        return thread


Operation = Callable[[], Awaitable[int | None]]


def contenders(make: Callable[[str], Operation]) -> list[harness.Contender]:
    """The two contenders of a workload, AsyncPostgresSaver as the reference."""
    return [harness.Contender(name=LANGGRAPH, operation=make(LANGGRAPH), reference=True),
            harness.Contender(name=WAL, operation=make(WAL))]


async def workloads(bench: Bench, ops: int, long_steps: int) -> list[harness.Workload]:
    """The workloads, their long threads written (and measured) first."""
    threads = {}
    for contender in (LANGGRAPH, WAL):
        threads[contender] = {
            "long": await bench.build(contender, "long", long_steps, measure=True),
            "short": await bench.build(contender, "short", SHORT_STEPS),
            "live": await bench.build(contender, "live", 1),
        }

    def put(contender: str) -> Operation:
        return threads[contender]["live"].put

    def put_writes(contender: str) -> Operation:
        return threads[contender]["live"].put_writes

    def get(contender: str, which: str) -> Operation:
        async def operation() -> None:
            await threads[contender][which].get()
        return operation

    def get_middle(contender: str) -> Operation:
        long = threads[contender]["long"]
        middle = long.checkpoint_ids[len(long.checkpoint_ids) // 2]

        async def operation() -> None:
            await long.get(middle)
        return operation

    return [
        harness.Workload("put", "aput of the next checkpoint", contenders(put), ops),
        harness.Workload("put_writes", "aput_writes of a node's two writes",
                         contenders(put_writes), ops),
        harness.Workload(f"get@{SHORT_STEPS}", f"aget_tuple newest, {SHORT_STEPS}-step thread",
                         contenders(lambda c: get(c, "short")), ops),
        harness.Workload(f"get@{long_steps}", f"aget_tuple newest, {long_steps}-step thread",
                         contenders(lambda c: get(c, "long")), ops),
        harness.Workload(f"get_mid@{long_steps}",
                         f"aget_tuple by id, middle of the {long_steps}-step thread",
                         contenders(get_middle), ops),
    ]


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=20, ops=50)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=2, quick_ops=5)
    long_steps = 50 if settings.quick else LONG_STEPS
    dsn = await harness.resolve_bench_dsn(args.dsn, database=BENCH_DATABASE)
    database = await open_database(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        machine = await harness.describe_machine(dsn)
        wal = WalCheckpointSaver(Store(database), worker_id="bench")
        await wal.setup()
        async with AsyncPostgresSaver.from_conn_string(dsn) as langgraph:
            await langgraph.setup()
            run_id = f"{time.strftime('%m%d%H%M%S')}-{os.getpid()}"
            bench = Bench(wal, langgraph, pool, run_id)
            results = [await harness.run_workload(workload, rounds=settings.rounds)
                       for workload in await workloads(bench, settings.ops, long_steps)]
    finally:
        await pool.close()
        await database.close()
    print(harness.format_report(NAME, machine, results, settings))
    sizes = bench.bytes_per_step
    versions = {name: metadata.version(name) for name in LANGGRAPH_PACKAGES}
    print("LangGraph packages: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"Bytes per step ({long_steps}-step thread, tables + indexes + TOAST): "
          f"{LANGGRAPH} {sizes[LANGGRAPH]:.0f}, {WAL} {sizes[WAL]:.0f} "
          f"({sizes[WAL] / sizes[LANGGRAPH]:.2f}x).")
    if not args.no_json:
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path,
                                  extra={"bytes_per_step": sizes, "long_steps": long_steps,
                                         "langgraph_packages": versions})
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
