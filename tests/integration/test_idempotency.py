"""The idempotency gateway on real PostgreSQL: once per key, races, expiry, epoch fencing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from wal_engine.effects.gateway import Claim, EffectFailed, IdempotencyGateway, StaleEpoch
from wal_engine.store import Database


def claim(owner: str, epoch: int, key: str = "idem:t:3") -> Claim:
    """A claim on ``key`` by ``owner`` at ``epoch``."""
    return Claim(key=key, owner=owner, epoch=epoch, task_id="t")


async def test_second_caller_gets_the_first_result_without_acting(database: Database) -> None:
    """Once a key completed, later callers get its result and the effect does not run."""
    gateway = IdempotencyGateway(database)
    acted: list[str] = []

    async def effect(name: str) -> Any:
        acted.append(name)
        return {"by": name}

    assert await gateway.run_once(claim("a", 1), lambda: effect("a")) == {"by": "a"}
    assert await gateway.run_once(claim("b", 1), lambda: effect("b")) == {"by": "a"}
    assert acted == ["a"]


async def test_two_racing_callers_act_once(database: Database) -> None:
    """Two workers racing on one key: one acts, both get its result."""
    gateway = IdempotencyGateway(database)
    acted: list[str] = []
    gate = asyncio.Event()

    async def effect(name: str) -> Any:
        acted.append(name)
        await gate.wait()
        return name

    first = asyncio.create_task(gateway.run_once(claim("a", 1), lambda: effect("a")))
    second = asyncio.create_task(gateway.run_once(claim("b", 1), lambda: effect("b")))
    await asyncio.sleep(0.2)  # Both have tried to claim; at most one may be inside.
    gate.set()
    results = await asyncio.gather(first, second)
    assert len(acted) == 1 and results == [acted[0], acted[0]]


async def test_expired_claim_of_a_dead_holder_is_taken_over(database: Database) -> None:
    """A holder that died mid-call leaves a running claim; after expiry another may act."""
    gateway = IdempotencyGateway(database, claim_ttl_ms=100)
    await database.fetch(
        "INSERT INTO wal_idempotency (key, task_id, state, owner, epoch, expires_at) "
        "VALUES ('idem:t:3', 't', 'running', 'dead', 1, now() - interval '1 second')")
    assert await gateway.run_once(claim("alive", 1), _value("second")) == "second"


async def test_older_epoch_is_refused_newer_takes_over(database: Database) -> None:
    """A zombie's older epoch is refused; the new owner's newer epoch takes the key over."""
    gateway = IdempotencyGateway(database)
    await database.fetch(
        "INSERT INTO wal_idempotency (key, task_id, state, owner, epoch, expires_at) "
        "VALUES ('idem:t:3', 't', 'running', 'zombie', 2, now() + interval '1 hour')")
    with pytest.raises(StaleEpoch):
        await gateway.run_once(claim("older", 1), _value("no"))
    assert await gateway.run_once(claim("owner", 4), _value("yes")) == "yes"
    with pytest.raises(StaleEpoch):
        await gateway.run_once(claim("zombie", 2), _value("late"))


async def test_failed_effect_releases_the_key_permanent_failure_is_the_answer(
    database: Database,
) -> None:
    """An effect that raises leaves the key free; a recorded failure answers later callers."""
    gateway = IdempotencyGateway(database)

    async def broken() -> Any:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await gateway.run_once(claim("a", 1), broken)
    assert await gateway.run_once(claim("b", 1), _value("retried")) == "retried"
    await database.fetch(
        "INSERT INTO wal_idempotency (key, task_id, state, owner, epoch) "
        "VALUES ('idem:t:9', 't', 'running', 'c', 1)")
    await gateway.fail(claim("c", 1, "idem:t:9"), "card declined")
    with pytest.raises(EffectFailed, match="card declined"):
        await gateway.run_once(claim("d", 1, "idem:t:9"), _value("never"))


async def test_transactional_effect_is_exactly_once_under_concurrency(
    database: Database,
) -> None:
    """Ten concurrent callers of a DB-local effect: one row written, one result for all."""
    gateway = IdempotencyGateway(database)
    await database.fetch("CREATE TABLE effects (key text, note text)")

    async def write(connection: Any, note: str) -> str:
        await connection.execute("INSERT INTO effects VALUES ('idem:t:3', $1)", note)
        return note

    results = await asyncio.gather(*(
        gateway.run_in_transaction(claim(f"w{i}", 1), lambda c, i=i: write(c, f"w{i}"))
        for i in range(10)))
    rows = await database.fetch("SELECT note FROM effects")
    assert len(rows) == 1 and set(results) == {rows[0]["note"]}


def _value(result: Any) -> Any:
    async def effect() -> Any:
        return result
    return effect
