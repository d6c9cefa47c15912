"""Per-tenant sealed payloads: the log holds ciphertext, chains verify without keys, and
deleting a tenant's key crypto-shreds its history without editing a row."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tests.integration.test_security_redaction import _hits, _pg_dump
from wal_engine.engine import connect
from wal_engine.runtime.context import AgentContext
from wal_engine.security.encryption import EnvelopeInvalid, KeyShredded, PayloadCipher, is_sealed
from wal_engine.security.redaction import default_redactor
from wal_engine.state_machine import Status

# wal_engine.security.encryption imports cryptography only when a cipher is made.
pytest.importorskip("cryptography")

DOCUMENT = "canary-confidential-document-3f1d"


class Keys:
    """An application's key store: one key per tenant, deletable."""

    def __init__(self) -> None:
        self.keys = {("acme", 1): os.urandom(32), ("globex", 1): os.urandom(32)}

    def __call__(self, tenant: str, version: int) -> bytes | None:
        return self.keys.get((tenant, version))


def test_sealing_is_deterministic_bound_to_its_tenant_and_survives_redaction() -> None:
    """Same value, same envelope; another tenant cannot open it; redaction leaves it alone."""
    cipher = PayloadCipher(Keys())
    sealed = cipher.seal("acme", {"doc": DOCUMENT, "password": "p"})
    assert is_sealed(sealed) and sealed == cipher.seal("acme", {"doc": DOCUMENT,
                                                                "password": "p"})
    assert DOCUMENT not in str(sealed)
    assert default_redactor(sealed) == sealed
    assert cipher.open(sealed) == {"doc": DOCUMENT, "password": "p"}
    with pytest.raises(EnvelopeInvalid):
        cipher.open({**sealed, "tenant": "globex"})


def test_deleting_the_key_shreds() -> None:
    """Once the tenant's key is deleted, its envelopes cannot be opened."""
    keys = Keys()
    cipher = PayloadCipher(keys)
    sealed = cipher.seal("acme", DOCUMENT)
    del keys.keys[("acme", 1)]
    cipher.forget("acme")
    with pytest.raises(KeyShredded):
        cipher.open(sealed)


async def test_sealed_history_verifies_without_the_key_and_is_shredded(
        database_dsn: str) -> None:
    """A task whose tool result is sealed: the dump holds no plaintext, the chain verifies
    before and after the key is deleted, and afterwards the content is unrecoverable."""
    keys = Keys()
    cipher = PayloadCipher(keys)
    engine = await connect(database_dsn, migrate=False, pool_size_max=4)
    try:
        @engine.agent("sealed")
        async def sealed_agent(ctx: AgentContext, task_input: Any) -> Any:
            envelope = await ctx.tool("fetch", lambda _: cipher.seal("acme", {
                "doc": DOCUMENT}), {"id": 7})
            await ctx.message("assistant", envelope)
            return {"length": len(cipher.open(envelope)["doc"]), "doc": envelope}

        task_id = await engine.submit("sealed", {"tenant": "acme"})
        worker = engine.worker(concurrency=2, lease_ttl_ms=2000, heartbeat_ms=300,
                               poll_ms=50, sweep_ms=200)
        running = asyncio.create_task(worker.run())
        try:
            state = await engine.wait(task_id, timeout_s=30)
        finally:
            worker.stop()
            await running
        assert state.status is Status.COMPLETED
        assert state.output["length"] == len(DOCUMENT)
        assert _hits(_pg_dump(database_dsn), [DOCUMENT]) == {}
        assert (await engine.store.verify_task(task_id)).ok
        del keys.keys[("acme", 1)]
        cipher.forget("acme")
        after = await engine.state(task_id)
        assert (await engine.store.verify_task(task_id)).ok
        with pytest.raises(KeyShredded):
            cipher.open(after.output["doc"])
    finally:
        await engine.close()
