"""``@engine.agent`` takes the input type from the annotation of the agent's input parameter:
submissions are checked against it before anything is written, and the agent receives its
input converted to that type. Unannotated (or ``Any``) agents get the plain JSON value, as
before; ``engine.worker`` and ``connect`` take a config or keywords, not both."""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

import msgspec
import pytest

from wal_engine.engine import Engine, EngineConfig, connect
from wal_engine.errors import ConfigurationError, InvalidInput
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.worker import WorkerConfig
from wal_engine.state_machine import Status


class Order(msgspec.Struct, frozen=True):
    item: str
    quantity: int


@dataclasses.dataclass(frozen=True)
class Parcel:
    weight_g: int
    fragile: bool = False


class Note(TypedDict):
    text: str
    stars: int


async def _finish(engine: Engine, task_id: str) -> Any:
    await engine.worker(poll_ms=50, concurrency=2).run(until_idle=True)
    state = await engine.wait(task_id, timeout_s=20)
    assert state.status is Status.COMPLETED, state.failure
    return state.output


async def _refused(engine: Engine, agent: str, value: Any) -> None:
    with pytest.raises(InvalidInput, match=f"input for agent '{agent}' is invalid"):
        await engine.submit(agent, value)


def _register(engine: Engine) -> None:
    @engine.agent("struct")
    async def struct(ctx: AgentContext, order: Order) -> dict[str, Any]:
        assert isinstance(order, Order)
        return {"got": type(order).__name__, "total": order.quantity * 2}

    @engine.agent("dataclass")
    async def parcel(ctx: AgentContext, parcel: Parcel) -> dict[str, Any]:
        assert isinstance(parcel, Parcel)
        return {"got": type(parcel).__name__, "fragile": parcel.fragile}

    @engine.agent("typeddict")
    async def note(ctx: AgentContext, note: Note) -> dict[str, Any]:
        return {"got": type(note).__name__, "stars": note["stars"]}

    @engine.agent("dict")
    async def counts(ctx: AgentContext, counts: dict[str, int]) -> int:
        return sum(counts.values())

    @engine.agent("plain")
    async def plain(ctx, value):  # type: ignore[no-untyped-def]
        return {"got": type(value).__name__, "value": value}

    @engine.agent("explicit", input_type=Order)
    async def explicit(ctx: AgentContext, task_input: Any) -> dict[str, Any]:
        return {"got": type(task_input).__name__}


async def test_annotated_inputs_are_checked_at_submit_and_converted_for_the_agent(
        engine: Engine) -> None:
    """Struct, dataclass, TypedDict and dict annotations: a mismatch is InvalidInput at
    submit (nothing written), a match reaches the agent as the annotated type."""
    _register(engine)
    await _refused(engine, "struct", {"item": "x", "quantity": "many"})
    await _refused(engine, "dataclass", {"weight_g": 12, "fragile": "yes"})
    await _refused(engine, "typeddict", {"text": "fine"})
    await _refused(engine, "dict", {"a": "one"})
    await _refused(engine, "explicit", {"item": 3})
    assert await engine.store.list_tasks() == []
    struct = await engine.submit("struct", {"item": "x", "quantity": 3})
    parcel = await engine.submit("dataclass", {"weight_g": 12})
    note = await engine.submit("typeddict", {"text": "fine", "stars": 4})
    counts = await engine.submit("dict", {"a": 1, "b": 2})
    assert await _finish(engine, struct) == {"got": "Order", "total": 6}
    assert await _finish(engine, parcel) == {"got": "Parcel", "fragile": False}
    assert await _finish(engine, note) == {"got": "dict", "stars": 4}
    assert await _finish(engine, counts) == 3


async def test_unannotated_and_any_inputs_stay_plain_json(engine: Engine) -> None:
    """No annotation: any JSON value, received as stored; an explicit input_type with an
    ``Any`` parameter checks at submit and still hands the agent the plain dict."""
    _register(engine)
    listed = await engine.submit("plain", [1, "two"])
    explicit = await engine.submit("explicit", {"item": "x", "quantity": 1})
    assert await _finish(engine, listed) == {"got": "list", "value": [1, "two"]}
    assert await _finish(engine, explicit) == {"got": "dict"}


async def test_a_stored_input_that_no_longer_converts_fails_the_task(engine: Engine) -> None:
    """A task whose stored input does not match the annotation (submitted before the agent
    declared it) fails with the conversion error, like any agent failure."""
    task_id = await engine.submit("struct", {"item": "x"})  # not registered yet: unchecked
    _register(engine)
    await engine.worker(poll_ms=50).run(until_idle=True)
    state = await engine.wait(task_id, timeout_s=20)
    assert state.status is Status.FAILED
    assert "does not match" in str(state.failure)


async def test_the_decorator_returns_the_function_itself(engine: Engine) -> None:
    """The decorated name is the user's function (its type and identity unchanged)."""
    async def agent(ctx: AgentContext, order: Order) -> int:
        return order.quantity

    assert engine.agent("same")(agent) is agent
    assert engine.agents["same"].input_type is Order
    assert engine.agents["same"].function.__wrapped__ is agent


def test_an_annotation_that_cannot_be_resolved_is_refused_unless_input_type_is_given(
        engine: Engine) -> None:
    """A type named only inside a function cannot be found by name later: refused with the
    advice, unless ``input_type`` says what to check (the function then gets plain JSON)."""
    class Local(msgspec.Struct):
        x: int

    async def agent(ctx: AgentContext, value: Local) -> int:
        return 1

    with pytest.raises(ConfigurationError, match="cannot be resolved"):
        engine.agent("local")(agent)
    assert "local" not in engine.agents
    engine.agent("local", input_type=Local)(agent)
    assert engine.agents["local"].input_type is Local
    assert engine.agents["local"].function is agent


async def test_worker_takes_a_config_or_keywords_not_both(engine: Engine) -> None:
    """``engine.worker(WorkerConfig(...))`` and the keyword shortcut; both, an unknown
    keyword or a value WorkerConfig refuses are ConfigurationError."""
    _register(engine)
    assert engine.worker(WorkerConfig(concurrency=3)).config.concurrency == 3
    assert engine.worker(concurrency=5, poll_ms=20).config == WorkerConfig(concurrency=5,
                                                                           poll_ms=20)
    with pytest.raises(ConfigurationError, match="not both"):
        engine.worker(WorkerConfig(), concurrency=2)
    with pytest.raises(ConfigurationError, match="unknown option"):
        engine.worker(concurency=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="concurrency must be at least 1"):
        engine.worker(concurrency=0)


async def test_connect_takes_a_config_or_keywords_not_both(database_dsn: str) -> None:
    """``connect(dsn, config=EngineConfig(...))`` opens an engine with those options; a
    config with keywords, or an unknown keyword, is ConfigurationError before any I/O."""
    config = EngineConfig(migrate=False, pool_size_max=3, llm_spend_max_usd=2.5)
    async with await connect(database_dsn, config=config) as engine:
        assert engine.llm_spend_max_usd == 2.5
    with pytest.raises(ConfigurationError, match="not both"):
        await connect(database_dsn, config=config, migrate=False)
    with pytest.raises(ConfigurationError, match="unknown option"):
        await connect(database_dsn, migrat=False)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="payload_bytes_max"):
        await connect(database_dsn, payload_bytes_max=0)
