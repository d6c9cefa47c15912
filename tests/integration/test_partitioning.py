"""The partitioned log (schema version 5, docs/architecture.md decision 70): every hot
statement touches one partition of each partitioned table (EXPLAIN, custom and generic
plans), partitions are private and append-only under their own names, a version-4 database
is converted in place, and retention drops a month's partitions whole only when every task
in them is archived."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from tests.helpers import REPOSITORY, claim, plan_nodes, sql_literal
from tests.integration.tenant_roles import TenantRoles
from tests.integration.test_cli_agents import cli, lines
from tests.integration.test_retention import _finish
from wal_engine import events as ev
from wal_engine.audit.archive import verify_archive
from wal_engine.chain import event_hash
from wal_engine.engine import connect
from wal_engine.errors import TaskArchived, UnknownTask
from wal_engine.ids import new_task_id
from wal_engine.runtime import resume
from wal_engine.store import Database, Store, queries
from wal_engine.store.connection import SCHEMA_VERSION, apply_schema

SCHEMA_V4 = Path(__file__).parent / "data" / "schema_v4.sql"
SCHEMA = (REPOSITORY / "schema.sql").read_text()
PARTITIONED = ("wal_events", "wal_snapshots", "wal_snapshot_segments", "wal_blobs")
PARTITION_NAME = re.compile(r"^(wal_events|wal_snapshots|wal_snapshot_segments|wal_blobs)"
                            r"_(p[0-9]{6}|default)$")


def _month(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y%m")


def _id_in(moment: dt.datetime) -> str:
    return new_task_id(int(moment.timestamp() * 1000))


def _function_body(name: str) -> str:
    """The text of schema.sql's function ``name`` between its ``$$`` quotes."""
    start = SCHEMA.index(f"FUNCTION {name}(")
    body = SCHEMA[SCHEMA.index("$$", start) + 2:]
    return body[:body.index("$$")]


def _function_statement(name: str, starts: str, variables: dict[str, str]) -> str:
    """One statement of a function of schema.sql, its variables made parameters."""
    body = _function_body(name)
    statement = body[body.index(starts):]
    statement = statement[:statement.index(";")] if ";" in statement else statement
    statement = re.sub(r"(?<!INSERT )\bINTO\s+\w+\s", " ", statement)  # plpgsql INTO
    for variable in sorted(variables, key=len, reverse=True):
        statement = re.sub(rf"(?<![\w.]){re.escape(variable)}\b", variables[variable],
                           statement)
    return statement




def _touched(plan: Any) -> dict[str, set[str]]:
    """The partitions each partitioned table's scans kept, by table."""
    touched: dict[str, set[str]] = {}
    for node in plan_nodes(plan):
        match = PARTITION_NAME.match(node.get("Relation Name", ""))
        if match:
            touched.setdefault(match.group(1), set()).add(node["Relation Name"])
    return touched


def _hot_statements(task_id: str) -> dict[str, tuple[str, tuple[Any, ...]]]:
    """The engine's statements that name one task, with arguments for it."""
    args = (task_id, 1, 2, bytes(32))
    arrays = (["message_appended"], [1], [b"{}"], [None], [bytes(32)])
    blob = ([bytes(32)], [0], [10], [b"x"])
    stamp = dt.datetime.now(dt.UTC)
    observe = (*args, "message_appended", 1, b"{}", None, bytes(32), stamp)
    transition = (*args, *arrays, "RUNNING", None, None, None, stamp)
    save = (task_id, 5, b"state", 4, 2, [bytes(32)], ["messages"], [0], [bytes(32)], [b"x"])
    return {
        # Appends and their fence (chain of the previous event).
        "OBSERVE_ONE": (queries.OBSERVE_ONE, observe),
        "OBSERVE_ONE_BLOBS": (queries.OBSERVE_ONE_BLOBS, (*observe, *blob)),
        "OBSERVE_MANY": (queries.OBSERVE_MANY, (*args, *arrays, stamp)),
        "OBSERVE_MANY_BLOBS": (queries.OBSERVE_MANY_BLOBS, (*args, *arrays, stamp, *blob)),
        "TRANSITION": (queries.TRANSITION, transition),
        "TRANSITION_BLOBS": (queries.TRANSITION_BLOBS, (*transition, *blob)),
        "CREATE_TASK": (queries.CREATE_TASK, (
            task_id, "agent", "task_submitted", 1, b"{}", bytes(32), "{}", None, None,
            None, stamp, "default", 0, None, None)),
        # Reads of one task: head, events, verification, large values.
        "READ_HEAD": (queries.READ_HEAD, (task_id,)),
        "READ_LAST_EVENT": (queries.READ_LAST_EVENT, (task_id,)),
        "READ_EVENTS": (queries.READ_EVENTS, (task_id, 1, 10, 10)),
        "READ_EVENT_HASHES": (queries.READ_EVENT_HASHES, (task_id, 1, 10, 10)),
        "READ_SEQ_BELOW_ONE": (queries.READ_SEQ_BELOW_ONE, (task_id,)),
        "READ_BLOB_CHUNKS": (queries.READ_BLOB_CHUNKS, (task_id, [bytes(32)], b"", -1, 8)),
        # Resume: head, snapshot and its segments, tail.
        "RESUME_HEAD": (resume.RESUME_HEAD, (task_id, 4, 100)),
        "READ_TAIL": (resume.READ_TAIL, (task_id, 0, 10, 10)),
        "LATEST_SNAPSHOT_SEQ": (resume.LATEST_SNAPSHOT_SEQ, (task_id, 4)),
        # The functions' statements: a database-written event's head (claims, wake-ups,
        # orphaning; the claim's lease is taken from the event it wrote, decision 74),
        # snapshots written and dropped.
        "wal_emit_event head": (_function_statement(
            "wal_emit_event", "SELECT e.seq AS head_seq",
            {"my_tenant": "$1::text", "p_task_id": "$2::text"}), ("default", task_id)),
        "wal_save_snapshot": (_function_statement(
            "wal_save_snapshot", "WITH missing AS", {
                "p_task_id": "$1::text", "p_seq": "$2::bigint", "p_state": "$3::bytea",
                "p_state_format": "$4::smallint", "p_keep": "$5::integer",
                "p_digests": "$6::bytea[]", "p_fields": "$7::text[]",
                "p_ordinals": "$8::int4[]", "p_new_digests": "$9::bytea[]",
                "p_data": "$10::bytea[]"}), save),
        "wal_delete_snapshots": (_function_statement(
            "wal_delete_snapshots", "WITH snapshots AS", {"p_task_id": "$1::text"}),
            (task_id,)),
    }


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
async def test_hot_statements_touch_one_partition(database_dsn: str, store: Store,
                                                  plan_cache_mode: str) -> None:
    """EXPLAIN of every statement naming one task (appends, reads, verification, resume,
    snapshots, the functions' statements), as a custom plan (pruned by the planner) and as
    the generic plan a prepared statement runs (pruned at executor start, "Subplans
    Removed"): each keeps exactly one partition of each partitioned table it scans, the
    task's month, among the month partitions and the default one."""
    task_id = new_task_id()
    await store.create_task(task_id, "agent")
    await store.create_task("chosen-id", "agent")  # The default partition holds rows too.
    connection = await asyncpg.connect(database_dsn, server_settings={"wal.tenant": "default"})
    try:
        await connection.execute("ANALYZE")
        months = await connection.fetchval(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'wal_events'::regclass")
        assert months >= 5  # The default partition, this month and the next three.
        await connection.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        expected = f"_p{_month(dt.datetime.now(dt.UTC))}"
        for index, (name, (statement, values)) in enumerate(_hot_statements(task_id).items()):
            try:
                await connection.execute(f"PREPARE hot_{index} AS {statement}")
            except asyncpg.PostgresError as error:
                raise AssertionError((name, statement)) from error
            literals = ", ".join(sql_literal(value) for value in values)
            plan = orjson.loads(await connection.fetchval(
                f"EXPLAIN (FORMAT JSON) EXECUTE hot_{index}({literals})"))
            text = orjson.dumps(plan).decode()
            touched = _touched(plan)
            if plan_cache_mode == "force_generic_plan" and touched:
                # (READ_SEQ_BELOW_ONE reads nothing at all: the log's CHECK has seq >= 1.)
                assert "$1" in text, (name, "not a generic plan", text)
            for table, partitions in touched.items():
                assert partitions == {table + expected}, (name, table, partitions, text)
            scans = {"OBSERVE_ONE", "OBSERVE_MANY", "TRANSITION", "READ_HEAD", "READ_EVENTS",
                     "RESUME_HEAD", "READ_BLOB_CHUNKS", "wal_emit_event head",
                     "wal_save_snapshot", "wal_delete_snapshots"}
            if name in scans:
                assert touched, (name, "scans no partition", text)
            if name == "RESUME_HEAD":
                assert set(touched) == {"wal_events", "wal_snapshots",
                                        "wal_snapshot_segments"}, (name, touched)
    finally:
        await connection.close()


async def test_partitions_are_private_secured_and_append_only(
        tenant_roles: TenantRoles, database_dsn: str, store: Store) -> None:
    """Every partition has the tenant policy and no privilege for anyone but the owner: a
    tenant's role reading or writing a partition by its own name is refused (it reads its
    rows through the partitioned table, and only its own), and granted one by mistake it
    still sees no other tenant's row (even naming that tenant); UPDATE, DELETE and
    TRUNCATE through a partition's own name are refused even to a superuser (WE002)."""
    await tenant_roles.create("tenant-a")
    await tenant_roles.create("tenant-b")
    task_b = new_task_id()
    b_role = await asyncpg.connect(await tenant_roles.dsn("tenant-b"),
                                   server_settings={"wal.tenant": "tenant-b"})
    try:
        b = await Database.open(await tenant_roles.dsn("tenant-b"), migrate=False,
                                tenant="tenant-b")
        try:
            await Store(b).create_task(task_b, "agent")
        finally:
            await b.close()
        assert await b_role.fetchval("SELECT count(*) FROM wal_events WHERE task_id = $1",
                                     task_b) == 1
    finally:
        await b_role.close()
    await store.create_task("chosen-id", "agent")  # The default partition.
    await store.create_task(new_task_id(), "agent", input={"big": "x" * 200_000})  # wal_blobs
    partition = f"wal_events_p{_month(dt.datetime.now(dt.UTC))}"
    a_role = await asyncpg.connect(await tenant_roles.dsn("tenant-a"),
                                   server_settings={"wal.tenant": "tenant-a"})
    try:
        assert await a_role.fetchval("SELECT count(*) FROM wal_events") == 0
        for table in (partition, "wal_events_default", f"wal_blobs_p{partition[-6:]}",
                      f"wal_snapshots_p{partition[-6:]}"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await a_role.fetch(f"SELECT * FROM {table}")
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await a_role.execute(f"DELETE FROM {table}")
    finally:
        await a_role.close()
    admin = await asyncpg.connect(database_dsn)
    try:
        rows = await admin.fetch(
            "SELECT c.relname, c.relrowsecurity, c.relacl::text AS acl,"
            "       (SELECT count(*) FROM pg_policy p WHERE p.polrelid = c.oid"
            "           AND p.polname = 'wal_tenant_isolation') AS policies,"
            "       pg_get_userbyid(c.relowner) = pg_get_userbyid(r.relowner) AS same_owner"
            "  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            "  JOIN pg_class r ON r.oid = i.inhparent"
            " WHERE r.relname = ANY ($1::text[])", list(PARTITIONED))
        assert len(rows) >= 4 * 5
        for row in rows:
            assert row["relrowsecurity"] and row["policies"] == 1 and row["same_owner"], row
            assert row["acl"] is None or "engine_app" not in row["acl"], row
        for table in (partition, f"wal_blobs_p{partition[-6:]}", "wal_events_default"):
            for statement in (f"UPDATE {table} SET seq = seq" if "events" in table
                              else f"UPDATE {table} SET ordinal = ordinal",
                              f"DELETE FROM {table}", f"TRUNCATE {table}"):
                assert await admin.fetchval(f"SELECT count(*) FROM {table}") >= 1, table
                with pytest.raises(asyncpg.PostgresError) as refused:
                    await admin.execute(statement)
                assert refused.value.sqlstate == "WE002", (statement, refused.value)
        assert await admin.fetchval(f"SELECT count(*) FROM {partition}") == 2
        # Were a partition granted by mistake, its own policy still shows a tenant nothing
        # of another's rows.
        role = (await tenant_roles.create("tenant-a")).role
        await admin.execute(f'GRANT SELECT ON {partition} TO "{role}"')
        a_again = await asyncpg.connect(await tenant_roles.dsn("tenant-a"),
                                        server_settings={"wal.tenant": "tenant-b"})
        try:
            assert await a_again.fetchval(f"SELECT count(*) FROM {partition}") == 0
        finally:
            await a_again.close()
            await admin.execute(f'REVOKE SELECT ON {partition} FROM "{role}"')
    finally:
        await admin.close()


async def _v4_task(admin: asyncpg.Connection, task_id: str) -> None:
    """A task as version 4 stored it (chain version 1)."""
    payload = (b'{"agent":"echo","budget":{},"input":null,"parent_seq":null,'
               b'"parent_task_id":null}')
    digest = event_hash(bytes(32), task_id, 1, "task_submitted", 1, 0, payload)
    await admin.execute(
        "INSERT INTO wal_tasks (task_id, agent, status, head_seq, head_hash)"
        " VALUES ($1, 'echo', 'QUEUED', 1, $2)", task_id, digest)
    await admin.execute(
        "INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, prev_hash, hash)"
        " VALUES ($1, 1, 'task_submitted', 1, 0, $2, $3, $4)",
        task_id, payload, bytes(32), digest)


async def test_schema_version_4_database_is_converted_in_place(database_factory: Any) -> None:
    """A database of schema version 4 (unpartitioned) with tasks in it becomes version 5:
    each per-task table becomes the default partition of a partitioned table of its name,
    rows whose ids fall in a month created are moved into that month's partition; its
    tasks verify and continue, new tasks go to this month's partition, and applying again
    changes nothing."""
    dsn = await database_factory.create()
    now = dt.datetime.now(dt.UTC)
    # A random id of version 4 that happens to sort into this month's range.
    bound = await _bound_of(dsn, _month(now))
    legacy_in_range = bound[:2] + f"{int(bound[2:], 16) + 12345:012x}" + "4" + "a" * 19
    admin = await asyncpg.connect(dsn, server_settings={"wal.tenant": "default"})
    try:
        for table in (*PARTITIONED, "wal_schema_version"):
            await admin.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
        await admin.execute(SCHEMA_V4.read_text())
        await admin.execute("UPDATE wal_schema_version SET checksum = 'v4'")
        assert await admin.fetchval("SELECT max(version) FROM wal_schema_version") == 4
        assert await admin.fetchval(
            "SELECT relkind FROM pg_class WHERE relname = 'wal_events'") == b"r"
        await _v4_task(admin, "old-task")
        await _v4_task(admin, legacy_in_range)
        assert await apply_schema(admin) is True
        assert await admin.fetchval("SELECT max(version) FROM wal_schema_version") == \
            SCHEMA_VERSION == 5
        for table in PARTITIONED:
            assert await admin.fetchval(
                "SELECT relkind FROM pg_class WHERE relname = $1", table) == b"p", table
        where = {r["task_id"]: r["partition"] for r in await admin.fetch(
            "SELECT task_id, tableoid::regclass::text AS partition FROM wal_events")}
        assert where == {"old-task": "wal_events_default",
                         legacy_in_range: f"wal_events_p{_month(now)}"}
        # The converted table is append-only under its own name too.
        with pytest.raises(asyncpg.PostgresError) as refused:
            await admin.execute("DELETE FROM wal_events_default")
        assert refused.value.sqlstate == "WE002"
        before = await admin.fetch("SELECT * FROM wal_events ORDER BY task_id, seq")
        assert await apply_schema(admin, force=True) is True
        assert await admin.fetch("SELECT * FROM wal_events ORDER BY task_id, seq") == before
    finally:
        await admin.close()
    engine = await connect(dsn, migrate=False)
    try:
        for task_id in ("old-task", legacy_in_range):
            assert (await engine.store.verify_task(task_id)).ok, task_id
        assert await engine.signal("old-task", "ping", None, dedup_key="d") >= 1
        fresh = await engine.submit("echo", None)
        row = await engine.database.fetchrow(
            "SELECT tableoid::regclass::text AS partition FROM wal_events WHERE task_id = $1",
            fresh)
        assert row["partition"] == f"wal_events_p{_month(now)}"
    finally:
        await engine.close()
        await database_factory.drop(dsn)


async def _bound_of(dsn: str, month: str) -> str:
    connection = await asyncpg.connect(dsn)
    try:
        return str(await connection.fetchval("SELECT wal_partition_bound($1)", month))
    finally:
        await connection.close()


async def _past_month(database_dsn: str, months_back: int) -> dt.datetime:
    """A moment in a past month whose partitions exist (created for the test)."""
    first = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    for _ in range(months_back):
        first = (first - dt.timedelta(days=1)).replace(day=1)
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.fetch("SELECT * FROM wal_ensure_partitions(0, $1)", first)
    finally:
        await admin.close()
    return first + dt.timedelta(days=14)


async def test_retention_drops_a_month_whose_tasks_are_all_archived(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """A past month whose every task is finished: plan says its partitions go whole, run
    archives its tasks and drops the month's four partitions instead of deleting rows, and
    the log row names them; a month holding one live task is refused the drop (plan names
    the task), its finished tasks' rows are deleted task by task and the live task is
    untouched; a past month without any row is dropped too (it holds nothing to archive)."""
    whole = await _past_month(database_dsn, 3)
    blocked = await _past_month(database_dsn, 4)
    idle = await _past_month(database_dsn, 5)  # A month without a task: dropped as empty.
    done = [_id_in(whole + dt.timedelta(hours=hour)) for hour in range(3)]
    finished = [_id_in(blocked + dt.timedelta(hours=hour)) for hour in range(2)]
    live = _id_in(blocked + dt.timedelta(hours=5))
    for task_id in (*done, *finished):
        await _finish(store, task_id)
    await store.create_task(live, "agent")
    await claim(store.database)
    head = await store.read_head(live)
    await store.append_events(live, [ev.MessageAppended(role="user", content="still here")],
                              epoch=head.lease_epoch, expected_seq=head.head_seq,
                              prev_hash=head.head_hash)
    whole_name, blocked_name = f"wal_events_p{_month(whole)}", f"wal_events_p{_month(blocked)}"
    planned = await cli("retention", "plan", "--older-than", "0s", "--dsn", database_dsn,
                        "--json")
    assert planned.exit_code == 0, planned.output
    [view] = lines(planned.stdout)
    assert view["partitions"][whole_name] is None, view
    assert view["partitions"][blocked_name] == f"default/{live}", view
    assert view["partitions"][f"wal_events_p{_month(dt.datetime.now(dt.UTC))}"] == \
        "the current month or a later one"
    archives = tmp_path / "archives"
    archives.mkdir()
    ran = await cli("retention", "run", "--older-than", "0s", "--archive", str(archives),
                    "--dsn", database_dsn, "--json")
    assert ran.exit_code == 0, ran.output
    [batch] = lines(ran.stdout)
    assert batch["tasks"] == 5 and batch["partitions_dropped"] == [whole_name], batch
    admin = await asyncpg.connect(database_dsn, server_settings={"wal.tenant": "default"})
    try:
        for table in PARTITIONED:
            assert await admin.fetchval("SELECT to_regclass($1)",
                                        f"{table}_p{_month(whole)}") is None, table
            assert await admin.fetchval("SELECT to_regclass($1)",
                                        f"{table}_p{_month(idle)}") is None, table
            assert await admin.fetchval("SELECT to_regclass($1)",
                                        f"{table}_p{_month(blocked)}") is not None, table
        logged = await admin.fetchrow(
            "SELECT tasks, partitions_dropped FROM wal_retention_log WHERE retention_id = $1",
            batch["retention_id"])
        assert logged["tasks"] == 5 and logged["partitions_dropped"] == [whole_name]
        assert await admin.fetchval(
            "SELECT count(*) FROM wal_events WHERE task_id = ANY ($1::text[])",
            [*done, *finished]) == 0
        assert await admin.fetchval(
            "SELECT count(*) FROM wal_archived_tasks WHERE task_id = ANY ($1::text[])",
            [*done, *finished]) == 5
        assert await admin.fetchval(
            f"SELECT count(*) FROM {blocked_name} WHERE task_id = $1", live) == 3
    finally:
        await admin.close()
    with pytest.raises(UnknownTask):
        await store.read_head(done[0])
    with pytest.raises(TaskArchived):  # Its tombstone keeps the id taken.
        await store.create_task(done[0], "agent")
    assert (await store.verify_task(live)).ok
    assert verify_archive(Path(batch["archive"])).ok


async def test_partition_blocker_sees_every_tenant(database_dsn: str, store: Store) -> None:
    """A month is not dropped for one tenant while another tenant's task in it is live:
    the blocker names it although the caller's policy hides that tenant's rows."""
    moment = await _past_month(database_dsn, 5)
    mine = _id_in(moment)
    theirs = _id_in(moment + dt.timedelta(hours=1))
    await _finish(store, mine)
    other = await Database.open(database_dsn, migrate=False, tenant="other")
    try:
        await Store(other).create_task(theirs, "agent")
    finally:
        await other.close()
    found = await store.database.fetchrow("SELECT wal_partition_blocker($1, $2::text[]) AS b",
                                          _month(moment), [mine])
    assert found["b"] == f"other/{theirs}"
    setting = await store.database.fetchrow("SELECT current_setting('wal.tenant') AS t")
    assert setting["t"] == "default"  # Put back.
