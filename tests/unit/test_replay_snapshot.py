"""Snapshots: msgpack round trips, deterministic bytes across processes, corrupt input, policy."""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from replay import AgentState, apply, decode_state, encode_state, fold
from replay import snapshot as snapshot_module
from replay import state as state_module
from replay.snapshot import (
    STATE_FORMAT,
    SegmentRef,
    SnapshotSegments,
    decode_snapshot,
    encode_snapshot,
    gc_paused,
    segment_digest,
)
from wal_engine import events as ev
from wal_engine.errors import SnapshotCorrupt
from wal_engine.runtime.resume import SnapshotPolicy
from wal_engine.state_machine import Status

repo_root = Path(__file__).resolve().parents[2]

# Folds a fixed history touching every part of the state and prints its snapshot's digest.
_digest_script = """
import hashlib
from replay import args_hash, encode_state, fold
from wal_engine import events as ev
history = [
    ev.TaskSubmitted(agent="a", input={"z": 1, "a": [1.5, "x"]}, budget=ev.Budget(max_steps=3)),
    ev.TaskClaimed(worker_id="w", attempt=1),
    ev.MessageAppended(role="user", content={"b": 1, "a": 2}),
    ev.EnvironmentSet(values={"Z": "1", "A": "2"}),
    ev.PlanUpdated(nodes=[ev.PlanNode(node_id="n2"), ev.PlanNode(node_id="n1")]),
    ev.ToolCallIntended(call_id="c9", tool="t", args_hash=args_hash(1), idempotency_key="k"),
    ev.ToolCallCompleted(call_id="c9", result={"y": 0.1, "x": None}),
    ev.ValueRecorded(call_id="v", kind="random", value=0.25),
    ev.LlmCallIntended(call_id="l1", model="m", request_hash="h", idempotency_key="k2"),
    ev.LlmCallCompleted(call_id="l1", response="r", input_tokens=3, cost_usd=0.1),
    ev.SignalReceived(name="s", payload=[1], signal_id=4),
    ev.StepCheckpointed(step=1, next_action={"n": 1}),
]
state = fold(list(enumerate(history, 1)), task_id="t")
print(hashlib.sha256(encode_state(state)).hexdigest())
"""


def _digest_in_subprocess(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", _digest_script], capture_output=True, text=True,
                         check=True, cwd=repo_root, env=env)
    return out.stdout.strip()


def test_snapshot_bytes_are_identical_across_processes() -> None:
    """The same events give byte-identical snapshots in processes with other hash seeds."""
    digests = {_digest_in_subprocess(seed) for seed in ("0", "1", "12345")}
    assert len(digests) == 1


def test_round_trip_keeps_state_and_call_order() -> None:
    """Decoding a snapshot gives an equal state whose calls keep their order."""
    history = [ev.TaskSubmitted(agent="a"), ev.TaskClaimed(worker_id="w")] + [
        ev.ValueRecorded(call_id=f"v{n}", kind="now", value=n) for n in (5, 3, 9, 1)
    ]
    state = fold(list(enumerate(history, 1)), task_id="t")
    decoded = decode_state(encode_state(state))
    assert decoded == state and list(decoded.calls) == ["v5", "v3", "v9", "v1"]
    assert encode_state(decoded) == encode_state(state)


def test_corrupt_snapshot_is_reported_with_task_and_seq() -> None:
    """Bytes that are not an AgentState raise SnapshotCorrupt naming task and seq."""
    with pytest.raises(SnapshotCorrupt) as caught:
        decode_state(b"\x93\x01\x02", task_id="t", seq=7)
    assert (caught.value.task_id, caught.value.seq) == ("t", 7)
    with pytest.raises(SnapshotCorrupt):
        decode_state(hashlib.sha256(b"x").digest())


def test_gc_pause_restores_the_collector() -> None:
    """The collector is enabled again after a pause, also when the body raises."""
    with pytest.raises(RuntimeError), gc_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()


def _at(seq: int, status: Status) -> AgentState:
    return msgspec.structs.replace(AgentState(task_id="t"), last_seq=seq, status=status)


def test_snapshot_policy_every_checkpoint_with_spacing() -> None:
    """A checkpoint is due once min_events passed since the last snapshot."""
    policy = SnapshotPolicy(on_checkpoint=True, every_events=None, min_events=10)
    assert policy.due(_at(20, Status.CHECKPOINTED), last_snapshot_seq=5)
    assert not policy.due(_at(12, Status.CHECKPOINTED), last_snapshot_seq=5)
    assert not policy.due(_at(50, Status.RUNNING), last_snapshot_seq=5)


def test_snapshot_policy_every_n_events() -> None:
    """every_events forces a snapshot at any status; nothing is due twice at one seq."""
    policy = SnapshotPolicy(on_checkpoint=False, every_events=100)
    assert policy.due(_at(105, Status.RUNNING), last_snapshot_seq=5)
    assert not policy.due(_at(104, Status.RUNNING), last_snapshot_seq=5)
    assert not SnapshotPolicy().due(_at(5, Status.CHECKPOINTED), last_snapshot_seq=5)


PINNED_SHAPE = {
    "AgentState": ("task_id", "agent", "status", "input", "budget", "parent_task_id",
                   "parent_seq", "messages", "step", "next_action", "calls", "pending", "usage",
                   "children_spend", "waiting_on", "attempts", "last_seq", "last_hash", "plan",
                   "plan_completed",
                   "env", "signal_ids", "approvals", "commands", "output", "failure",
                   "budget_exceeded", "agent_version", "patches", "handed_over",
                   "interruptions"),
    "CallRecord": ("call_id", "kind", "name", "args_hash", "seq", "status", "idempotency_key",
                   "idempotent", "attempt", "result", "error", "retry_seq", "outcome_seq",
                   "due_at_ms"),
    "CallError": ("error", "error_type", "retryable"),
    "Usage": ("input_tokens", "output_tokens", "cost_usd", "tool_calls", "llm_calls"),
    "ChildSpend": ("steps", "tokens", "cost_usd", "tool_calls"),
    "Wait": ("call_id", "timer_id", "wake_at_ms", "signal", "timeout_ms"),
    "Approval": ("tool", "args_hash", "signal_name", "requested_seq", "approved", "approver",
                 "comment", "decided_seq"),
    "Failure": ("reason", "error", "diagnostic", "cancelled", "requested_by", "seq"),
    "BudgetTrip": ("budget", "limit", "used", "seq"),
}


def test_state_shape_is_pinned_to_the_snapshot_format() -> None:
    """Changing AgentState's shape needs a new STATE_FORMAT (then update this pin with it)."""
    shape = {name: getattr(state_module, name).__struct_fields__ for name in PINNED_SHAPE}
    assert (STATE_FORMAT, shape) == (6, PINNED_SHAPE), (
        "AgentState changed: bump replay.snapshot.STATE_FORMAT so that old snapshots are "
        "ignored, then update PINNED_SHAPE and the format here"
    )


# ----------------------------------------------------------------------------- segments


def _long_history(count: int) -> list[ev.Event]:
    """``count`` messages and tool calls (the last one left pending)."""
    history: list[ev.Event] = [ev.TaskSubmitted(agent="a"), ev.TaskClaimed(worker_id="w")]
    for n in range(count):
        history += [ev.MessageAppended(role="user", content=f"m{n}"),
                    ev.ToolCallIntended(call_id=f"c{count - n}", tool="t", args_hash="h",
                                        idempotency_key=f"k{n}")]
        if n < count - 1:
            history.append(ev.ToolCallCompleted(call_id=f"c{count - n}", result={"n": n}))
    return history


def test_segmented_round_trip_keeps_state_and_call_order(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Segments plus tails assemble to the same state, calls in order; bytes deterministic."""
    monkeypatch.setattr(snapshot_module, "segment_items", 4)
    state = fold(list(enumerate(_long_history(11), 1)), task_id="t")
    encoded = encode_snapshot(state)
    assert [(ref.field, ref.ordinal) for ref in encoded.refs] == [
        ("messages", 0), ("messages", 1), ("calls", 0), ("calls", 1)]
    assert len(encoded.new) == 4
    decoded = decode_snapshot(encoded.head, reversed(encoded.new))
    assert decoded == state and list(decoded.calls) == list(state.calls)
    again = encode_snapshot(fold(list(enumerate(_long_history(11), 1)), task_id="t"))
    assert again == encoded


def test_writer_memory_skips_stored_segments_and_sees_changes(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Stored, unchanged segments are neither re-encoded nor re-sent; a changed one is."""
    monkeypatch.setattr(snapshot_module, "segment_items", 4)
    history = _long_history(8)  # Call c1 (8th call, calls segment 1) stays pending.
    state = fold(list(enumerate(history, 1)), task_id="t")
    segments = SnapshotSegments()
    first = segments.encode(state)
    segments.stored_as(first)
    assert segments.encode(state).new == []
    completed = apply(state, ev.ToolCallCompleted(call_id="c1", result=1), seq=len(history) + 1)
    second = segments.encode(completed)
    assert [(s.field, s.ordinal) for s in second.new] == [("calls", 1)]
    assert second.new[0].digest != first.refs[3].digest
    assert second.refs[:3] == first.refs[:3]


def test_resume_memory_learns_decoded_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer seeded by decoding a snapshot sends nothing for the same state."""
    monkeypatch.setattr(snapshot_module, "segment_items", 4)
    state = fold(list(enumerate(_long_history(9), 1)), task_id="t")
    encoded = encode_snapshot(state)
    known = SnapshotSegments()
    decoded = decode_snapshot(encoded.head, encoded.new, known=known)
    assert known.encode(decoded) == msgspec.structs.replace(encoded, new=[])


def test_missing_altered_or_misplaced_segments_are_corrupt(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """A segment missing, not matching its digest, not zstd, or short raises SnapshotCorrupt."""
    monkeypatch.setattr(snapshot_module, "segment_items", 4)
    encoded = encode_snapshot(fold(list(enumerate(_long_history(9), 1)), task_id="t"))
    with pytest.raises(SnapshotCorrupt, match="missing"):
        decode_snapshot(encoded.head, encoded.new[1:], task_id="t", seq=3)
    altered = msgspec.structs.replace(encoded.new[0], data=encoded.new[0].data + b"\x00")
    with pytest.raises(SnapshotCorrupt, match="digest"):
        decode_snapshot(encoded.head, [altered, *encoded.new[1:]])
    moved = msgspec.structs.replace(encoded.new[0], ordinal=1)
    with pytest.raises(SnapshotCorrupt, match="out of place"):
        decode_snapshot(encoded.head, [moved, *encoded.new[1:]])

    def alone(data: bytes) -> tuple[bytes, list[snapshot_module.Segment]]:
        """A head referring to one segment of these bytes, and that segment (digest right)."""
        segment = snapshot_module.Segment(field="messages", ordinal=0, data=data,
                                          digest=segment_digest("messages", 0, data))
        head = snapshot_module._encoder.encode(snapshot_module._SnapshotHead(
            AgentState(task_id="t"), [SegmentRef("messages", 0, segment.digest)]))
        return head, [segment]

    with pytest.raises(SnapshotCorrupt, match="holds 0 items"):
        decode_snapshot(*alone(snapshot_module._encode_segment(None, [])))
    with pytest.raises(SnapshotCorrupt, match="does not decompress"):
        decode_snapshot(*alone(snapshot_module._encoder.encode([])))  # msgpack, not zstd
    with pytest.raises(SnapshotCorrupt):
        decode_snapshot(b"\xc1", [])
