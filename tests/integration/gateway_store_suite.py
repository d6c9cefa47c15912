"""The abstract test suite every gateway store runs (the eventsourcing pattern).

A module subclasses :class:`GatewayStoreSuite` and defines the fixture ``gateway_store``;
the rules tested here are the ones :class:`wal_engine.effects.gateway.GatewayStore` states.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from wal_engine.effects.gateway import (
    Acquired,
    Claim,
    EffectFailed,
    GatewayStore,
    IdempotencyGateway,
    InvalidKey,
    StaleEpoch,
)

HOSTILE_KEYS = [
    "idem:t:1",
    "IDEM:T:1",
    "idem:t:1 ",
    " ",
    "\n\r\t",
    "'; DROP TABLE wal_idempotency; --",
    "return redis.call('FLUSHALL')",
    "{default}:k:other",
    "*",
    "%s%n%x",
    "ключ-🔑-鍵",
    "e\u0301",
    "\u00e9",
    "x" * 512,
]


def claim(owner: str, epoch: int = 1, key: str = "idem:t:3") -> Claim:
    """A claim on ``key`` by ``owner`` at ``epoch``."""
    return Claim(key=key, owner=owner, epoch=epoch, task_id="t")


async def wait_expired(store: GatewayStore, key: str, timeout_s: float = 10.0) -> None:
    """Wait (with a deadline) until the running claim on ``key`` has expired."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = await store.read_key(key)
        if record is not None and record.expired:
            return
        assert time.monotonic() < deadline, f"claim on {key!r} never expired"
        await asyncio.sleep(0.02)


class GatewayStoreSuite:
    """Rules every GatewayStore keeps; subclasses provide the ``gateway_store`` fixture."""

    async def test_first_claim_wins_and_the_outcome_is_read_back(
            self, gateway_store: GatewayStore) -> None:
        """A free key is won, a second claimant is told it is held, the outcome reads back."""
        assert await gateway_store.claim_key(claim("a"), 10_000) is Acquired.NEW
        assert await gateway_store.claim_key(claim("b"), 10_000) is Acquired.HELD
        running = await gateway_store.read_key("idem:t:3")
        assert running is not None and running.state == "running" and running.owner == "a"
        assert not running.expired
        assert await gateway_store.complete_key(claim("a"), "completed", b"\x00r\xff", None)
        done = await gateway_store.read_key("idem:t:3")
        assert done is not None and (done.state, done.result) == ("completed", b"\x00r\xff")
        assert await gateway_store.claim_key(claim("c", epoch=9), 10_000) is Acquired.HELD

    @pytest.mark.parametrize("claimants", [2, 8, 32])
    async def test_racing_claimants_at_one_epoch_have_one_winner(
            self, gateway_store: GatewayStore, claimants: int) -> None:
        """N claimants racing on one key at the same epoch: exactly one wins."""
        answers = await asyncio.gather(*(
            gateway_store.claim_key(claim(f"w{i}"), 10_000) for i in range(claimants)))
        assert answers.count(Acquired.NEW) == 1
        assert answers.count(Acquired.HELD) == claimants - 1

    @pytest.mark.parametrize("claimants", [2, 32])
    async def test_racing_epochs_leave_the_newest_holding(
            self, gateway_store: GatewayStore, claimants: int) -> None:
        """Claimants of epochs 1..N racing: the newest epoch ends up holding the key."""
        await asyncio.gather(*(gateway_store.claim_key(claim(f"w{e}", epoch=e), 10_000)
                               for e in range(1, claimants + 1)))
        record = await gateway_store.read_key("idem:t:3")
        assert record is not None and record.epoch == claimants
        assert record.owner == f"w{claimants}"

    async def test_holder_crashed_between_acting_and_recording(
            self, gateway_store: GatewayStore) -> None:
        """A holder that acted and died leaves a running claim: held until its lease
        expires, then taken over (flagged: it may have acted), and the dead holder's late
        record is refused."""
        assert await gateway_store.claim_key(claim("dead"), 150) is Acquired.NEW
        assert await gateway_store.claim_key(claim("next"), 10_000) is Acquired.HELD
        await wait_expired(gateway_store, "idem:t:3")
        assert await gateway_store.claim_key(claim("next"), 10_000) is Acquired.TAKEN_OVER
        assert not await gateway_store.complete_key(claim("dead"), "completed", b"late", None)
        assert await gateway_store.complete_key(claim("next"), "completed", b"mine", None)
        record = await gateway_store.read_key("idem:t:3")
        assert record is not None and record.result == b"mine" and record.owner == "next"

    async def test_newer_epoch_takes_over_at_once_and_fences_the_older(
            self, gateway_store: GatewayStore) -> None:
        """A newer epoch takes a live claim over; the older may neither record, release nor
        claim again."""
        assert await gateway_store.claim_key(claim("zombie", 1), 60_000) is Acquired.NEW
        assert await gateway_store.claim_key(claim("owner", 2), 60_000) is Acquired.TAKEN_OVER
        assert not await gateway_store.complete_key(claim("zombie", 1), "completed", b"z", None)
        await gateway_store.release_key(claim("zombie", 1))
        assert await gateway_store.claim_key(claim("zombie", 1), 60_000) is Acquired.HELD
        record = await gateway_store.read_key("idem:t:3")
        assert record is not None and (record.owner, record.epoch) == ("owner", 2)

    async def test_only_the_holder_releases(self, gateway_store: GatewayStore) -> None:
        """Release by another owner changes nothing; the holder's release frees the key."""
        await gateway_store.claim_key(claim("a"), 60_000)
        await gateway_store.release_key(claim("b"))
        assert await gateway_store.read_key("idem:t:3") is not None
        await gateway_store.release_key(claim("a"))
        assert await gateway_store.read_key("idem:t:3") is None
        assert await gateway_store.claim_key(claim("b"), 60_000) is Acquired.NEW

    async def test_failure_is_recorded_as_the_answer(self, gateway_store: GatewayStore) -> None:
        """A failed outcome keeps its error and no result."""
        await gateway_store.claim_key(claim("a"), 60_000)
        assert await gateway_store.complete_key(claim("a"), "failed", None, "card declined")
        record = await gateway_store.read_key("idem:t:3")
        assert record is not None
        assert (record.state, record.result, record.error) == ("failed", None, "card declined")

    async def test_expiry_forgets_settled_keys_only(self, gateway_store: GatewayStore) -> None:
        """Settled keys past retention are forgotten; running claims and young keys stay."""
        for name in ("old", "young", "running"):
            await gateway_store.claim_key(claim("a", key=name), 60_000)
        await gateway_store.complete_key(claim("a", key="old"), "completed", b"1", None)
        await asyncio.sleep(0.3)  # Only to age "old" past the 200 ms retention used below.
        await gateway_store.complete_key(claim("a", key="young"), "failed", None, "e")
        assert await gateway_store.expire_keys(60_000) == 0
        assert await gateway_store.expire_keys(200) == 1
        assert await gateway_store.read_key("old") is None
        assert await gateway_store.read_key("young") is not None
        assert await gateway_store.read_key("running") is not None
        assert await gateway_store.claim_key(claim("b", key="old"), 60_000) is Acquired.NEW

    async def test_expiry_by_prefix_leaves_other_keys(
            self, gateway_store: GatewayStore) -> None:
        """Expiring ``http:`` keys leaves an equally old ``idem:`` key of the same tenant."""
        for name in ("http:a", "idem:t:1"):
            await gateway_store.claim_key(claim("a", key=name), 60_000)
            await gateway_store.complete_key(claim("a", key=name), "completed", b"1", None)
        await asyncio.sleep(0.1)  # Only to age both keys past the 50 ms retention below.
        assert await gateway_store.expire_keys(50, prefix="http:") == 1
        assert await gateway_store.read_key("http:a") is None
        assert await gateway_store.read_key("idem:t:1") is not None
        assert await gateway_store.expire_keys(50) == 1

    async def test_large_result_round_trips(self, gateway_store: GatewayStore) -> None:
        """An 8 MiB binary result is stored and read back byte for byte."""
        big = bytes(range(256)) * (8 * 4096)
        await gateway_store.claim_key(claim("a"), 60_000)
        assert await gateway_store.complete_key(claim("a"), "completed", big, None)
        record = await gateway_store.read_key("idem:t:3")
        assert record is not None and record.result == big

    async def test_hostile_keys_are_distinct_and_inert(
            self, gateway_store: GatewayStore) -> None:
        """Keys holding quotes, code, hash tags, whitespace or lookalike characters are
        stored apart from each other and are never interpreted."""
        for index, key in enumerate(HOSTILE_KEYS):
            assert await gateway_store.claim_key(claim("a", key=key), 60_000) is Acquired.NEW
            assert await gateway_store.complete_key(claim("a", key=key), "completed",
                                                    str(index).encode(), None)
        for index, key in enumerate(HOSTILE_KEYS):
            record = await gateway_store.read_key(key)
            assert record is not None and record.result == str(index).encode(), key

    @pytest.mark.parametrize("key", ["", "x" * 513, "a\x00b"])
    async def test_unstorable_keys_are_refused_typed(
            self, gateway_store: GatewayStore, key: str) -> None:
        """An empty, oversized or NUL-holding key is InvalidKey, before anything is written."""
        with pytest.raises(InvalidKey):
            await gateway_store.claim_key(claim("a", key=key), 60_000)
        with pytest.raises(InvalidKey):
            await gateway_store.read_key(key)

    async def test_run_once_acts_once_among_sixteen_callers(
            self, gateway_store: GatewayStore) -> None:
        """IdempotencyGateway on this store: 16 concurrent callers, one act, one answer."""
        gateway = IdempotencyGateway(store=gateway_store)
        acted: list[str] = []

        async def effect(name: str) -> Any:
            acted.append(name)
            await asyncio.sleep(0.05)  # The remote service's latency, so callers overlap.
            return {"by": name}

        results = await asyncio.gather(*(
            gateway.run_once(claim(f"w{i}"), lambda i=i: effect(f"w{i}")) for i in range(16)))
        assert len(acted) == 1
        assert all(result == {"by": acted[0]} for result in results)

    async def test_run_once_fences_a_zombie_and_replays_failures(
            self, gateway_store: GatewayStore) -> None:
        """A stale epoch is StaleEpoch even once settled; a recorded failure is the answer."""
        gateway = IdempotencyGateway(store=gateway_store)
        assert await gateway.run_once(claim("owner", 2), _value("done")) == "done"
        with pytest.raises(StaleEpoch):
            await gateway.run_once(claim("zombie", 1), _value("again"))
        failing = claim("a", 1, key="idem:t:4")
        await gateway_store.claim_key(failing, 60_000)
        await gateway.fail(failing, "refused by the bank")
        with pytest.raises(EffectFailed, match="refused by the bank"):
            await gateway.run_once(claim("b", 1, key="idem:t:4"), _value("never"))
        assert await gateway.lookup("idem:t:4") == ("failed", None)


def _value(value: Any) -> Any:
    async def effect() -> Any:
        return value

    return effect
