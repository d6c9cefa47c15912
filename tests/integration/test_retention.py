"""``wal-engine retention plan|run`` and ``verify --archive`` on real PostgreSQL: what is
removed and what is kept, the archive's verification and tampering, tombstones (a late
duplicate submission, a late idempotent call), the owner-only path, and a crash between
the archive and the removal."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import orjson
import pytest
import zstandard

from tests.helpers import REPOSITORY, claim, log_snapshot
from tests.integration.tenant_roles import TenantRoles, sqlstate
from tests.integration.test_cli_agents import cli, lines
from wal_engine import events as ev
from wal_engine.audit.anchor import (
    Anchor,
    generate_signing_key,
    load_public_key,
    sign_anchor,
)
from wal_engine.audit.archive import verify_archive
from wal_engine.effects.gateway import Claim, IdempotencyGateway
from wal_engine.errors import TaskArchived, UnknownTask
from wal_engine.store import Database, Store

pytest.importorskip("cryptography", reason="signed anchors need the security extra")

KILL_TIMEOUT_S = 60.0


async def _finish(store: Store, task_id: str, *, ending: str = "completed",
                  messages: int = 2) -> None:
    """A task claimed, given ``messages`` messages and ended (completed, failed, cancelled)."""
    await store.create_task(task_id, "agent", input={"n": task_id})
    await claim(store.database)
    head = await store.read_head(task_id)
    events: list[Any] = [ev.MessageAppended(role="user", content=f"message {index}")
                         for index in range(messages)]
    if ending == "completed":
        events.append(ev.TaskCompleted(output={"done": task_id}))
    elif ending == "failed":
        events.append(ev.TaskFailed(reason="boom"))
    await store.append_events(task_id, events, epoch=head.lease_epoch,
                              expected_seq=head.head_seq, prev_hash=head.head_hash)
    if ending == "cancelled":
        await store.database.fetch("SELECT wal_cancel_task($1, 'test', 'me')", task_id)


async def _now(database: Database) -> dt.datetime:
    row = await database.fetchrow("SELECT clock_timestamp() AS now")
    return row["now"]


def _keys(tmp_path: Path) -> tuple[Path, Path]:
    private_pem, public_pem = generate_signing_key()
    (tmp_path / "key.pem").write_bytes(private_pem)
    (tmp_path / "key.pub").write_bytes(public_pem)
    return tmp_path / "key.pem", tmp_path / "key.pub"


async def _archive_of(database_dsn: str, store: Store, tmp_path: Path) -> tuple[Path, Path]:
    """Two finished tasks archived and removed; the archive and the public key."""
    await _finish(store, "t-1")
    await _finish(store, "t-2", ending="failed")
    await store.create_task("t-3", "agent", input={"big": "x" * 200_000})  # In wal_blobs.
    await claim(store.database)
    head = await store.read_head("t-3")
    await store.append_events("t-3", [ev.TaskCompleted(output=None)], epoch=head.lease_epoch,
                              expected_seq=head.head_seq, prev_hash=head.head_hash)
    key, public = _keys(tmp_path)
    archives = tmp_path / "archives"
    archives.mkdir()
    done = await cli("retention", "run", "--older-than", "0s", "--archive", str(archives),
                     "--key", str(key), "--dsn", database_dsn, "--json")
    assert done.exit_code == 0, done.output
    [batch] = lines(done.stdout)
    return Path(batch["archive"]), public


async def test_plan_reads_only_and_run_removes_only_old_finished_tasks(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """plan changes nothing and lists the finished tasks older than the cutoff; run archives
    and removes exactly those (not a running task, a task finished later, the finished
    parent of a running child or the finished child of a running parent), records the batch,
    leaves tombstones, and the archive verifies offline with the public key."""
    await _finish(store, "done-1")
    await _finish(store, "fail-1", ending="failed")
    await _finish(store, "cancel-1", ending="cancelled")
    await store.create_task("live-1", "agent")
    await store.create_task("parent-live", "agent")
    await claim(store.database)
    await store.create_child_task("child-done", "agent", parent_task_id="parent-live",
                                  input=None, budget=None, agent_version=None,
                                  on_parent_end="cancel")
    await claim(store.database)
    child = await store.read_head("child-done")
    await store.append_events("child-done", [ev.TaskCompleted(output=1)],
                              epoch=child.lease_epoch, expected_seq=child.head_seq,
                              prev_hash=child.head_hash)
    await store.create_task("parent-done", "agent")
    await claim(store.database)
    await store.create_child_task("child-live", "agent", parent_task_id="parent-done",
                                  input=None, budget=None, agent_version=None,
                                  on_parent_end="abandon")
    parent = await store.read_head("parent-done")
    await store.append_events("parent-done", [ev.TaskCompleted(output=2)],
                              epoch=parent.lease_epoch, expected_seq=parent.head_seq,
                              prev_hash=parent.head_hash)
    cutoff = (await _now(store.database)).astimezone(dt.UTC)
    await _finish(store, "late-1")

    anchored = await cli("anchor", str(tmp_path / "before.anchor"), "--dsn", database_dsn)
    assert anchored.exit_code == 0, anchored.output
    before = await log_snapshot(store.database)
    planned = await cli("retention", "plan", "--before", cutoff.isoformat(), "--dsn",
                        database_dsn, "--json")
    assert planned.exit_code == 0, planned.output
    [view] = lines(planned.stdout)
    assert (view["tasks"], view["by_status"]) == (3, {"COMPLETED": 1, "FAILED": 1,
                                                       "CANCELLED": 1})
    assert view["events"] == 5 + 5 + 5 and view["bytes"] > 0
    only_failed = await cli("retention", "plan", "--before", cutoff.isoformat(), "--status",
                            "failed", "--dsn", database_dsn)
    assert only_failed.exit_code == 0, only_failed.output
    assert "1 task(s) (1 FAILED)" in only_failed.stdout
    assert await log_snapshot(store.database) == before

    key, public = _keys(tmp_path)
    ran = await cli("retention", "run", "--before", cutoff.isoformat(), "--archive",
                    str(tmp_path), "--key", str(key), "--batch", "2", "--dsn", database_dsn)
    assert ran.exit_code == 0, ran.output
    assert "retention: 3 task(s) removed in 2 batch(es)" in ran.stdout
    for task_id in ("done-1", "fail-1", "cancel-1"):
        with pytest.raises(UnknownTask):
            await store.read_head(task_id)
    for task_id in ("live-1", "parent-live", "child-done", "parent-done", "child-live",
                    "late-1"):
        assert (await store.verify_task(task_id)).ok
    logged = await store.database.fetch(
        "SELECT tasks, task_ids, events, archive_name, anchor_public_key, session_role"
        " FROM wal_retention_log ORDER BY retention_id")
    assert [(row["task_ids"], row["events"]) for row in logged] == [
        (["cancel-1", "done-1"], 10), (["fail-1"], 5)]
    assert all(row["anchor_public_key"] == load_public_key(public).hex() for row in logged)
    tombstones = await store.database.fetch(
        "SELECT task_id, status, ending FROM wal_archived_tasks ORDER BY task_id")
    assert [tuple(row) for row in tombstones] == [
        ("cancel-1", "FAILED", "task_cancelled"), ("done-1", "COMPLETED", "task_completed"),
        ("fail-1", "FAILED", "task_failed")]
    for row in logged:
        path = tmp_path / row["archive_name"]
        checked = await cli("verify", "--archive", str(path), "--public-key", str(public))
        assert checked.exit_code == 0, checked.output
        assert checked.stdout.rstrip().endswith("signature ok): all ok")
    after = await cli("verify", "--anchor", str(tmp_path / "before.anchor"), "--dsn",
                      database_dsn)
    assert after.exit_code == 0, after.output
    assert "3 archived by retention since (`verify --archive`)): all ok" in after.stdout
    again = await cli("retention", "plan", "--before", cutoff.isoformat(), "--dsn",
                      database_dsn, "--json")
    assert lines(again.stdout)[0]["tasks"] == 0


async def test_tampered_archive_fails_verify_with_a_clear_finding(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """An edited payload, a dropped line, a dropped task, an edited anchor, an anchor
    re-signed by another key and an altered large value each fail `verify --archive`,
    naming what is wrong (an untouched archive with a large value verifies)."""
    path, public = await _archive_of(database_dsn, store, tmp_path)
    key = load_public_key(public)
    assert verify_archive(path, key).ok
    original = path.read_bytes().splitlines(keepends=True)

    def variant(name: str, rows: list[bytes]) -> Path:
        target = tmp_path / name
        target.write_bytes(b"".join(rows))
        return target

    edited = [row.replace(b"message 1", b"message X") if b'"task_id":"t-1"' in row else row
              for row in original]
    findings = verify_archive(variant("edited.jsonl", edited), key).findings
    assert [(f.task_id, f.seq, f.kind) for f in findings] == [("t-1", 4, "chain")]
    assert "stored hash does not match content" in findings[0].detail

    event_rows = [i for i, row in enumerate(original) if b'"kind":"event"' in row]
    dropped = [row for i, row in enumerate(original) if i != event_rows[2]]
    findings = verify_archive(variant("dropped.jsonl", dropped), key).findings
    assert findings[0].task_id == "t-1" and findings[0].kind == "chain"
    assert "gap" in findings[0].detail

    start = next(i for i, row in enumerate(original) if b'"task_id":"t-2"' in row)
    end = next(i for i, row in enumerate(original) if b'"task_id":"t-3"' in row)
    no_task = original[:start] + original[end:]
    kinds = {(f.task_id, f.kind) for f in verify_archive(variant("notask.jsonl", no_task),
                                                         key).findings}
    assert ("t-2", "anchor") in kinds and (None, "format") in kinds

    anchor_line = orjson.loads(original[-1])
    anchor_line["anchor"]["heads"][0][2] = "00" * 32
    forged = [*original[:-1], orjson.dumps(anchor_line) + b"\n"]
    findings = verify_archive(variant("forged.jsonl", forged), key).findings
    assert [(f.kind, f.detail) for f in findings] == [
        ("signature", "the anchor's signature does not match its content")]

    anchor = msgspec.convert(orjson.loads(original[-1])["anchor"], type=Anchor)
    other_private, _ = generate_signing_key()
    resigned = sign_anchor(msgspec.structs.replace(anchor, signature=None), other_private)
    line = orjson.dumps({"kind": "anchor", "anchor": msgspec.to_builtins(resigned)}) + b"\n"
    target = variant("resigned.jsonl", [*original[:-1], line])
    assert [f.detail for f in verify_archive(target, key).findings] == [
        "the anchor is signed by another key"]
    failed = await cli("verify", "--archive", str(target), "--public-key", str(public))
    assert failed.exit_code == 1
    assert "archive: FAILED (signature): the anchor is signed by another key" in failed.stdout
    blob = next(i for i, row in enumerate(original) if b'"kind":"blob"' in row)
    fields = orjson.loads(original[blob])
    fields["data"] = base64.b64encode(zstandard.ZstdCompressor().compress(b'"y"')).decode()
    swapped = [orjson.dumps(fields) + b"\n" if i == blob else row
               for i, row in enumerate(original)]
    findings = verify_archive(variant("blob.jsonl", swapped), key).findings
    assert [(f.task_id, f.seq, f.kind) for f in findings] == [("t-3", 1, "chain")]
    assert findings[0].detail.startswith("blob: ")
    cut = await cli("verify", "--archive", str(variant("cut.jsonl", original[:-1])))
    assert cut.exit_code == 1 and "has no anchor line" in cut.stdout


async def test_late_duplicate_submission_and_idempotency_key_dedup_after_archive(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """After a task is archived, submitting its id again raises TaskArchived and creates
    nothing, and a call with one of its idempotency keys gets the recorded result without
    acting; the tombstone lists the key."""
    await store.create_task("dup-1", "agent", input={"n": 1})
    await claim(store.database)
    gateway = IdempotencyGateway(store.database)
    acted: list[int] = []

    async def effect() -> Any:
        acted.append(1)
        return {"charged": 5}

    first = Claim(key="idem:dup-1:3", owner="w1", epoch=1, task_id="dup-1")
    assert await gateway.run_once(first, effect) == {"charged": 5}
    head = await store.read_head("dup-1")
    await store.append_events("dup-1", [ev.TaskCompleted(output=None)], epoch=head.lease_epoch,
                              expected_seq=head.head_seq, prev_hash=head.head_hash)
    ran = await cli("retention", "run", "--older-than", "0s", "--archive", str(tmp_path),
                    "--dsn", database_dsn)
    assert ran.exit_code == 0, ran.output

    with pytest.raises(TaskArchived) as raised:
        await store.create_task("dup-1", "agent", input={"n": 1})
    assert raised.value.status == "COMPLETED"
    assert await store.database.fetchrow("SELECT 1 FROM wal_tasks WHERE task_id = 'dup-1'") \
        is None
    late = Claim(key="idem:dup-1:3", owner="w2", epoch=2, task_id="dup-1")
    assert await gateway.run_once(late, effect) == {"charged": 5}
    assert acted == [1]
    keys = await store.database.fetchrow(
        "SELECT idempotency_keys FROM wal_archived_tasks WHERE task_id = 'dup-1'")
    assert keys["idempotency_keys"] == ["idem:dup-1:3"]
    submitted = await cli("submit", "agent", "--task-id", "dup-1", "--dsn", database_dsn)
    assert submitted.exit_code != 0 and "was archived" in submitted.stderr


async def test_runtime_role_cannot_use_the_retention_path(
        store: Store, database_dsn: str, tenant_roles: TenantRoles) -> None:
    """A tenant's runtime role can neither call wal_retention_remove, nor write the log or
    a tombstone, nor delete events with the flag forged; the function is not SECURITY
    DEFINER; the owner deleting outside the function, flag forged, is refused by the
    append-only trigger (WE002), and the function refuses a head the task does not have
    (WE009)."""
    await _finish(store, "keep-1")
    head = await store.read_head("keep-1")
    app = await asyncpg.connect(await tenant_roles.dsn("default"))
    try:
        assert await sqlstate(
            app, "SELECT * FROM wal_retention_remove(ARRAY['keep-1'], ARRAY[$1::int8],"
                 " ARRAY[$2::bytea], now(), 'x', $2, $2, NULL)", head.head_seq,
            head.head_hash) == "42501"
        assert await sqlstate(app, "INSERT INTO wal_retention_log (finished_before, tasks,"
                                   " task_ids, archive_name, archive_sha256, anchor_root)"
                                   " VALUES (now(), 1, ARRAY['keep-1'], 'x', $1, $1)",
                              head.head_hash) == "42501"
        assert await sqlstate(app, "INSERT INTO wal_archived_tasks (task_id, agent, status,"
                                   " ending, head_seq, head_hash, finished_at, retention_id)"
                                   " VALUES ('keep-1', 'a', 'COMPLETED', 'x', 1, $1, now(), 1)",
                              head.head_hash) == "42501"
        await app.execute("SELECT set_config('wal_engine.retention_id', '1', false)")
        assert await sqlstate(app, "DELETE FROM wal_events WHERE task_id = 'keep-1'") == "42501"
    finally:
        await app.close()
    owner = await asyncpg.connect(database_dsn, server_settings={"wal.tenant": "default"})
    try:
        assert await owner.fetchval(
            "SELECT p.prosecdef FROM pg_proc p WHERE p.proname = 'wal_retention_remove'") \
            is False
        await owner.execute("SELECT set_config('wal_engine.retention_id', '1', false)")
        assert await sqlstate(owner, "DELETE FROM wal_events WHERE task_id = 'keep-1'") \
            == "WE002"
        assert await sqlstate(  # The owner's own call, with a head the task no longer has.
            owner, "SELECT * FROM wal_retention_remove(ARRAY['keep-1'], ARRAY[$1::int8],"
                   " ARRAY[$2::bytea], now(), 'x', $2, $2, NULL)", head.head_seq,
            bytes(32)) == "WE009"
    finally:
        await owner.close()
    assert (await store.verify_task("keep-1")).ok


async def test_crash_between_archive_and_removal_changes_nothing_and_a_rerun_finishes(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """`retention run` killed (SIGKILL) after its archive is written and verified but before
    the removal leaves the database unchanged; a second run archives and removes."""
    await _finish(store, "k-1")
    await _finish(store, "k-2")
    before = await log_snapshot(store.database)
    environment = {**os.environ, "ENGINE_FAILPOINT": "retention_after_archive:1:sigkill",
                   "PYTHONPATH": str(REPOSITORY)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "wal_engine.cli", "retention", "run", "--older-than", "0s",
        "--archive", str(tmp_path), "--dsn", database_dsn, cwd=REPOSITORY, env=environment,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), KILL_TIMEOUT_S)
    assert process.returncode == -signal.SIGKILL, stderr.decode()
    [leftover] = await asyncio.to_thread(lambda: list(tmp_path.glob("wal-archive-*.jsonl")))
    assert verify_archive(leftover).ok
    assert await log_snapshot(store.database) == before
    assert (await store.database.fetchrow("SELECT count(*) AS n FROM wal_retention_log"))["n"] \
        == 0

    ran = await cli("retention", "run", "--older-than", "0s", "--archive", str(tmp_path),
                    "--dsn", database_dsn, "--json")
    assert ran.exit_code == 0, ran.output
    [batch] = lines(ran.stdout)
    assert batch["tasks"] == 2 and Path(batch["archive"]) != leftover
    assert (await store.database.fetchrow("SELECT count(*) AS n FROM wal_tasks"))["n"] == 0


FIGURE_TASKS = 2000


@pytest.mark.deep
@pytest.mark.skipif(os.environ.get("RELIABILITY_DEEP") != "1",
                    reason="deep tier: set RELIABILITY_DEEP=1 to run it")
async def test_retention_of_2000_tasks_figures(store: Store, tmp_path: Path) -> None:
    """2000 finished tasks of 6 events each are planned, archived (signed, fsynced, read
    back), removed and verified offline; prints a figures line with the times and sizes."""
    from tests.fault.support import FIGURES
    from wal_engine.audit.retention import plan_retention, run_retention

    async def finish(task_id: str) -> None:
        head = await store.read_head(task_id)
        await store.append_events(
            task_id, [*(ev.MessageAppended(role="user", content=f"m{j}") for j in range(3)),
                      ev.TaskCompleted(output={"ok": task_id})],
            epoch=head.lease_epoch, expected_seq=head.head_seq, prev_hash=head.head_hash)

    for start in range(0, FIGURE_TASKS, 100):
        ids = [f"m-{index:05d}" for index in range(start, start + 100)]
        await asyncio.gather(*(store.create_task(t, "agent", input={"i": t}) for t in ids))
        await claim(store.database, ttl_ms=600_000)
        await asyncio.gather(*(finish(t) for t in ids))
    private, _ = generate_signing_key()
    started = time.perf_counter()
    plan = await plan_retention(store.database, older_than=dt.timedelta(0))
    planned = time.perf_counter()
    batches = await run_retention(store.database, tmp_path, older_than=dt.timedelta(0),
                                  signing_key=private, batch_tasks=500)
    ran = time.perf_counter()
    # Blocking stat calls: a measurement, after the timed part.
    sizes = [Path(batch.archive).stat().st_size for batch in batches]  # noqa: ASYNC240
    verified = all(verify_archive(batch.archive).ok for batch in batches)
    checked = time.perf_counter()
    assert plan.tasks == sum(batch.tasks for batch in batches) == FIGURE_TASKS and verified
    assert (await store.database.fetchrow("SELECT count(*) AS n FROM wal_events"))["n"] == 0
    FIGURES.append(
        f"retention: plan {plan.tasks} tasks / {plan.events} events "
        f"{(planned - started) * 1000:.0f} ms; run (archive, fsync, read back, remove) "
        f"{len(batches)} batches "
        f"{(ran - planned) * 1000:.0f} ms = {(ran - planned) / FIGURE_TASKS * 1e6:.0f} µs/task; "
        f"archives {sum(sizes)} bytes = {sum(sizes) // FIGURE_TASKS} bytes/task; offline "
        f"verify {(checked - ran) * 1000:.0f} ms")


async def test_an_intents_derived_key_is_archived_and_kept_in_the_tombstone(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """An intent's own key is not stored in its row (decision 71: derived from task and
    seq); the archive's task line and the tombstone still list it, so a late duplicate of
    the call dedups after the rows are gone."""
    await store.create_task("derived-1", "agent")
    await claim(store.database)
    head = await store.read_head("derived-1")
    key = f"idem:derived-1:{head.head_seq + 1}"
    intent = ev.ToolCallIntended(call_id="c1", tool="charge", args={"n": 1}, args_hash="00",
                                 idempotency_key=key)
    done = ev.TaskCompleted(output=None)
    await store.append_events("derived-1", [intent, done], epoch=head.lease_epoch,
                              expected_seq=head.head_seq, prev_hash=head.head_hash)
    stored = await store.database.fetchrow(
        "SELECT idempotency_key FROM wal_events WHERE task_id = 'derived-1' AND seq = $1",
        head.head_seq + 1)
    assert stored["idempotency_key"] == ""  # derived, not stored
    ran = await cli("retention", "run", "--older-than", "0s", "--archive", str(tmp_path),
                    "--dsn", database_dsn)
    assert ran.exit_code == 0, ran.output
    tombstone = await store.database.fetchrow(
        "SELECT idempotency_keys FROM wal_archived_tasks WHERE task_id = 'derived-1'")
    assert tombstone["idempotency_keys"] == [key]
    def task_lines() -> list[Any]:
        return [line for path in tmp_path.glob("wal-archive-*.jsonl")
                for line in map(orjson.loads, path.read_bytes().splitlines())
                if line.get("kind") == "task" and line.get("task_id") == "derived-1"]

    lines_read = await asyncio.to_thread(task_lines)
    assert [line["idempotency_keys"] for line in lines_read] == [[key]]
