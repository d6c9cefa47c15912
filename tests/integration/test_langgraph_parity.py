"""The LangGraph saver behaves as LangGraph's own savers do: serializer, ids, sends, plans."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "langgraph.checkpoint.base",
    reason="the [langgraph] extra is not installed: pip install 'wal-engine[langgraph]'",
)

import pydantic
from langchain_core.agents import AgentAction
from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.serde.types import TASKS
from langgraph.graph import END, START, StateGraph

from wal_engine.integrations.langgraph import WalCheckpointSaver, queries, thread_task_id
from wal_engine.store import Store

from .test_langgraph_saver import Thread


class Mood(enum.Enum):
    """An Enum a graph keeps in its state."""

    CALM = "calm"
    ANGRY = "angry"


class Profile(pydantic.BaseModel):
    """A Pydantic model a graph keeps in its state."""

    name: str
    age: int


@dataclasses.dataclass
class Point:
    """A dataclass value of a channel."""

    x: int
    y: int


@dataclasses.dataclass
class Unlisted:
    """A dataclass no allowlist names."""

    label: str


@dataclasses.dataclass
class AgentState:
    """A dataclass state schema holding user types of every kind."""

    mood: Mood = Mood.CALM
    profile: Profile | None = None
    action: AgentAction | None = None
    point: Point | None = None


def _step(state: AgentState) -> dict[str, Any]:
    return {"mood": Mood.ANGRY, "profile": Profile(name="ada", age=36),
            "action": AgentAction(tool="search", tool_input={"q": "x"}, log="thinking"),
            "point": Point(1, 2)}


async def test_user_state_types_round_trip_under_default_settings(store: Store) -> None:
    """Dataclasses, Pydantic models, Enums and AgentAction come back as themselves by default."""
    assert os.environ.get("LANGGRAPH_STRICT_MSGPACK", "false").lower() not in ("1", "true", "yes")
    saver = WalCheckpointSaver(store, worker_id="types")
    builder = StateGraph(AgentState)
    builder.add_node("step", _step)
    builder.add_edge(START, "step")
    builder.add_edge("step", END)
    graph = builder.compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": "types"}}
    await graph.ainvoke(AgentState(), config)
    fresh = WalCheckpointSaver(store, worker_id="reader")  # nothing cached: read from the log
    loaded = await fresh.aget_tuple(config)
    assert loaded is not None
    values = loaded.checkpoint["channel_values"]
    assert values["mood"] is Mood.ANGRY
    assert values["profile"] == Profile(name="ada", age=36)
    assert isinstance(values["action"], AgentAction) and values["action"].tool == "search"
    assert values["point"] == Point(1, 2)


async def test_an_explicit_allowlist_builds_only_the_listed_types(store: Store) -> None:
    """With allowed_msgpack_modules, a listed type is rebuilt and an unlisted one is not."""
    serde = JsonPlusSerializer(allowed_msgpack_modules=[(__name__, "Point")])
    saver = WalCheckpointSaver(store, serde=serde, worker_id="strict")
    thread = Thread(saver, "allowlist")
    stored = await thread.put({"point": Point(3, 4), "other": Unlisted("no")})
    loaded = await saver.aget_tuple({"configurable": stored["configurable"]})
    assert loaded is not None
    values = loaded.checkpoint["channel_values"]
    assert values["point"] == Point(3, 4)
    assert not isinstance(values["other"], Unlisted)


STRICT_PROBE = textwrap.dedent("""
    import asyncio, dataclasses, enum, json, sys
    from typing import Any
    from langgraph.graph import END, START, StateGraph
    from wal_engine.integrations.langgraph import WalCheckpointSaver

    class Mood(enum.Enum):
        CALM = "calm"
        ANGRY = "angry"

    @dataclasses.dataclass
    class Loose:
        label: str

    @dataclasses.dataclass
    class State:
        mood: Mood = Mood.CALM
        loose: Any = None

    def step(state):
        return {"mood": Mood.ANGRY, "loose": Loose("x")}

    async def main():
        builder = StateGraph(State)
        builder.add_node("step", step)
        builder.add_edge(START, "step")
        builder.add_edge("step", END)
        async with WalCheckpointSaver.from_dsn(sys.argv[1]) as saver:
            graph = builder.compile(checkpointer=saver)
            config = {"configurable": {"thread_id": "strict"}}
            await graph.ainvoke(State(), config)
            values = (await graph.aget_state(config)).values
            print(json.dumps({"mood": type(values["mood"]).__name__,
                              "loose": type(values["loose"]).__name__}))

    asyncio.run(main())
""")


def test_strict_msgpack_mode_limits_types_to_the_graph_schema(database_dsn: str) -> None:
    """LANGGRAPH_STRICT_MSGPACK=true: schema types round-trip, a type outside them does not."""
    environment = {**os.environ, "LANGGRAPH_STRICT_MSGPACK": "true",
                   "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", STRICT_PROBE, database_dsn],
                            capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "mood": "Mood", "loose": "dict"}


async def test_building_a_saver_draws_no_randomness(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No uuid4 and no random draw when a saver is built; its writer id is made on first write."""
    drawn: list[str] = []
    real_uuid4 = uuid.uuid4

    def counting_uuid4() -> uuid.UUID:
        drawn.append("uuid4")
        return real_uuid4()

    monkeypatch.setattr(uuid, "uuid4", counting_uuid4)
    random.seed(7)
    expected = random.random()
    random.seed(7)
    saver = WalCheckpointSaver(store)
    assert drawn == []
    assert random.random() == expected
    await Thread(saver, "lazy-id").put({"a": 1})
    history = await store.history(thread_task_id("lazy-id"))
    claims = [json.loads(record.payload) for record in history if record.type == "task_claimed"]
    assert len(claims) == 1
    host_pid = claims[0]["worker_id"].rsplit(":", 1)[0]
    assert host_pid.startswith("langgraph:") and host_pid.endswith(f":{os.getpid()}")
    assert saver.thread_log.worker_id == claims[0]["worker_id"]


async def test_sends_of_checkpoints_before_format_4_are_migrated(store: Store) -> None:
    """A format-3 checkpoint reads its parent's __pregel_tasks writes as that channel."""
    saver = WalCheckpointSaver(store, worker_id="sends")
    config: Any = {"configurable": {"thread_id": "sends", "checkpoint_ns": ""}}
    first = empty_checkpoint()
    first["v"] = 3
    config = await saver.aput(config, first, {}, {})
    await saver.aput_writes(config, [(TASKS, "b-0"), ("other", 5), (TASKS, "b-1")], "task-b",
                            "~path-b")
    await saver.aput_writes(config, [(TASKS, "a-0")], "task-a", "~path-a")
    parent = await saver.aget_tuple(config)
    assert parent is not None and parent.checkpoint["channel_values"] == {}
    second = create_checkpoint(first, None, 1)
    second["v"] = 3
    second["channel_values"] = {"counter": 1}
    second["channel_versions"] = {"counter": 3}
    config = await saver.aput(config, second, {}, {"counter": 3})
    fresh = WalCheckpointSaver(store, worker_id="sends-reader")
    loaded = await fresh.aget_tuple(config)
    assert loaded is not None
    assert loaded.checkpoint["channel_values"] == {"counter": 1,
                                                   TASKS: ["a-0", "b-0", "b-1"]}
    assert loaded.checkpoint["channel_versions"][TASKS] == 3
    listed = [found async for found in fresh.alist({"configurable": {"thread_id": "sends"}})]
    assert [found.checkpoint["channel_values"].get(TASKS) for found in listed] == [
        ["a-0", "b-0", "b-1"], None]
    await saver.aput_writes(config, [(TASKS, "c-0")], "task-c")
    current = create_checkpoint(second, None, 2)  # format 4: its sends are a channel already
    current["v"] = 4
    current["channel_values"] = {"counter": 2}
    current["channel_versions"] = {"counter": 4}
    config = await saver.aput(config, current, {}, {"counter": 4})
    latest = await fresh.aget_tuple(config)
    assert latest is not None and TASKS not in latest.checkpoint["channel_values"]


PLAN_TABLES = ("wal_tasks", "wal_events", "wal_graph_threads", "wal_graph_checkpoints",
               "wal_graph_writes")
"""Every table a list of one thread reads."""


def plan_nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan tree, depth first."""
    found = [plan]
    for child in plan.get("Plans", []):
        found.extend(plan_nodes(child))
    return found


async def test_listing_a_long_thread_uses_the_index_without_statistics(store: Store) -> None:
    """On a database never analyzed, every plan of listing a 1,000-step thread is index scans."""
    database = store.database
    saver = WalCheckpointSaver(store, worker_id="plans")
    await saver.setup()
    async with database.acquire() as connection:
        for table in PLAN_TABLES:
            # A partitioned table (the log's, decision 70) takes storage parameters on its
            # leaves only: every partition of it, or the table itself.
            leaves = await connection.fetch(
                "SELECT relid::regclass::text AS leaf FROM pg_partition_tree($1::regclass)"
                " WHERE isleaf", table)
            for leaf in [row["leaf"] for row in leaves] or [table]:
                await connection.execute(f"ALTER TABLE {leaf} SET (autovacuum_enabled = off)")
    thread = Thread(saver, "long")
    await thread.put({"document": "v0", "counter": 0})
    for step in range(1, 1000):
        await thread.put({"counter": step})
    never = await database.fetch(
        "SELECT relname FROM pg_stat_user_tables WHERE relname = ANY($1::text[])"
        " AND last_analyze IS NULL AND last_autoanalyze IS NULL", list(PLAN_TABLES))
    assert len(never) == len(PLAN_TABLES)
    started = time.perf_counter()
    listed = [found async for found in saver.alist({"configurable": {"thread_id": "long"}})]
    elapsed_s = time.perf_counter() - started
    assert len(listed) == 1000
    print(f"listed 1000 checkpoints in {elapsed_s:.3f} s")
    task_id = thread_task_id("long")
    middle = listed[500].checkpoint["id"]
    by_position = {"wal_graph_checkpoints_by_position"}
    by_key = {"wal_graph_checkpoints_pkey", "wal_graph_checkpoints_by_position"}  # either fits
    statements = {
        "first page": (by_position, queries.LIST_THREAD, task_id, None, 100, 10_000),
        "next page": (by_position, queries.LIST_THREAD_BELOW, task_id, middle, "", None, 100,
                      10_000),
        "namespace": (by_key, queries.LIST_NAMESPACE, task_id, "", None, 100, 10_000),
        "namespace next": (by_key, queries.LIST_NAMESPACE_BELOW, task_id, "", middle, None, 100,
                           10_000),
    }
    for mode in ("force_custom_plan", "force_generic_plan"):
        for name, (index, statement, *arguments) in statements.items():
            async with database.acquire() as connection:
                async with connection.transaction():
                    await connection.execute(f"SET LOCAL plan_cache_mode = {mode}")
                    rows = await connection.fetchval(
                        "EXPLAIN (FORMAT JSON) " + statement, *arguments)
            nodes = plan_nodes(json.loads(rows)[0]["Plan"])
            scans = {(node["Node Type"], node.get("Relation Name"), node.get("Index Name"),
                      node.get("Scan Direction")) for node in nodes if "Relation Name" in node}
            assert not [scan for scan in scans if scan[0] == "Seq Scan"], (mode, name, scans)
            assert not [node for node in nodes if node["Node Type"] == "Sort"], (mode, name)
            assert [scan for scan in scans if scan[:2] == ("Index Scan", "wal_graph_checkpoints")
                    and scan[2] in index and scan[3] == "Backward"], (mode, name, scans)


async def test_metadata_integers_beyond_64_bits_are_kept_exactly(store: Store) -> None:
    """Integers past 2^63 in metadata are stored, read back exactly and matched by filters."""
    saver = WalCheckpointSaver(store, worker_id="big")
    big, negative = 2**64, -(2**70)
    thread = Thread(saver, "big")
    first = await thread.put({"a": 1}, n=big, nested={"m": [negative, 5]})
    await thread.put({"a": 2}, n=str(big))  # the same digits as text: a different value
    await thread.put({"a": 3}, n=2**63 - 1)
    fresh = WalCheckpointSaver(store, worker_id="big-reader")
    loaded = await fresh.aget_tuple({"configurable": first["configurable"]})
    assert loaded is not None
    assert loaded.metadata["n"] == big and type(loaded.metadata["n"]) is int
    assert loaded.metadata["nested"] == {"m": [negative, 5]}
    config: Any = {"configurable": {"thread_id": "big"}}
    matched = [found.metadata["n"] async for found in fresh.alist(config, filter={"n": big})]
    assert matched == [big]
    as_text = [found.metadata["n"] async for found in fresh.alist(config,
                                                                  filter={"n": str(big)})]
    assert as_text == [str(big)]
    nested = [found.config["configurable"]["checkpoint_id"] async for found in fresh.alist(
        None, filter={"nested": {"m": [negative]}})]
    assert nested == [first["configurable"]["checkpoint_id"]]
    copied = WalCheckpointSaver(store, worker_id="big-copy")
    await copied.acopy_thread("big", "big-copy")
    again = await copied.aget_tuple({"configurable": {**first["configurable"],
                                                      "thread_id": "big-copy"}})
    assert again is not None and again.metadata["n"] == big
    assert all([(await store.verify_task(thread_task_id(name))).ok for name in ("big", "big-copy")])


def test_the_readme_langgraph_example_runs(database_dsn: str) -> None:
    """The README's LangGraph example runs as written and prints the graph's reply."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    (block,) = [text for text in re.findall(r"```python\n(.*?)```", readme, re.S)
                if "WalCheckpointSaver" in text]
    environment = {**os.environ, "WAL_ENGINE_DSN": database_dsn,
                   "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                            timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "seen 1 messages"
