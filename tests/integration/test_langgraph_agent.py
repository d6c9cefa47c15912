"""A real LangGraph agent on the saver: killed with SIGKILL and resumed, and time travel."""

from __future__ import annotations

import asyncio
import operator
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

import orjson
import pytest

pytest.importorskip(
    "langgraph.prebuilt",
    reason="the [langgraph] extra is not installed: pip install 'wal-engine[langgraph]'",
)

from langgraph.graph import END, START, StateGraph

from wal_engine.integrations.langgraph import WalCheckpointSaver, thread_task_id
from wal_engine.store import Store

SCRIPT = Path(__file__).with_name("langgraph_agent_script.py")
LINE_DEADLINE_S = 120.0
"""Longest wait for the agent process's next line (it answers in about a second)."""


class AgentProcess:
    """The agent script in a subprocess; stdout read line by line, stderr kept in a file."""

    def __init__(self, dsn: str, thread: str, mode: str, stderr_path: Path) -> None:
        self.args = (sys.executable, str(SCRIPT), dsn, thread, mode)
        self.stderr_path = stderr_path
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Start the process."""
        with self.stderr_path.open("wb") as stderr:
            self.process = await asyncio.create_subprocess_exec(
                *self.args, stdout=asyncio.subprocess.PIPE, stderr=stderr)

    async def wait_for_line(self, prefix: str) -> str:
        """The first stdout line starting with ``prefix``, within the deadline."""
        assert self.process is not None and self.process.stdout is not None
        async with asyncio.timeout(LINE_DEADLINE_S):
            while True:
                line = await self.process.stdout.readline()
                if not line:
                    raise AssertionError(f"agent exited before {prefix!r}: {self.stderr()}")
                if line.decode().startswith(prefix):
                    return line.decode().removeprefix(prefix).strip()

    async def finish(self) -> int:
        """Wait for the exit code."""
        assert self.process is not None
        async with asyncio.timeout(LINE_DEADLINE_S):
            return await self.process.wait()

    def stderr(self) -> str:
        """The last lines the process wrote on stderr (for failure messages)."""
        return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-20:])


async def run_agent(dsn: str, thread: str, mode: str, tmp_path: Path) -> list[Any]:
    """Run the agent to its answer in a fresh process; return its final messages."""
    agent = AgentProcess(dsn, thread, mode, tmp_path / f"{thread}-{mode}.stderr")
    await agent.start()
    answer = orjson.loads(await agent.wait_for_line("ANSWER "))
    assert await agent.finish() == 0, agent.stderr()
    return list(answer)


async def test_agent_killed_after_second_tool_call_resumes_in_a_new_process(
    database_dsn: str, store: Store, tmp_path: Path
) -> None:
    """SIGKILL after tool call 2; a new process finishes from the log: same answer, no tool
    run twice, takeover recorded, chain verified."""
    uninterrupted = await run_agent(database_dsn, "agent-full", "run", tmp_path)
    crashing = AgentProcess(database_dsn, "agent-crash", "crash", tmp_path / "crash.stderr")
    await crashing.start()
    await crashing.wait_for_line("READY")
    assert crashing.process is not None
    crashing.process.send_signal(signal.SIGKILL)
    assert await crashing.finish() == -signal.SIGKILL
    resumed = await run_agent(database_dsn, "agent-crash", "resume", tmp_path)

    assert resumed == uninterrupted
    assert resumed[-1] == {"type": "ai", "content": "The answer is 31."}
    executions = await store.database.fetch(
        "SELECT call_id, pid FROM tool_executions WHERE thread = 'agent-crash' ORDER BY id")
    assert [row["call_id"] for row in executions] == [
        "call-add", "call-multiply", "call-subtract"]
    killed_pid = executions[0]["pid"]
    assert [row["pid"] == killed_pid for row in executions] == [True, True, False]
    task_id = thread_task_id("agent-crash")
    transitions = [r.type for r in await store.history(task_id)
                   if not r.type.startswith("graph_")]
    assert transitions == ["task_submitted", "task_claimed", "task_orphaned", "task_resumed"]
    assert (await store.verify_task(task_id)).ok


class Counted(TypedDict):
    """State of the time-travel graph: the steps taken, in order."""

    steps: Annotated[list[str], operator.add]


def counting_graph(executions: dict[str, int]) -> StateGraph[Counted]:
    """START -> a -> b -> c -> END; each node appends its name and counts its runs."""
    graph = StateGraph(Counted)
    for name in ("a", "b", "c"):
        def node(state: Counted, name: str = name) -> dict[str, list[str]]:
            executions[name] = executions.get(name, 0) + 1
            return {"steps": [name]}
        graph.add_node(name, node)
    graph.add_edge(START, "a")
    graph.add_edge("a", "b")
    graph.add_edge("b", "c")
    graph.add_edge("c", END)
    return graph


async def test_time_travel_lists_every_checkpoint_and_forks_in_the_log(store: Store) -> None:
    """get_state_history lists every checkpoint; replaying and forking from an earlier one
    work and show in the log as checkpoints whose parent is that earlier one."""
    saver = WalCheckpointSaver(store)
    await saver.setup()
    executions: dict[str, int] = {}
    graph = counting_graph(executions).compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": "travel"}}
    assert await graph.ainvoke({"steps": []}, config) == {"steps": ["a", "b", "c"]}

    history = [snapshot async for snapshot in graph.aget_state_history(config)]
    logged = await store.database.fetch(
        "SELECT payload ->> 'checkpoint_id' AS id FROM wal_events_json"
        " WHERE task_id = $1 AND type = 'graph_checkpoint_saved' ORDER BY seq DESC",
        thread_task_id("travel"))
    assert [s.config["configurable"]["checkpoint_id"] for s in history] == [
        row["id"] for row in logged]
    after_a = next(s for s in history if s.next == ("b",))

    replayed = await graph.ainvoke(None, after_a.config)
    assert replayed == {"steps": ["a", "b", "c"]}
    assert executions == {"a": 1, "b": 2, "c": 2}

    forked_config = await graph.aupdate_state(after_a.config, {"steps": ["edited"]})
    forked = await graph.ainvoke(None, forked_config)
    assert forked == {"steps": ["a", "edited", "b", "c"]}

    children = await store.database.fetch(
        "SELECT payload -> 'metadata' ->> 'source' AS source FROM wal_events_json"
        " WHERE task_id = $1 AND type = 'graph_checkpoint_saved'"
        "   AND payload ->> 'parent_checkpoint_id' = $2 ORDER BY seq",
        thread_task_id("travel"), after_a.config["configurable"]["checkpoint_id"])
    assert [row["source"] for row in children] == ["loop", "fork", "update"]
    everything = [s async for s in graph.aget_state_history(config)]
    saved = await store.database.fetchrow(
        "SELECT count(*) AS n FROM wal_events WHERE task_id = $1"
        " AND type = 'graph_checkpoint_saved'", thread_task_id("travel"))
    assert len(everything) == saved["n"] == len(history) + 6  # fork and update: 3 each
    assert (await store.verify_task(thread_task_id("travel"))).ok
