"""RELIABILITY.md S15: every cap enforced in the database, as the runtime role would meet it.

Each cap is tried twice: by a direct SQL call as the application role of security.sql (what
someone holding the runtime credential can run), which must fail with the database's own
error and leave the log unchanged, and through the Python API, which must raise a typed
:class:`~wal_engine.errors.WalError` (never a raw driver error).
"""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
import pytest

from tests.helpers import claim, log_snapshot
from wal_engine import limits
from wal_engine.engine import Engine, connect
from wal_engine.errors import CapExceeded, ConfigurationError, InvalidInput
from wal_engine.events import Budget
from wal_engine.store import queries


async def _sql_error(engine: Engine, statement: str, *args: Any) -> asyncpg.PostgresError:
    """Run ``statement`` as the app role on a raw connection; the error it must raise."""
    async with engine.database.pool.acquire() as connection:
        try:
            await connection.execute(statement, *args)
        except asyncpg.PostgresError as error:
            return error
    raise AssertionError(f"{statement!r} was accepted")


async def _signals(engine: Engine) -> int:
    return int((await engine.database.fetchrow("SELECT count(*) AS n FROM wal_signals"))["n"])


async def test_s15_cancel_texts_are_capped(app_engine: Engine) -> None:
    """A 50 MiB cancellation reason or requester is refused by wal_cancel_task itself
    (WE008), by the API before sending (InvalidInput), and nothing is written."""
    await app_engine.submit("agent", None, task_id="c1")
    before = await log_snapshot(app_engine.database)
    big = "r" * (limits.cancel_text_bytes_max + 1)
    for reason, by in ((big, "me"), ("why", big)):
        error = await _sql_error(app_engine, "SELECT wal_cancel_task($1, $2, $3)", "c1",
                                 reason, by)
        assert error.sqlstate == "WE008"
    with pytest.raises(CapExceeded):  # The statement the API runs, typed.
        await app_engine.database.fetchrow(queries.CANCEL_TASK, "c1", big, "me")
    with pytest.raises(InvalidInput):
        await app_engine.cancel("c1", reason="x" * (50 * 1024 * 1024), requested_by="me")
    with pytest.raises(InvalidInput):
        await app_engine.cancel("c1", reason="why", requested_by="y" * (50 * 1024 * 1024))
    assert await log_snapshot(app_engine.database) == before
    assert await app_engine.cancel("c1", reason="r" * limits.cancel_text_bytes_max)


async def test_s15_signals_per_task_are_capped_in_count_and_bytes(
        app_engine: Engine) -> None:
    """A task takes at most 16 MiB of signals (and 1 MiB each): past that the database
    refuses the signal (WE008, CapExceeded through the API) and stores nothing."""
    await app_engine.submit("agent", None, task_id="s1")
    megabyte = "x" * (1024 * 1024 - 16)
    sent = 0
    with pytest.raises(CapExceeded) as refused:
        for _ in range(20):
            await app_engine.signal("s1", "blob", megabyte)
            sent += 1
    assert refused.value.cap == "signals_per_task" and sent == 16
    assert await _signals(app_engine) == sent
    error = await _sql_error(app_engine, "SELECT wal_send_signal($1, $2, $3, NULL)",
                             "s1", "blob", b"\"" + b"x" * 300 + b"\"")
    assert error.sqlstate == "WE008" and await _signals(app_engine) == sent
    # One signal over 1 MiB, straight to the function: refused too.
    await app_engine.submit("agent", None, task_id="s2")
    error = await _sql_error(app_engine, "SELECT wal_send_signal($1, $2, $3, NULL)",
                             "s2", "big", b'"' + b"x" * (1024 * 1024) + b'"')
    assert error.sqlstate == "WE008" and await _signals(app_engine) == sent


async def test_s15_signals_per_task_are_capped_in_count(app_engine: Engine) -> None:
    """The 1,001st signal of one task is refused (count cap), the others kept."""
    await app_engine.submit("agent", None, task_id="many")
    async with app_engine.database.pool.acquire() as connection:
        await connection.execute(
            "SELECT wal_send_signal('many', 'tick', '{}'::bytea, NULL)"
            "  FROM generate_series(1, $1)", limits.signals_per_task_max)
    with pytest.raises(CapExceeded) as refused:
        await app_engine.signal("many", "tick", {})
    assert refused.value.cap == "signals_per_task"
    assert await _signals(app_engine) == limits.signals_per_task_max


async def test_s15_signals_per_tenant_follow_the_administrators_cap(
        app_engine: Engine, database_dsn: str) -> None:
    """With the tenant's cap set by the owner to 3 signals, the 4th (to any task) is
    refused; the app role cannot raise the cap or reset its counter."""
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute("INSERT INTO wal_tenants (tenant, signals_max) VALUES ('default', 3)"
                            " ON CONFLICT (tenant) DO UPDATE SET signals_max = 3")
    finally:
        await admin.close()
    for task in ("a", "b"):
        await app_engine.submit("agent", None, task_id=task)
    for task, name in (("a", "1"), ("b", "2"), ("a", "3")):
        await app_engine.signal(task, name, None)
    with pytest.raises(CapExceeded) as refused:
        await app_engine.signal("b", "4", None)
    assert refused.value.cap == "signals_per_tenant"
    for statement in ("UPDATE wal_tenants SET signals_max = NULL",
                      "UPDATE wal_tenants SET signal_count = 0",
                      "UPDATE wal_tasks SET signal_count = 0"):
        error = await _sql_error(app_engine, statement)
        assert error.sqlstate == "42501", statement
    assert await _signals(app_engine) == 3


async def test_s15_signal_bytes_per_tenant_follow_the_administrators_cap(
        app_engine: Engine, database_dsn: str) -> None:
    """With the tenant's signal bytes capped by the owner at 5,000, the signal that would
    pass it (to any task) is refused, by the API (CapExceeded) and by the SQL function
    called directly (WE008); the signals stored before stay, and nothing else is stored."""
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute("INSERT INTO wal_tenants (tenant, signal_bytes_max)"
                            " VALUES ('default', 5000) ON CONFLICT (tenant)"
                            " DO UPDATE SET signal_bytes_max = 5000")
    finally:
        await admin.close()
    for task in ("a", "b"):
        await app_engine.submit("agent", None, task_id=task)
    text = "x" * 2000  # 2,002 bytes once encoded: two fit, a third does not.
    await app_engine.signal("a", "one", text)
    await app_engine.signal("b", "two", text)
    with pytest.raises(CapExceeded) as refused:
        await app_engine.signal("a", "three", text)
    assert refused.value.cap == "signals_per_tenant"
    error = await _sql_error(app_engine, "SELECT wal_send_signal($1, $2, $3, NULL)",
                             "b", "three", orjson.dumps(text))
    assert error.sqlstate == "WE008"
    error = await _sql_error(app_engine, "UPDATE wal_tenants SET signal_bytes = 0")
    assert error.sqlstate == "42501"
    assert await _signals(app_engine) == 2


async def test_s15_event_bounds_hold_for_every_writer(app_engine: Engine) -> None:
    """Past the events-per-task ceiling, or with a payload over 16 MiB, a row is refused
    by the log's CHECK whoever writes it; the API refuses an engine configured beyond the
    ceilings."""
    await app_engine.submit("agent", None, task_id="e1")
    before = await log_snapshot(app_engine.database)
    insert = ("INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, hash)"
              " VALUES ('e1', $1, 'message_appended', 1, 0, $2, $3)")
    for seq, payload in ((limits.events_per_task_ceiling + 1, b"{}"),
                         (2, b"{" + b" " * limits.row_payload_bytes_ceiling + b"}")):
        error = await _sql_error(app_engine, insert, seq, payload, bytes(32))
        assert error.sqlstate == "23514"
    assert await log_snapshot(app_engine.database) == before
    for option in ({"events_per_task_max": limits.events_per_task_ceiling + 1},
                   {"payload_bytes_max": limits.payload_bytes_ceiling + 1}):
        with pytest.raises(ConfigurationError):
            await connect(app_engine.database.dsn, migrate=False, **option)  # type: ignore[arg-type]


@pytest.mark.parametrize("cost", ["Infinity", "-Infinity", "NaN", "-1", "1e7"])
async def test_s15_llm_spend_increments_are_finite_and_bounded(
        app_engine: Engine, cost: str) -> None:
    """wal_add_llm_spend refuses a non-finite, negative or absurd cost (22023; InvalidInput
    through the store's statement) and the tenant's spend is unchanged."""
    await app_engine.database.fetch(queries.ADD_LLM_SPEND, "0.5")
    error = await _sql_error(app_engine, "SELECT * FROM wal_add_llm_spend($1::numeric)", cost)
    assert error.sqlstate == "22023"
    with pytest.raises(InvalidInput):
        await app_engine.database.fetch(queries.ADD_LLM_SPEND, cost)
    row = await app_engine.database.fetchrow(queries.TENANT_LLM_SPEND)
    assert str(row["llm_spend_usd"]) == "0.5"


@pytest.mark.parametrize("budget", [{"max_tokens": -1}, {"max_steps": 0},
                                    {"max_cost_usd": "1"}, {"max_tokens": True}])
async def test_s15_budgets_are_positive(app_engine: Engine, budget: dict[str, Any]) -> None:
    """A task row with a non-positive (or non-numeric) budget is refused by the database's
    insert trigger (22023) and by the API (InvalidInput); nothing is written."""
    before = await log_snapshot(app_engine.database)
    error = await _sql_error(
        app_engine, "INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash, budget)"
                    " VALUES ('b1', 'agent', 'QUEUED', 1, $1, $2::jsonb)",
        bytes(32), orjson.dumps(budget).decode())
    assert error.sqlstate == "22023"
    with pytest.raises(InvalidInput):
        await app_engine.submit("agent", None, budget=Budget(**budget), task_id="b1")
    assert await log_snapshot(app_engine.database) == before


async def test_s15_dedup_keys_and_signal_names_are_usage_errors(app_engine: Engine) -> None:
    """A 3,000-byte dedup key and a signal name holding an undecodable byte (a shell
    argument of byte 0xff) are InvalidInput, never a raw driver error; the SQL function
    refuses the long key itself (22023)."""
    await app_engine.submit("agent", None, task_id="d1")
    await claim(app_engine.database)
    for name, key in (("ok", "k" * 3000), ("bad\udcff", None), ("", None)):
        with pytest.raises(InvalidInput):
            await app_engine.signal("d1", name, None, dedup_key=key)
    error = await _sql_error(app_engine, "SELECT wal_send_signal('d1', 'ok', '{}', $1)",
                             "k" * 3000)
    assert error.sqlstate == "22023"
    assert await _signals(app_engine) == 0
    await app_engine.signal("d1", "ok", None, dedup_key="k" * limits.dedup_key_bytes_max)
    assert await _signals(app_engine) == 1
