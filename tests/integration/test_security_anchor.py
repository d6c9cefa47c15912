"""Anchored tamper evidence (RELIABILITY.md S7): as a superuser with the append-only
trigger disabled, a flipped byte, a deleted tail, two swapped events and a rewritten chain
are each detected, by the chain verifier (naming the seq) or by the anchor."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest

from tests.helpers import task_with_messages
from wal_engine import events as ev
from wal_engine.audit.anchor import (
    AnchoredHead,
    AnchorInvalid,
    create_anchor,
    export_anchor,
    leaf_hash,
    merkle_root,
    read_anchor,
    verify_anchor,
    write_anchor,
)
from wal_engine.chain import row_hash
from wal_engine.store import Database, Store


async def _task(store: Store, task_id: str, messages: int = 4) -> int:
    """A claimed task whose log ends with messages; returns its head seq."""
    return await task_with_messages(store, task_id, messages)


async def _tamper(database: Database, *statements: tuple[str, tuple[object, ...]]) -> None:
    """Run statements as the superuser with the append-only trigger disabled."""
    async with database.pool.acquire() as connection, connection.transaction():
        await connection.execute(
            "ALTER TABLE wal_events DISABLE TRIGGER wal_events_append_only")
        for statement, args in statements:
            await connection.execute(statement, *args)
        await connection.execute(
            "ALTER TABLE wal_events ENABLE TRIGGER wal_events_append_only")


async def test_untouched_database_verifies_and_later_appends_are_fine(store: Store,
                                                                      tmp_path: Path) -> None:
    """A fresh anchor verifies; events appended after it do not disturb it."""
    await _task(store, "a1")
    path = tmp_path / "anchor.json"
    anchor = await export_anchor(store.database, path)
    assert anchor.tasks == 1 and read_anchor(path) == anchor
    await _task(store, "a2")
    head = await store.read_head("a1")
    await store.append_events("a1", [ev.MessageAppended(role="user", content="later")],
                              epoch=head.lease_epoch, expected_seq=head.head_seq,
                              prev_hash=head.head_hash)
    report = await verify_anchor(store.database, path)
    assert report.ok and report.anchored_tasks == 1 and not report.signed


async def test_s7a_flipped_byte_is_named_by_its_seq(store: Store) -> None:
    """(a) One flipped payload byte: the verifier names that seq."""
    await _task(store, "t")
    anchor = await create_anchor(store.database)
    await _tamper(store.database, (
        "UPDATE wal_events SET payload = set_byte(payload, 3, get_byte(payload, 3) # 1)"
        " WHERE task_id = $1 AND seq = $2", ("t", 4)))
    report = await store.verify_task("t")
    assert report.violation is not None
    assert (report.violation.seq, report.violation.kind) == (4, "hash")
    checked = await verify_anchor(store.database, anchor)
    assert [(f.task_id, f.seq, f.kind) for f in checked.findings] == [("t", 4, "chain")]


async def test_s7b_deleted_tail_is_caught_by_the_anchor_only(store: Store) -> None:
    """(b) The last event deleted: the chain alone still verifies, the anchor does not."""
    last = await _task(store, "t")
    anchor = await create_anchor(store.database)
    await _tamper(store.database,
                  ("DELETE FROM wal_events WHERE task_id = $1 AND seq = $2", ("t", last)))
    assert (await store.verify_task("t")).ok, "a chain cannot see its own truncation"
    checked = await verify_anchor(store.database, anchor)
    assert [(f.task_id, f.seq, f.kind) for f in checked.findings] == [("t", last, "truncated")]


async def test_s7c_swapped_events_are_named_by_the_first_seq(store: Store) -> None:
    """(c) Two events swapped: the verifier names the first of them."""
    await _task(store, "t")
    anchor = await create_anchor(store.database)
    move = "UPDATE wal_events SET seq = $3 WHERE task_id = $1 AND seq = $2"
    await _tamper(store.database, (move, ("t", 4, 1000)), (move, ("t", 5, 4)),
                  (move, ("t", 1000, 5)))
    report = await store.verify_task("t")
    assert report.violation is not None and report.violation.seq == 4
    checked = await verify_anchor(store.database, anchor)
    assert [(f.seq, f.kind) for f in checked.findings] == [(4, "chain")]


async def _rewrite_chain(store: Store, task_id: str, from_seq: int) -> None:
    """Change one payload and recompute every hash after it: a chain that verifies."""
    records = await store.history(task_id)
    previous = records[from_seq - 2].hash
    statements: list[tuple[str, tuple[object, ...]]] = []
    for record in records[from_seq - 1:]:
        payload = record.payload
        if record.seq == from_seq:
            payload = payload.replace(b"message", b"MESSAGE")
        digest = row_hash(previous, msgspec.structs.replace(record, payload=payload))
        statements.append(("UPDATE wal_events SET payload = $3, hash = $4"
                           " WHERE task_id = $1 AND seq = $2",
                           (task_id, record.seq, payload, digest)))
        previous = digest
    await _tamper(store.database, *statements)


async def test_s7d_rewritten_chain_verifies_alone_but_not_against_the_anchor(
        store: Store) -> None:
    """A whole chain rewritten with recomputed hashes passes the chain check; the anchor
    names the task and its anchored seq."""
    last = await _task(store, "t")
    await _task(store, "u")
    anchor = await create_anchor(store.database)
    await _rewrite_chain(store, "t", 4)
    assert (await store.verify_task("t")).ok
    checked = await verify_anchor(store.database, anchor)
    assert [(f.task_id, f.seq, f.kind) for f in checked.findings] == [("t", last, "rewritten")]


async def test_root_mode_detects_rewrite_truncation_and_missing_task(store: Store) -> None:
    """A root-only anchor catches a rewrite (whole anchor), a truncation and a lost task."""
    await _task(store, "t")
    last_u = await _task(store, "u")
    await _task(store, "v")
    anchor = await create_anchor(store.database, mode="root")
    assert all(head.hash == "" for head in anchor.heads)
    assert (await verify_anchor(store.database, anchor)).ok
    await _rewrite_chain(store, "t", 3)
    kinds = [f.kind for f in (await verify_anchor(store.database, anchor)).findings]
    assert kinds == ["root"]
    await _tamper(store.database,
                  ("DELETE FROM wal_events WHERE task_id = $1 AND seq = $2", ("u", last_u)),
                  ("DELETE FROM wal_events WHERE task_id = $1", ("v",)),
                  ("DELETE FROM wal_tasks WHERE task_id = $1", ("v",)))
    found = [(f.task_id, f.kind) for f in (await verify_anchor(store.database,
                                                                anchor)).findings]
    assert found == [("u", "truncated"), ("v", "missing_task")]


async def test_signed_anchor_verifies_and_a_tampered_file_does_not(store: Store,
                                                                   tmp_path: Path) -> None:
    """An Ed25519-signed anchor verifies with its public key; an edited file, or a check
    against another key, is refused."""
    pytest.importorskip("cryptography")
    from wal_engine.audit.anchor import generate_signing_key, load_public_key

    await _task(store, "t")
    private_pem, public_pem = generate_signing_key()
    path = tmp_path / "signed.json"
    anchor = await export_anchor(store.database, path, signing_key=private_pem)
    assert anchor.signature is not None
    report = await verify_anchor(store.database, path, public_key=load_public_key(public_pem))
    assert report.ok and report.signed
    # A field only the signature covers (the root covers the heads): the date.
    forged = msgspec.structs.replace(read_anchor(path), created_at="2000-01-01T00:00:00+00:00")
    write_anchor(forged, tmp_path / "forged.json")
    with pytest.raises(AnchorInvalid):
        await verify_anchor(store.database, tmp_path / "forged.json")
    _, other_public = generate_signing_key()
    with pytest.raises(AnchorInvalid):
        await verify_anchor(store.database, path, public_key=load_public_key(other_public))
    unsigned = tmp_path / "unsigned.json"
    await export_anchor(store.database, unsigned)
    with pytest.raises(AnchorInvalid):
        await verify_anchor(store.database, unsigned, public_key=load_public_key(public_pem))


async def test_unsigned_anchor_whose_heads_disagree_with_its_root_is_refused(
        store: Store, tmp_path: Path) -> None:
    """Editing an unsigned anchor's heads without its root is caught."""
    await _task(store, "t")
    anchor = await create_anchor(store.database)
    head = anchor.heads[0]
    edited = msgspec.structs.replace(
        anchor, heads=[AnchoredHead(head.task_id, head.seq, "00" * 32)])
    with pytest.raises(AnchorInvalid):
        await verify_anchor(store.database, edited)


async def test_anchor_file_with_non_hex_fields_is_refused(store: Store, tmp_path: Path) -> None:
    """A hash, root or key that is not hex is a typed AnchorInvalid naming the field."""
    await _task(store, "t")
    path = tmp_path / "anchor.json"
    await export_anchor(store.database, path)
    good = path.read_text()
    head_hash = read_anchor(path).heads[0].hash
    for bad in (good.replace(head_hash, "zz" + head_hash[2:]),
                good.replace(head_hash, head_hash[:-1])):
        path.write_text(bad)
        with pytest.raises(AnchorInvalid, match="not hex"):
            read_anchor(path)


def _reference_root(leaves: list[bytes]) -> bytes:
    """RFC 6962 section 2.1, recursively."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaves[0]
    split = 1
    while split * 2 < len(leaves):
        split *= 2
    return hashlib.sha256(b"\x01" + _reference_root(leaves[:split])
                          + _reference_root(leaves[split:])).digest()


def test_merkle_root_matches_rfc6962() -> None:
    """The iterative root equals RFC 6962's recursive definition for 0..40 leaves."""
    for count in range(41):
        leaves = [leaf_hash(f"task-{i}", i + 1, bytes([i]) * 32) for i in range(count)]
        assert merkle_root(leaves) == _reference_root(leaves), count
