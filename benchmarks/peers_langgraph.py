"""LangGraph in the suite: a real compiled ``StateGraph`` on ``AsyncPostgresSaver``.

The graph has one node, ``step``, looping on itself: each run of the node is one step (one
superstep, one checkpoint). The state is ``messages: Annotated[list, operator.add]``, the
documented way to keep a growing message list; the node adds one ~500-byte message and
one ~1 KB tool result (plain dicts, LangGraph's cheapest encoding), so the state after step
k holds all 2k messages. Graphs run with ``durability="sync"``: a step's checkpoint is
committed before the next step starts, the guarantee wal-engine's write-ahead gives (the
default, ``"async"``, lets the next step act before the previous one is durable).

The saver is opened as LangGraph's documentation says: on a psycopg ``AsyncConnectionPool``
(autocommit, ``prepare_threshold=0``, ``dict_row``) for the live graphs, with
``AsyncPostgresSaver.from_conn_string`` for the fresh saver a resume reads with.

``AsyncPostgresSaver`` stores each changed channel whole at every checkpoint, so a step of a
k-step thread writes all 2k messages again: bytes per step grow linearly with the history.
A 10,000-step thread written step by step would take tens of gigabytes; above
``REAL_STEPS_MAX`` steps, the history build therefore writes the first steps' messages as
one state update (``aupdate_state``) and runs only the measured window of steps for real.
The resume of that thread reads a checkpoint identical to one written step by step.
"""

from __future__ import annotations

import asyncio
import operator
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Final, NotRequired, TypedDict

import asyncpg
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from benchmarks.peers_workload import (
    CONCURRENT_TASKS,
    Driver,
    StepClock,
    history_figures,
    message,
    result,
    tables_bytes,
)
from wal_engine import limits

NAME: Final = "LangGraph AsyncPostgresSaver"
TABLE_PATTERNS: Final = ("checkpoint%",)
REAL_STEPS_MAX: Final = 1000
"""Above this, a history build writes its first steps as one state update (see above)."""
RECURSION_LIMIT: Final = 10**7
DURABILITY: Final = "sync"
PACKAGES: Final = ("langgraph", "langgraph-checkpoint", "langgraph-checkpoint-postgres",
                   "psycopg")


class AgentState(TypedDict):
    """The graph's state: every message so far, and whether the run should end."""

    messages: Annotated[list[dict[str, str]], operator.add]
    finished: NotRequired[bool]


def step_update(step: int) -> dict[str, Any]:
    """What the node of step ``step`` writes: one message and one tool result."""
    return {"messages": [{"role": "assistant", "content": message(step)},
                         {"role": "tool", "content": result(step)}]}


def _route(state: AgentState) -> str:
    return END if state.get("finished") else "step"


def compile_graph(node: Any, saver: AsyncPostgresSaver) -> Any:
    """The one-node looping graph on ``saver``."""
    builder = StateGraph(AgentState)
    builder.add_node("step", node)
    builder.add_edge(START, "step")
    builder.add_conditional_edges("step", _route, ["step", END])
    return builder.compile(checkpointer=saver)


def thread_config(thread_id: str) -> Any:
    """The run config of a thread (no recursion limit in practice)."""
    return {"configurable": {"thread_id": thread_id}, "recursion_limit": RECURSION_LIMIT}


async def open_pool(dsn: str, size: int) -> AsyncConnectionPool[Any]:
    """A psycopg pool configured as AsyncPostgresSaver's documentation says."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn, min_size=size, max_size=size, open=False,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
    )
    await pool.open(wait=True, timeout=limits.connect_timeout_s)
    return pool


class LangGraphPeer:
    """The in-process contender: 1 + 64 threads of the driven graph on a pool of 65."""

    name = NAME

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.driver = Driver()
        self.pool: AsyncConnectionPool[Any] | None = None
        self.runs: list[asyncio.Task[None]] = []
        self.thread_ids: list[str] = []
        self.stepped: set[str] = set()

    async def _node(self, state: AgentState, config: RunnableConfig) -> dict[str, Any]:
        thread_id = config["configurable"]["thread_id"]
        if thread_id in self.stepped:
            # The previous step's checkpoint is durable once the next step starts.
            self.driver.done[thread_id].put_nowait(None)
        self.stepped.add(thread_id)
        if not await self.driver.go[thread_id].get():
            return {"finished": True}
        return step_update(len(state["messages"]) // 2)

    async def open(self) -> None:
        """Open the pool and the saver; start every thread's graph run."""
        self.pool = await open_pool(self.dsn, CONCURRENT_TASKS + 1)
        saver = AsyncPostgresSaver(self.pool)
        await saver.setup()
        graph = compile_graph(self._node, saver)
        run = uuid.uuid4().hex[:8]
        self.thread_ids = [f"lg-seq-{run}"] + [f"lg-c{i:02d}-{run}"
                                               for i in range(CONCURRENT_TASKS)]
        for thread_id in self.thread_ids:
            self.driver.add(thread_id)
            self.runs.append(asyncio.create_task(graph.ainvoke(
                {"messages": []}, thread_config(thread_id), durability=DURABILITY)))

    async def step_one(self) -> None:
        """One step of the sequential thread."""
        await self.driver.step(self.thread_ids[0])

    async def step_all(self) -> None:
        """One step of each of the 64 concurrent threads, all at once."""
        await asyncio.gather(*(self.driver.step(t) for t in self.thread_ids[1:]))

    async def extra(self) -> dict[str, Any]:
        """Nothing beyond the common figures."""
        return {}

    async def close(self) -> None:
        """End every run, close the pool."""
        for thread_id in self.thread_ids:
            await self.driver.stop(thread_id)
        if self.runs:
            await asyncio.wait_for(asyncio.gather(*self.runs), 120)
        if self.pool is not None:
            await self.pool.close()


def live_peer(arguments: dict[str, Any]) -> LangGraphPeer:
    """(Child) The live contender of ``serve``."""
    return LangGraphPeer(arguments["dsn"])


# ----------------------------------------------------------------------------- histories


async def build(arguments: dict[str, Any]) -> dict[str, Any]:
    """(Child) Write a thread of ``steps`` steps through the graph; measure its tables."""
    dsn, steps, window = arguments["dsn"], int(arguments["steps"]), int(arguments["window"])
    thread_id = arguments["task_id"]
    pause_at = steps - window
    reached, release = asyncio.Event(), asyncio.Event()
    clock = StepClock()

    async def node(state: AgentState) -> dict[str, Any]:
        step = len(state["messages"]) // 2
        if step >= steps:
            return {"finished": True}
        if step == pause_at:
            reached.set()
            await release.wait()
        clock.steps += 1
        return step_update(step)

    connection = await asyncpg.connect(dsn, timeout=limits.connect_timeout_s)
    try:
        async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
            await saver.setup()
            graph = compile_graph(node, saver)
            config = thread_config(thread_id)
            before = await tables_bytes(connection, "public", TABLE_PATTERNS)
            bulk = steps > int(arguments.get("real_steps_max", REAL_STEPS_MAX))
            if bulk:
                prefix = [m for step in range(pause_at) for m in step_update(step)["messages"]]
                await graph.aupdate_state(config, {"messages": prefix}, as_node="step")
            clock.started = time.perf_counter()
            run = asyncio.create_task(graph.ainvoke(
                None if bulk else {"messages": []}, config, durability=DURABILITY))
            await reached.wait()
            middle = await tables_bytes(connection, "public", TABLE_PATTERNS)
            clock.mark_window()
            release.set()
            await run
            after = await tables_bytes(connection, "public", TABLE_PATTERNS)
    finally:
        await connection.close()
    return history_figures(steps=steps, window=window, before=before, middle=middle,
                           after=after, clock=clock, whole=not bulk,
                           extra={"bulk_prefix": bulk})


def resume_operation(dsn: str, thread_id: str, steps: int) -> Callable[[], Awaitable[int]]:
    """Time ``aget_tuple`` of the newest checkpoint on a fresh saver (opened untimed)."""
    config: Any = {"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}}

    async def operation() -> int:
        async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
            start = time.perf_counter_ns()
            loaded = await saver.aget_tuple(config)
            elapsed = time.perf_counter_ns() - start
        assert loaded is not None
        messages = loaded.checkpoint["channel_values"]["messages"]
        assert len(messages) == 2 * steps, (len(messages), steps)
        return elapsed

    return operation
