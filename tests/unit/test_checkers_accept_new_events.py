"""The crash checkers accept the records issue 17 added (run_interrupted, patch_marked,
hook_failed): a golden history holding all three passes every per-task invariant, and an
escalation found after a lost connection is an allowed degraded outcome."""

from __future__ import annotations

import msgspec

from replay.fold import fold
from replay.state import Failure
from tests.golden.record import HISTORIES
from wal_engine.testing.invariants import check_task_log
from wal_engine.testing.machine import allow_escalated
from wal_engine.testing.replay import load_history

CONTINUED = HISTORIES / "deployed_v1_finished_on_v2.jsonl"


def test_a_history_with_the_new_records_passes_the_log_invariants() -> None:
    """Chain, seqs, epochs and terminal checks accept run_interrupted, patch_marked and
    hook_failed (run_interrupted keeps the epoch: the same lease goes on)."""
    records = load_history(CONTINUED)
    types = {record.type for record in records}
    assert {"run_interrupted", "patch_marked", "hook_failed"} <= types
    last = records[-1]
    assert check_task_log(last.task_id, records, head_seq=last.seq, head_hash=last.hash,
                          head_status="COMPLETED") == []


def test_a_broken_epoch_next_to_run_interrupted_is_still_caught() -> None:
    """The check is not vacuous: a run_interrupted at a stale epoch is an I7 violation."""
    records = load_history(CONTINUED)
    index = next(i for i, r in enumerate(records) if r.type == "run_interrupted")
    records[index] = msgspec.structs.replace(records[index], epoch=records[index].epoch - 1)
    last = records[-1]
    violations = check_task_log(last.task_id, records, head_seq=last.seq, head_hash=last.hash,
                                head_status="COMPLETED")
    assert any(v.invariant == "I7" and v.seq == records[index].seq for v in violations)


def test_an_escalation_after_a_lost_connection_is_an_allowed_outcome() -> None:
    """A call found in doubt by the re-run after run_interrupted (no resume, no orphaning)
    may be escalated; without any hand-off record it may not."""
    records = load_history(CONTINUED)
    escalated = msgspec.structs.replace(
        fold(records), failure=Failure(reason="uncertain_side_effect", seq=records[-1].seq))
    uncertain = msgspec.structs.replace(records[-1], type="tool_call_uncertain")
    interrupted = [r for r in records if r.type == "run_interrupted"]
    assert allow_escalated(escalated, [records[0], *interrupted, uncertain])
    assert not allow_escalated(escalated, [records[0], uncertain])


def test_a_snapshot_checked_again_after_a_change_is_checked_in_full() -> None:
    """check_snapshot reuses the result for a task whose rows and head are unchanged, but a
    row changed after a clean check (its payload, same hashes) is caught on the next one."""
    from wal_engine.testing.invariants import Snapshot, check_snapshot

    records = load_history(CONTINUED)
    last = records[-1]
    head = {"task_id": last.task_id, "head_seq": last.seq, "head_hash": last.hash,
            "status": "COMPLETED"}
    clean = Snapshot(events={last.task_id: list(records)}, heads=[head])
    assert check_snapshot(clean) == []
    assert check_snapshot(Snapshot(events={last.task_id: list(records)}, heads=[head])) == []
    tampered = list(records)
    tampered[2] = msgspec.structs.replace(tampered[2], payload=tampered[2].payload + b" ")
    violations = check_snapshot(Snapshot(events={last.task_id: tampered}, heads=[head]))
    assert any(v.invariant == "I13" and v.seq == tampered[2].seq for v in violations)
    assert check_snapshot(clean) == []
