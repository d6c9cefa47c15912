"""The engine through a real PgBouncer 1.18, in transaction and in session pool mode.

Each test starts its own PgBouncer (``wal_engine.testing.pgbouncer``) in front of the
session's PostgreSQL and connects through it with ``pooler=`` set: the public API end to end
(a worker runs a task with a tool call, a signal and an approval; wait, history and the
CLI's ``history`` and ``verify``), round trips per append counted on the wire, LISTEN on a
direct ``listen_dsn``, and tenants sharing one pool kept apart by the database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from tests.helpers import claimed_task, head_args
from tests.integration.tenant_roles import TenantRoles, secure
from tests.integration.test_cli_agents import cli, lines
from wal_engine import events as ev
from wal_engine.engine import Engine, connect
from wal_engine.errors import DatabaseError, UnknownTask
from wal_engine.runtime.context import AgentContext
from wal_engine.store import Store
from wal_engine.testing.pgbouncer import PgBouncer, PgBouncerUnavailable, pgbouncer_binary
from wal_engine.testing.postgres import DatabaseFactory, TestServer
from wal_engine.testing.processes import wait_until

MODES = ("transaction", "session")
FAST = {"lease_ttl_ms": 2000, "heartbeat_ms": 500, "poll_ms": 20, "sweep_ms": 200}

try:
    pgbouncer_binary()
except PgBouncerUnavailable as missing:
    pytest.skip(str(missing), allow_module_level=True)


@pytest_asyncio.fixture
async def direct_dsn(database_factory: DatabaseFactory) -> AsyncIterator[str]:
    """A fresh database's direct DSN (even when the suite itself runs through a pooler)."""
    dsn = await database_factory.create()
    yield dsn
    await database_factory.drop(dsn)


@pytest.fixture(params=MODES)
def bouncer(request: pytest.FixtureRequest, pg_server: TestServer) -> Iterator[PgBouncer]:
    """A PgBouncer of this test's own, in each pool mode."""
    with PgBouncer.in_front_of(pg_server.admin_dsn, pool_mode=request.param) as started:
        yield started


class TurnCounter:
    """A TCP relay between the engine and PgBouncer that counts round trips: each time the
    client sends after the server has answered (or first) is one."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.turns = 0
        self._server: asyncio.Server | None = None
        self._replied: dict[int, bool] = {}
        self.port = 0

    async def start(self) -> TurnCounter:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1",
                                                                     self.target_port)
        key = id(client_writer)
        self._replied[key] = True

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       from_client: bool) -> None:
            try:
                while chunk := await reader.read(65536):
                    if from_client and self._replied[key]:
                        self.turns += 1
                    self._replied[key] = not from_client
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(client_reader, server_writer, True),
                             pump(server_reader, client_writer, False))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _through(bouncer: PgBouncer, direct: str, port: int | None = None) -> str:
    dsn = bouncer.via(direct)
    return dsn if port is None else dsn.replace(f":{bouncer.port}/", f":{port}/")


def _register(engine: Engine, calls: list[str]) -> None:
    async def lookup(query: str) -> dict[str, Any]:
        calls.append(query)
        return {"found": query.upper()}

    @engine.agent("pooled")
    async def pooled(ctx: AgentContext, task_input: dict[str, Any]) -> Any:
        found = await ctx.tool("lookup", lookup, task_input["q"])
        signal = await ctx.wait_for_signal("go", timeout_s=30)
        decision = await ctx.approval("ship", {"what": found["found"]})
        return {"found": found, "signal": signal, "approved": decision.approved}


async def _run_one_task(engine: Engine, task_id: str) -> Any:
    """Submit, run with a worker through the pooler, signal, approve, wait."""
    calls: list[str] = []
    _register(engine, calls)
    worker = engine.worker(concurrency=2, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        await engine.submit("pooled", {"q": "abc"}, task_id=task_id)

        async def status_is(wanted: str) -> bool:
            return str((await engine.head(task_id)).status) == wanted

        await wait_until(lambda: status_is("WAITING"), "the task to wait for its signal", 20)
        await engine.signal(task_id, "go", {"n": 1})

        async def asks() -> bool:
            return bool((await engine.state(task_id)).approvals)

        await wait_until(asks, "the approval request", 20)
        (call_id,) = (await engine.state(task_id)).approvals
        await engine.approve(task_id, call_id, approver="ops")
        state = await engine.wait(task_id, timeout_s=20)
    finally:
        worker.stop()
        await running
    assert calls == ["abc"]  # The tool acted once, though the code ran three times.
    return state


async def test_public_api_and_cli_through_pgbouncer(bouncer: PgBouncer, direct_dsn: str
                                                    ) -> None:
    """Submit, a worker running a tool call, a signal, an approval, wait, history, and the
    CLI's history and verify, all through PgBouncer in this pool mode."""
    dsn = bouncer.via(direct_dsn)
    engine = await connect(dsn, migrate=False, pooler=bouncer.pool_mode, pool_size_max=4)
    try:
        assert engine.database.pooler == bouncer.pool_mode
        state = await _run_one_task(engine, "pb-1")
        assert str(state.status) == "COMPLETED", state.failure
        assert state.output == {"found": {"found": "ABC"}, "signal": {"n": 1},
                                "approved": True}
        types = [record.type for record in await engine.history("pb-1")]
        assert "tool_call_completed" in types and "signal_received" in types
        assert (await engine.store.verify_task("pb-1")).ok
    finally:
        await engine.close()
    env = {"WAL_ENGINE_POOLER": bouncer.pool_mode}
    history = await cli("history", "pb-1", "--dsn", dsn, "--json", env=env)
    assert history.exit_code == 0, history.stderr
    assert [row["type"] for row in lines(history.stdout)] == types
    verified = await cli("verify", "--all", "--dsn", dsn, env=env)
    assert verified.exit_code == 0, verified.stderr
    assert "verified 1 task(s)" in verified.stdout


async def test_without_listen_dsn_a_transaction_pooled_worker_polls_and_says_so(
        pg_server: TestServer, direct_dsn: str) -> None:
    """Through a transaction pooler a LISTEN would hear nothing: the worker says once that
    it polls; with ``listen_dsn`` (direct) it listens, and a NOTIFY wakes it long before
    its poll interval."""
    with PgBouncer.in_front_of(pg_server.admin_dsn, pool_mode="transaction") as bouncer:
        dsn = bouncer.via(direct_dsn)
        for listen_dsn in (None, direct_dsn):
            engine = await connect(dsn, migrate=False, pooler="transaction",
                                   listen_dsn=listen_dsn, pool_size_max=4)

            @engine.agent("echo")
            async def echo(ctx: AgentContext, task_input: Any) -> Any:
                return task_input

            poll_ms = 60_000 if listen_dsn else 50
            worker = engine.worker(concurrency=1, lease_ttl_ms=2000, heartbeat_ms=500,
                                   poll_ms=poll_ms, sweep_ms=200)
            with capture_logs() as logs:
                running = asyncio.create_task(worker.run())
                try:
                    # The first task is claimed by whichever pass comes; once it is done
                    # the worker's claim loop waits (poll_ms) for a wake-up.
                    first = await engine.submit("echo", {"n": 0})
                    await engine.wait(first, timeout_s=20)
                    started = time.monotonic()
                    task_id = await engine.submit("echo", {"n": 1})
                    state = await engine.wait(task_id, timeout_s=20)
                    took_s = time.monotonic() - started
                    listening = await _listen_sessions(direct_dsn, worker.worker_id)
                finally:
                    worker.stop()
                    await running
                    await engine.close()
            assert state.output == {"n": 1}
            said = [entry for entry in logs if entry["event"] == "listen_off_polling"]
            if listen_dsn is None:
                assert len(said) == 1 and said[0]["pooler"] == "transaction"
                assert listening == 0
            else:
                assert said == []
                assert listening == 1
                assert took_s < 10, took_s  # woken by NOTIFY, not by the 60 s poll


async def _listen_sessions(direct_dsn: str, worker_id: str) -> int:
    """The server sessions whose last statement was the worker's LISTEN."""
    admin = await asyncpg.connect(direct_dsn)
    try:
        return int(await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1"
            " AND query LIKE 'LISTEN%'", f"wal-engine:{worker_id}:listen"))
    finally:
        await admin.close()


@pytest.mark.parametrize("mode", MODES)
async def test_one_round_trip_per_append(mode: str, pg_server: TestServer,
                                         direct_dsn: str) -> None:
    """An observation's append is one round trip through PgBouncer (counted on the wire,
    after each statement's first use): in session mode, and in transaction mode for a
    tenant's role, whose own defaults carry its settings. A role that names its tenant by
    the setting (the owner, a superuser) has it carried by each transaction: BEGIN with
    the settings, the append, COMMIT."""
    await secure(direct_dsn)
    roles = TenantRoles(direct_dsn)
    try:
        role_dsn = await roles.dsn("counted")
        with PgBouncer.in_front_of(pg_server.admin_dsn, pool_mode=mode) as bouncer:
            counter = await TurnCounter(bouncer.port).start()
            try:
                found: dict[str, float] = {}
                for who, direct in (("tenant role", role_dsn), ("superuser", direct_dsn)):
                    engine = await connect(_through(bouncer, direct, counter.port),
                                           migrate=False, pooler=mode, pool_size_max=2,
                                           development=who == "superuser")
                    try:
                        store = Store(engine.database)
                        head: Any = await claimed_task(store, f"rt-{who[0]}")
                        epoch = head.lease_epoch
                        appends = 20
                        for index in range(appends + 1):
                            if index == 1:  # the first one described the statement
                                before = counter.turns
                            result = await store.append_events(
                                head.task_id, [ev.MessageAppended(role="user",
                                                                  content=str(index))],
                                **head_args(head, epoch))
                            head = result
                        found[who] = (counter.turns - before) / appends
                        carries = engine.database.role_carries
                    finally:
                        await engine.close()
                    if who == "tenant role":
                        assert carries == (mode == "transaction")
                print(f"round trips per append through PgBouncer ({mode}): {found}")
                assert found["tenant role"] == 1
                assert found["superuser"] == (3 if mode == "transaction" else 1)
            finally:
                await counter.close()
    finally:
        await roles.close()


async def test_tenants_sharing_a_transaction_pool_stay_apart(pg_server: TestServer,
                                                              direct_dsn: str) -> None:
    """Two tenants' engines on one PgBouncer whose pool has ONE server connection per
    user, so every transaction of theirs runs on the same server session: a session-level
    setting left there by another client never moves rows or reads across tenants. Tenant
    roles: row security keys on the login role (a setting naming another tenant is refused
    for what it would write). A trusted role naming its tenant by the setting: each
    transaction carries its own."""
    await secure(direct_dsn)
    roles = TenantRoles(direct_dsn)
    with PgBouncer.in_front_of(pg_server.admin_dsn, pool_mode="transaction",
                               pool_size=1) as bouncer:
        engines: list[Engine] = []
        try:
            for tenant in ("ten-a", "ten-b"):
                engines.append(await connect(bouncer.via(await roles.dsn(tenant)),
                                             migrate=False, pooler="transaction",
                                             pool_size_max=3, development=False))
            for tenant in ("own-x", "own-y"):
                engines.append(await connect(bouncer.via(direct_dsn), migrate=False,
                                             pooler="transaction", pool_size_max=3,
                                             tenant=tenant, development=True))
            for engine in engines:
                engine.agent("echo")(_echo)
            # A client of each user leaves a session-level wal.tenant naming another
            # tenant on the one server connection its pool has.
            rogues = []
            for dsn, other in ((await roles.dsn("ten-b"), "ten-a"), (direct_dsn, "own-x")):
                rogue = await asyncpg.connect(bouncer.via(dsn), statement_cache_size=0)
                await rogue.execute(f"SELECT set_config('wal.tenant', '{other}', false)")
                rogues.append(rogue)
            # Tenant B's role: row security keys on the role, so B's engine, handed A's
            # name by the session, cannot write as A: refused, nothing written.
            with pytest.raises(DatabaseError, match="row-level security"):
                await engines[1].submit("echo", {"tenant": "ten-b"}, task_id="t-ten-a")
            await rogues[0].execute("RESET wal.tenant")  # back to the role's own default
            for rogue in rogues:
                await rogue.close()
            # The owner's sessions naming their tenant: each transaction carries its own,
            # whatever the session says (own-y's rogue setting is still there).
            for engine, tenant in zip(engines, ("ten-a", "ten-b", "own-x", "own-y"),
                                      strict=True):
                await engine.submit("echo", {"tenant": tenant}, task_id=f"t-{tenant}")
            for engine, tenant in zip(engines, ("ten-a", "ten-b", "own-x", "own-y"),
                                      strict=True):
                assert (await engine.head(f"t-{tenant}")).agent == "echo"
                for other in ("ten-a", "ten-b", "own-x", "own-y"):
                    if other != tenant:
                        with pytest.raises(UnknownTask):
                            await engine.head(f"t-{other}")
                if tenant.startswith("ten-"):  # row security (a superuser bypasses it)
                    seen = await engine.database.fetch("SELECT task_id FROM wal_tasks")
                    assert [row["task_id"] for row in seen] == [f"t-{tenant}"]
        finally:
            for engine in engines:
                await engine.close()
    admin = await asyncpg.connect(direct_dsn)
    try:
        rows = await admin.fetch("SELECT task_id, tenant FROM wal_tasks ORDER BY 1")
    finally:
        await admin.close()
        await roles.close()
    assert [(row["task_id"], row["tenant"]) for row in rows] == [
        ("t-own-x", "own-x"), ("t-own-y", "own-y"), ("t-ten-a", "ten-a"),
        ("t-ten-b", "ten-b")]


async def _echo(ctx: AgentContext, task_input: Any) -> Any:
    return task_input


async def test_a_statement_never_joins_a_transaction_no_one_holds(pg_server: TestServer,
                                                                   direct_dsn: str) -> None:
    """A BEGIN whose caller was cancelled while it ran leaves a transaction open that no
    asyncpg Transaction holds (the W7 fault test hit it on the group commit's kept
    connection): the next statement carrying the settings rolls it back and commits on its
    own, instead of joining it and being acknowledged but never committed."""
    from wal_engine.store.connection import connect_once, session_settings

    admin = await asyncpg.connect(direct_dsn)
    await admin.execute("CREATE TABLE pb_probe (n int)")
    try:
        with PgBouncer.in_front_of(pg_server.admin_dsn, pool_mode="transaction") as bouncer:
            connection = await connect_once(bouncer.via(direct_dsn),
                                            session_settings("default", "probe"),
                                            pooler="transaction")
            try:
                # What a cancelled Transaction.start() leaves: BEGIN ran, nothing holds it.
                await asyncpg.Connection.execute(connection, "BEGIN")
                assert connection.is_in_transaction()
                with capture_logs() as logs:
                    await connection.execute("INSERT INTO pb_probe VALUES ($1)", 1)
                assert not connection.is_in_transaction()
                assert [entry["event"] for entry in logs] == [
                    "pooled_connection_transaction_abandoned_rolled_back"]
            finally:
                await connection.close()
        assert await admin.fetchval("SELECT count(*) FROM pb_probe WHERE n = 1") == 1
    finally:
        await admin.close()
