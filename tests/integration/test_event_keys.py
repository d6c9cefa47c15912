"""Idempotency keys of chain version 3 (decision 71): a row stores '' for an intent's own key
and for none; the key is derived on read, in Python and in SQL alike, the hash covers it,
and a key a retry reuses is stored as it is."""

from __future__ import annotations

import asyncpg
import pytest

from tests.integration import test_cli_agents as agents
from tests.integration.test_cli_agents import drive
from wal_engine import events as ev
from wal_engine.chain import KEYED_EVENT_TYPES, effective_key, stored_key
from wal_engine.engine import Engine


def test_keyed_event_types_are_the_events_with_a_key() -> None:
    """The types whose key may be derived are exactly the events that carry one."""
    keyed: set[str] = set()
    pending: list[type[ev.Event]] = list(ev.Event.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        tag = cls.__struct_config__.tag
        if isinstance(tag, str) and "idempotency_key" in cls.__struct_fields__:
            keyed.add(tag)
    assert keyed == KEYED_EVENT_TYPES


@pytest.mark.parametrize(("event_type", "seq", "key"), [
    ("tool_call_intended", 7, "idem:t-1:7"), ("tool_call_intended", 9, "idem:t-1:7"),
    ("llm_call_intended", 3, "idem:t-1:3"), ("message_appended", 4, None),
    ("tool_call_intended", 5, "idem:t-1:5x")])
def test_a_stored_key_reads_back_as_the_event_key(event_type: str, seq: int,
                                                   key: str | None) -> None:
    """stored_key then effective_key gives the key back; only an intent's own key and no key
    are left out of the row."""
    stored = stored_key("t-1", seq, event_type, key)
    assert effective_key(3, "t-1", seq, event_type, stored) == key
    assert (stored == "") == (key is None or key == f"idem:t-1:{seq}")


async def test_keys_derive_alike_in_sql_and_retries_store_theirs(engine: Engine) -> None:
    """A run with a retried call: its first intent's key is derived, the retry's intent
    (which reuses the first key at another seq) stores it; wal_events_json and the history
    show the same keys, and verify passes."""
    agents.register(engine)
    await engine.submit("cli-echo", {"q": "k"}, task_id="keys-1")
    await drive(engine, "keys-1")
    history = await engine.history("keys-1")
    rows = {r["seq"]: r for r in await engine.database.fetch(
        "SELECT seq, idempotency_key FROM wal_events WHERE task_id = $1", "keys-1")}
    audited = {r["seq"]: r["idempotency_key"] for r in await engine.database.fetch(
        "SELECT seq, idempotency_key FROM wal_events_json WHERE task_id = $1", "keys-1")}
    intents = [r for r in history if r.type in KEYED_EVENT_TYPES]
    assert len(intents) >= 4  # the LLM call, search, and fetch twice (one retry)
    derived = [r for r in intents if r.idempotency_key == f"idem:keys-1:{r.seq}"]
    reused = [r for r in intents if r not in derived]
    assert derived and reused
    assert all(rows[r.seq]["idempotency_key"] == "" for r in derived)
    assert all(rows[r.seq]["idempotency_key"] == r.idempotency_key for r in reused)
    assert audited == {r.seq: r.idempotency_key for r in history}
    assert (await engine.store.verify_task("keys-1")).ok


@pytest.mark.parametrize(("stored", "ok"), [("idem:other:1", False), (None, False),
                                             ("same", True)])
async def test_a_rewritten_derived_key_breaks_the_chain(
        engine: Engine, database_dsn: str, stored: str | None, ok: bool) -> None:
    """Writing another key (or NULL, no key) in place of a derived one breaks the intent's
    hash; writing the derived key itself out in full changes nothing the log says."""
    agents.register(engine)
    await engine.submit("cli-echo", {"q": "k"}, task_id="keys-2")
    await drive(engine, "keys-2")
    intent = next(r for r in await engine.history("keys-2")
                  if r.type in KEYED_EVENT_TYPES and r.idempotency_key == f"idem:keys-2:{r.seq}")
    value = intent.idempotency_key if stored == "same" else stored
    admin = await asyncpg.connect(database_dsn)
    try:
        async with admin.transaction():
            await admin.execute("ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only")
            await admin.execute("UPDATE wal_events SET idempotency_key = $3"
                                " WHERE task_id = $1 AND seq = $2", "keys-2", intent.seq, value)
            await admin.execute("ALTER TABLE wal_events ENABLE TRIGGER wal_events_append_only")
    finally:
        await admin.close()
    report = await engine.store.verify_task("keys-2")
    if ok:
        assert report.ok
    else:
        assert report.violation is not None
        assert (report.violation.seq, report.violation.kind) == (intent.seq, "hash")
