"""Chain version 2 and the semantic verifier (pure), the id rules and bounded anchor reads
(issue 16: history kept honest, and the smaller findings)."""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import msgspec
import pytest

from wal_engine import events as ev
from wal_engine.audit.anchor import AnchorInvalid, read_anchor
from wal_engine.budgets import validate_budget
from wal_engine.chain import GENESIS_HASH, event_hash, event_hash_v2, row_hash
from wal_engine.errors import InvalidInput, InvalidTaskId
from wal_engine.ids import validate_task_id, validate_text
from wal_engine.store import EventRecord
from wal_engine.verification import verify_history

STAMP = dt.datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=dt.UTC)


def _history(events: list[tuple[ev.Event, int]], *, start: dt.datetime = STAMP,
             chain_version: int = 2) -> list[EventRecord]:
    """Rows of task "t" chained honestly under ``chain_version``: (event, epoch) pairs."""
    rows: list[EventRecord] = []
    previous = GENESIS_HASH
    for seq, (event, epoch) in enumerate(events, start=1):
        kind, version, payload = ev.encode_event(event)
        key = getattr(event, "idempotency_key", None)
        stamp = start + dt.timedelta(seconds=seq)
        digest = event_hash_v2(previous, "t", seq, kind, version, epoch, stamp, key, payload) \
            if chain_version == 2 else event_hash(previous, "t", seq, kind, version, epoch,
                                                  payload)
        rows.append(EventRecord(task_id="t", seq=seq, type=kind, version=version, epoch=epoch,
                                payload=payload, idempotency_key=key, hash=digest,
                                recorded_at=stamp, chain_version=chain_version))
        previous = digest
    return rows


def _rehash(rows: list[EventRecord], index: int, **changes: object) -> list[EventRecord]:
    """Change row ``index`` and recompute the chain from there (a forger's rewrite)."""
    out = rows[:index]
    previous = out[-1].hash if out else GENESIS_HASH
    for row in rows[index:]:
        if row is rows[index]:
            row = msgspec.structs.replace(row, **changes)  # type: ignore[arg-type]
        row = msgspec.structs.replace(row, hash=row_hash(previous, row))
        out.append(row)
        previous = row.hash
    return out


HONEST = [(ev.TaskSubmitted(agent="a"), 0), (ev.TaskClaimed(worker_id="w", attempt=1), 1),
          (ev.MessageAppended(role="user", content="hi"), 1),
          (ev.TaskCompleted(output="ok"), 1)]


def test_v2_hash_covers_time_and_key() -> None:
    """Changing recorded_at (by a microsecond) or the idempotency key changes the hash."""
    base = event_hash_v2(GENESIS_HASH, "t", 1, "x", 1, 0, STAMP, "k", b"{}")
    assert base != event_hash_v2(GENESIS_HASH, "t", 1, "x", 1, 0,
                                 STAMP + dt.timedelta(microseconds=1), "k", b"{}")
    assert base != event_hash_v2(GENESIS_HASH, "t", 1, "x", 1, 0, STAMP, "k2", b"{}")
    assert base != event_hash_v2(GENESIS_HASH, "t", 1, "x", 1, 0, STAMP, None, b"{}")


@pytest.mark.parametrize("chain_version", [1, 2])
def test_honest_histories_verify_under_their_version(chain_version: int) -> None:
    """A history written under chain version 1 (the golden ones) or 2 verifies."""
    assert verify_history("t", _history(HONEST, chain_version=chain_version)).ok


def test_rewritten_time_is_a_hash_violation_in_v2_only() -> None:
    """A row whose recorded_at is changed afterwards fails its hash in version 2."""
    rows = _history(HONEST)
    changed = msgspec.structs.replace(rows[2], recorded_at=STAMP - dt.timedelta(days=1))
    report = verify_history("t", [*rows[:2], changed, rows[3]])
    assert report.violation is not None and (report.violation.seq,
                                             report.violation.kind) == (3, "hash")


@pytest.mark.parametrize(("index", "changes", "kind"), [
    (3, {"type": "message_appended", "payload": b'{"content":"x","role":"user"}'}, None),
    (2, {"epoch": 5}, "epoch"),
    (1, {"epoch": 3}, "epoch"),
    (2, {"payload": b'{"content":"\xff","role":"user"}'}, "semantics"),
    (2, {"recorded_at": STAMP - dt.timedelta(days=400)}, "time"),
    (2, {"type": "tool_call_completed", "payload": b'{"call_id":"c","result":1}'},
     "semantics"),
])
def test_forged_rewrites_are_named(index: int, changes: dict[str, object],
                                   kind: str | None) -> None:
    """Rewrites with recomputed hashes pass the chain but not the semantic checks."""
    rows = _rehash(_history(HONEST), index, **changes)
    report = verify_history("t", rows)
    assert (report.violation is None) == (kind is None)
    if kind is not None:
        assert report.violation is not None
        assert (report.violation.seq, report.violation.kind) == (index + 1, kind)


def test_an_event_after_the_end_is_named() -> None:
    """Nothing may follow a terminal event, even correctly chained."""
    rows = _history([*HONEST, (ev.MessageAppended(role="user", content="late"), 1)])
    report = verify_history("t", rows)
    assert report.violation is not None
    assert (report.violation.seq, report.violation.kind) == (5, "after_terminal")


@pytest.mark.parametrize("task_id", [".", "..", "...."])
def test_dots_alone_are_not_task_ids(task_id: str) -> None:
    """Ids made only of dots (path components) are refused; dots inside an id are fine."""
    with pytest.raises(InvalidTaskId):
        validate_task_id(task_id)
    assert validate_task_id(f"a{task_id}b") == f"a{task_id}b"


def test_text_validation() -> None:
    """Lone surrogates (undecodable shell bytes), NUL and oversize text are InvalidInput."""
    for value in ("bad\udcff", "nul\x00", "x" * 11):
        with pytest.raises(InvalidInput):
            validate_text(value, "a name", bytes_max=10)
    assert validate_text("ok\n", "a name", bytes_max=10) == "ok\n"


def test_budgets_must_be_positive() -> None:
    """A zero, negative, non-finite or boolean budget is refused before anything is sent."""
    for budget in (ev.Budget(max_tokens=-1), ev.Budget(max_steps=0),
                   ev.Budget(max_cost_usd=float("inf")), ev.Budget(max_tokens=True)):
        with pytest.raises(InvalidInput):
            validate_budget(budget)
    assert validate_budget(ev.Budget(max_tokens=1, max_cost_usd=0.5)).max_tokens == 1


def test_anchor_read_is_bounded(tmp_path: Path) -> None:
    """verify --anchor /dev/zero stops at the anchor size bound instead of reading forever."""
    started = time.monotonic()
    with pytest.raises(AnchorInvalid):
        read_anchor("/dev/zero")
    assert time.monotonic() - started < 30
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(AnchorInvalid):
        read_anchor(tmp_path / "a.json")
