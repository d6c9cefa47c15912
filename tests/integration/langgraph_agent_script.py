"""A LangGraph ReAct agent on WalCheckpointSaver, run as a subprocess by the kill test.

Usage::

    python langgraph_agent_script.py DSN THREAD_ID MODE

``MODE`` is ``run`` (answer a question from scratch), ``crash`` (the same, but announce
``READY`` on stdout and block at the third model call, after the second tool call is
checkpointed, until the parent kills the process) or ``resume`` (continue the thread from the
log). The answer is printed as one line ``ANSWER <json>``.

The agent is a ReAct loop built as a LangGraph ``StateGraph``: a model node and LangGraph's
prebuilt ``ToolNode``, routed by ``tools_condition`` (what the deprecated prebuilt
``create_react_agent`` builds), driven by a subclass of langchain-core's fake chat model.
Its replies are chosen from the conversation (how many tool results it holds), not from a
counter, so a new process that resumes the thread gets the same replies. Its tools record
every execution in the table ``tool_executions`` (thread, call id, tool, process id).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import orjson
import structlog
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from wal_engine.integrations.langgraph import WalCheckpointSaver

QUESTION = "What is ((2 + 3) * 7) - 4?"
CREATE_TOOL_TABLE = """
CREATE TABLE IF NOT EXISTS tool_executions (
    id      bigserial PRIMARY KEY,
    thread  text NOT NULL,
    call_id text NOT NULL,
    tool    text NOT NULL,
    result  text NOT NULL,
    pid     integer NOT NULL
)
"""
RECORD_EXECUTION = """
INSERT INTO tool_executions (thread, call_id, tool, result, pid) VALUES ($1, $2, $3, $4, $5)
"""

_saver: WalCheckpointSaver | None = None
_thread = ""
_block_at_call: int | None = None


async def _record(call_id: str, name: str, result: int) -> str:
    assert _saver is not None
    await _saver.database.fetch(RECORD_EXECUTION, _thread, call_id, name, str(result),
                                os.getpid())
    return str(result)


@tool
async def add(a: int, b: int) -> str:
    """Add two integers."""
    return await _record("call-add", "add", a + b)


@tool
async def multiply(a: int, b: int) -> str:
    """Multiply two integers."""
    return await _record("call-multiply", "multiply", a * b)


@tool
async def subtract(a: int, b: int) -> str:
    """Subtract b from a."""
    return await _record("call-subtract", "subtract", a - b)


def _reply(messages: list[BaseMessage]) -> AIMessage:
    """The model's reply, a pure function of the tool results seen so far."""
    results = [int(str(m.content)) for m in messages if isinstance(m, ToolMessage)]
    plan = [("add", {"a": 2, "b": 3}), ("multiply", {"b": 7}), ("subtract", {"b": 4})]
    if len(results) < len(plan):
        name, args = plan[len(results)]
        if results:
            args = {"a": results[-1], **args}
        call = {"name": name, "args": args, "id": f"call-{name}", "type": "tool_call"}
        return AIMessage(content="", tool_calls=[call])
    return AIMessage(content=f"The answer is {results[-1]}.")


class ScriptedChatModel(FakeMessagesListChatModel):
    """langchain-core's fake chat model, replying from the conversation instead of a counter."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        """Tools are known to the script already; binding changes nothing."""
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=_reply(messages))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: Any = None, **kwargs: Any) -> ChatResult:
        calls = sum(isinstance(m, AIMessage) for m in messages) + 1
        if _block_at_call is not None and calls == _block_at_call:
            print("READY", flush=True)
            await asyncio.Event().wait()  # Until SIGKILL: the parent kills us here.
        return self._generate(messages, stop, run_manager, **kwargs)


def build_agent() -> StateGraph[MessagesState]:
    """The ReAct loop: call the model; while it asks for tools, run them and call it again."""
    tools = [add, multiply, subtract]
    model = ScriptedChatModel(responses=[AIMessage(content="unused")]).bind_tools(tools)

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph


async def main(dsn: str, thread: str, mode: str) -> None:
    global _saver, _thread, _block_at_call
    _thread = thread
    _block_at_call = 3 if mode == "crash" else None
    async with WalCheckpointSaver.from_dsn(dsn, worker_id=f"agent-{mode}-{os.getpid()}") as saver:
        _saver = saver
        await saver.database.fetch(CREATE_TOOL_TABLE)
        agent = build_agent().compile(checkpointer=saver)
        config: Any = {"configurable": {"thread_id": thread}}
        inputs = None if mode == "resume" else {"messages": [("user", QUESTION)]}
        # durability="sync": each step's checkpoint is committed before the next step starts,
        # so "after the second tool call" is a well-defined point in the log.
        state = await agent.ainvoke(inputs, config, durability="sync")
        messages = [{"type": m.type, "content": m.content} for m in state["messages"]]
        print("ANSWER " + orjson.dumps(messages).decode(), flush=True)


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
