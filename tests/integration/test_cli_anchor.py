"""``wal-engine anchor``, ``anchor-keygen`` and ``verify --anchor`` on real PostgreSQL, and
``--development`` (the security self-test of every command that opens an engine)."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import asyncpg
import orjson
import pytest

from tests.helpers import task_with_messages
from tests.integration.tenant_roles import TenantRoles
from tests.integration.test_cli_agents import cli, lines, one_error_line
from wal_engine.audit.anchor import read_anchor
from wal_engine.security.roles import APP_ROLE, DEVELOPMENT_ENV, dsn_for_role
from wal_engine.store import Store

BYPASS_ROLE = "cli_dev_bypass"
"""A login role with BYPASSRLS (not a superuser): refused by the self-test in production."""


async def _task(store: Store, task_id: str, messages: int = 3) -> int:
    """A claimed task whose log ends with messages; returns its head seq."""
    return await task_with_messages(store, task_id, messages)


async def _tamper(dsn: str, statement: str, *args: object) -> None:
    """Run ``statement`` as the superuser, around the append-only trigger."""
    connection = await asyncpg.connect(dsn)
    try:
        async with connection.transaction():
            await connection.execute(
                "ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only")
            await connection.execute(statement, *args)
            await connection.execute(
                "ALTER TABLE wal_events ENABLE TRIGGER wal_events_append_only")
    finally:
        await connection.close()


async def test_anchor_verifies_untouched_and_names_the_task_whose_tail_was_deleted(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """An anchor of an untouched database verifies (exit 0); after the last event of one
    task is deleted, verify --anchor names that task and seq (exit 1), alone, with --all
    (whose chains still verify) and with --json."""
    await _task(store, "a-1")
    last = await _task(store, "a-2")
    path = tmp_path / "anchor.json"
    written = await cli("anchor", str(path), "--dsn", database_dsn)
    assert written.exit_code == 0, written.output
    anchor = read_anchor(path)
    assert anchor.tasks == 2 and anchor.signature is None
    assert f"anchor of 2 task(s) (heads mode) written to {path}" in written.stdout
    assert f"root {anchor.root}, unsigned" in written.stdout
    as_json = await cli("anchor", str(tmp_path / "again.json"), "--dsn", database_dsn, "--json")
    assert as_json.exit_code == 0
    [view] = lines(as_json.stdout)
    assert (view["tasks"], view["mode"], view["signed"], view["root"]) == (2, "heads", False,
                                                                           anchor.root)

    clean = await cli("verify", "--anchor", str(path), "--dsn", database_dsn)
    assert clean.exit_code == 0, clean.output
    assert f"anchor {path} (2 task(s), heads mode, unsigned" in clean.stdout
    assert clean.stdout.rstrip().endswith("all ok")
    clean_json = await cli("verify", "--anchor", str(path), "--dsn", database_dsn, "--json")
    assert clean_json.exit_code == 0
    assert [(r["anchor"], r["ok"], r["anchored_tasks"], r["findings"])
            for r in lines(clean_json.stdout)] == [(str(path), True, 2, [])]

    await _tamper(database_dsn, "DELETE FROM wal_events WHERE task_id = $1 AND seq = $2",
                  "a-2", last)
    cut = await cli("verify", "--anchor", str(path), "--dsn", database_dsn)
    assert cut.exit_code == 1, cut.output
    assert f"task a-2: FAILED at seq {last} (truncated)" in cut.stdout
    assert "1 finding(s)" in cut.stdout and "a-1" not in cut.stdout
    cut_json = await cli("verify", "--anchor", str(path), "--dsn", database_dsn, "--json")
    assert cut_json.exit_code == 1
    [report] = lines(cut_json.stdout)
    assert report["ok"] is False
    assert [(f["task_id"], f["seq"], f["kind"]) for f in report["findings"]] == [
        ("a-2", last, "truncated")]
    with_all = await cli("verify", "--all", "--anchor", str(path), "--dsn", database_dsn)
    assert with_all.exit_code == 1
    assert "verified 2 task(s)" in with_all.stdout and "all ok" in with_all.stdout
    assert f"task a-2: FAILED at seq {last} (truncated)" in with_all.stdout
    one_task = await cli("verify", "a-1", "--anchor", str(path), "--dsn", database_dsn)
    assert one_task.exit_code == 1 and "task a-1: ok" in one_task.stdout
    # Without the anchor the chains alone cannot see the truncation.
    assert (await cli("verify", "--all", "--dsn", database_dsn)).exit_code == 0


async def test_verify_anchor_alone_checks_the_anchored_chains(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """A flipped byte: verify --anchor alone names its seq (chain); with --all the chain
    report names it and the anchor itself still holds; a root-mode anchor works too."""
    await _task(store, "c-1")
    path = tmp_path / "root.json"
    assert (await cli("anchor", str(path), "--mode", "root", "--dsn", database_dsn)
            ).exit_code == 0
    assert read_anchor(path).mode == "root"
    await _tamper(database_dsn, "UPDATE wal_events SET payload = set_byte(payload, 3, "
                  "get_byte(payload, 3) # 1) WHERE task_id = $1 AND seq = $2", "c-1", 3)
    alone = await cli("verify", "--anchor", str(path), "--dsn", database_dsn, "--json")
    assert alone.exit_code == 1
    [report] = lines(alone.stdout)
    assert [(f["task_id"], f["seq"], f["kind"]) for f in report["findings"]] == [
        ("c-1", 3, "chain")]
    with_all = await cli("verify", "--all", "--anchor", str(path), "--dsn", database_dsn,
                         "--json")
    assert with_all.exit_code == 1
    anchor_line, chain_line = lines(with_all.stdout)
    assert anchor_line["ok"] is True and anchor_line["findings"] == []
    assert (chain_line["task_id"], chain_line["ok"], chain_line["violation"]["seq"]) == (
        "c-1", False, 3)


async def test_signed_anchor_verifies_with_its_public_key_and_not_with_another(
        store: Store, database_dsn: str, tmp_path: Path) -> None:
    """anchor-keygen writes a pair (private 0600); an anchor signed with it verifies with
    its public key and is refused (exit 1) with another key or a forged date."""
    pytest.importorskip("cryptography")
    await _task(store, "s-1")
    private, public = tmp_path / "anchor.key", tmp_path / "anchor.pub"
    made = await cli("anchor-keygen", str(private), str(public), "--json")
    assert made.exit_code == 0, made.output
    [keys] = lines(made.stdout)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    again = await cli("anchor-keygen", str(private), str(public))
    assert again.exit_code == 2 and "exists; pass --force" in one_error_line(again)
    other_private, other_public = tmp_path / "other.key", tmp_path / "other.pub"
    assert (await cli("anchor-keygen", str(other_private), str(other_public))).exit_code == 0

    path = tmp_path / "signed.json"
    signed = await cli("anchor", str(path), "--signing-key", str(private), "--dsn",
                       database_dsn)
    assert signed.exit_code == 0, signed.output
    assert f"signed by {keys['public_key_hex']}" in signed.stdout
    good = await cli("verify", "--anchor", str(path), "--public-key", str(public), "--dsn",
                     database_dsn)
    assert good.exit_code == 0, good.output
    assert "signature ok" in good.stdout
    wrong = await cli("verify", "--anchor", str(path), "--public-key", str(other_public),
                      "--dsn", database_dsn, "--json")
    assert wrong.exit_code == 1
    [report] = lines(wrong.stdout)
    assert [(f["kind"], f["detail"]) for f in report["findings"]] == [
        ("invalid_anchor", "the anchor is signed by another key")]
    document = orjson.loads(path.read_bytes())
    document["created_at"] = "2000-01-01T00:00:00+00:00"
    forged = tmp_path / "forged.json"
    forged.write_bytes(orjson.dumps(document))
    edited = await cli("verify", "--anchor", str(forged), "--dsn", database_dsn)
    assert edited.exit_code == 1
    assert "anchor: FAILED (invalid_anchor): the anchor's signature does not match" in \
        edited.stdout
    not_a_key = await cli("anchor", str(tmp_path / "x.json"), "--signing-key", str(public),
                          "--dsn", database_dsn)
    assert not_a_key.exit_code == 2 and "--signing-key" in one_error_line(not_a_key)


async def test_bad_anchor_input_is_one_line_and_exit_2(store: Store, database_dsn: str,
                                                       tmp_path: Path) -> None:
    """A missing file, malformed JSON, another JSON document, a non-hex hash, a missing
    directory and misused options: one error line each, exit 2."""
    await _task(store, "b-1")
    good = tmp_path / "good.json"
    assert (await cli("anchor", str(good), "--dsn", database_dsn)).exit_code == 0
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"format": "wal-engine-anchor", ')
    other = tmp_path / "other.json"
    other.write_text('{"hello": "world"}')
    not_hex = tmp_path / "not-hex.json"
    document = orjson.loads(good.read_bytes())
    document["heads"][0][2] = "zz" * 32
    not_hex.write_bytes(orjson.dumps(document))
    cases = [
        (["verify", "--anchor", str(tmp_path / "missing.json")], "does not exist"),
        (["verify", "--anchor", str(malformed)], "cannot read anchor"),
        (["verify", "--anchor", str(other)], "cannot read anchor"),
        (["verify", "--anchor", str(not_hex)], "is not hex"),
        (["verify", "--anchor", str(good), "--public-key", str(tmp_path / "none.pub")],
         "does not exist"),
        (["verify", "b-1", "--public-key", str(good)], "--public-key needs --anchor"),
        (["verify"], "pass --anchor FILE"),
        (["anchor", str(tmp_path / "no-such-dir" / "a.json")], "no directory"),
    ]
    if importlib.util.find_spec("cryptography") is not None:
        cases.append((["verify", "--anchor", str(good), "--public-key", str(malformed)],
                      "--public-key"))
    for command, expected in cases:
        result = await cli(*command, "--dsn", database_dsn)
        assert result.exit_code == 2, (command, result.output)
        assert expected in one_error_line(result), (command, result.stderr)
        assert result.stdout == "", command


async def test_development_flag_lets_a_refused_role_through_and_the_app_role_passes(
        database_dsn: str, tenant_roles: TenantRoles, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A BYPASSRLS role is refused by the self-test (exit 4, one line); --development or
    WAL_ENGINE_DEVELOPMENT=1 lets it through; a tenant's own role needs neither."""
    monkeypatch.delenv(DEVELOPMENT_ENV, raising=False)
    admin = await asyncpg.connect(database_dsn)
    try:
        await admin.execute(f"DROP ROLE IF EXISTS {BYPASS_ROLE}")
        await admin.execute(f"CREATE ROLE {BYPASS_ROLE} LOGIN BYPASSRLS IN ROLE {APP_ROLE}")
        try:
            bypass_dsn = dsn_for_role(database_dsn, BYPASS_ROLE)
            refused = await cli("tasks", "--dsn", bypass_dsn)
            assert refused.exit_code == 4, refused.output
            assert f"refusing to run as role '{BYPASS_ROLE}'" in one_error_line(refused)
            assert "BYPASSRLS" in refused.stderr
            allowed = await cli("tasks", "--dsn", bypass_dsn, "--development", "--json")
            assert allowed.exit_code == 0, allowed.output
            by_env = await cli("verify", "--all", "--dsn", bypass_dsn,
                               env={DEVELOPMENT_ENV: "1"})
            assert by_env.exit_code == 0, by_env.output
            app_dsn = await tenant_roles.dsn("default")
            production = await cli("anchor", str(tmp_path / "app.json"), "--dsn", app_dsn)
            assert production.exit_code == 0, production.output
            assert (await cli("verify", "--anchor", str(tmp_path / "app.json"), "--dsn",
                              app_dsn)).exit_code == 0
        finally:
            await admin.execute(f"DROP ROLE {BYPASS_ROLE}")
    finally:
        await admin.close()
