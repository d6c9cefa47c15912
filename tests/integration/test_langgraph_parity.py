"""The LangGraph saver behaves as LangGraph's own savers do: serializer, ids, sends, plans."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import random
import subprocess
import sys
import textwrap
import uuid
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

from wal_engine.integrations.langgraph import WalCheckpointSaver, thread_task_id
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
