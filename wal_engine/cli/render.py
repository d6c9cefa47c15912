"""Plain-JSON views of heads, events and states (the ``--json`` shapes), and short summaries.

The ``--json`` shapes are an interface for scripts: keys are only ever added, never renamed
or removed. Hashes are lowercase hex, times RFC 3339 in UTC, payloads the stored JSON.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Final

import msgspec
import orjson

from replay.state import AgentState
from wal_engine.audit.anchor import Anchor, AnchorReport
from wal_engine.chain import VerifyReport
from wal_engine.store import EventRecord, TaskHead

summary_chars_max: Final = 90


def iso(value: dt.datetime | None) -> str | None:
    """RFC 3339 text of a timestamp, or None."""
    return None if value is None else value.isoformat()


def head_json(head: TaskHead) -> dict[str, Any]:
    """A task head as plain JSON (one line of ``tasks --json``)."""
    return {
        "task_id": head.task_id,
        "agent": head.agent,
        "status": str(head.status),
        "head_seq": head.head_seq,
        "head_hash": head.head_hash.hex(),
        "lease_owner": head.lease_owner,
        "lease_epoch": head.lease_epoch,
        "lease_expires_at": iso(head.lease_expires_at),
        "wake_at": iso(head.wake_at),
        "waiting_signal": head.waiting_signal,
        "budget": head.budget,
        "parent_task_id": head.parent_task_id,
        "parent_seq": head.parent_seq,
        "attempts": head.attempts,
        "created_at": iso(head.created_at),
        "started_at": iso(head.started_at),
        "updated_at": iso(head.updated_at),
    }


def payload_of(record: EventRecord) -> Any:
    """The stored payload as JSON (it is stored as canonical JSON bytes)."""
    try:
        return orjson.loads(record.payload)
    except orjson.JSONDecodeError:
        return {"undecodable_payload_hex": record.payload.hex()}


def event_json(record: EventRecord) -> dict[str, Any]:
    """One stored event as plain JSON (one line of ``history --json``)."""
    return {
        "task_id": record.task_id,
        "seq": record.seq,
        "type": record.type,
        "version": record.version,
        "epoch": record.epoch,
        "recorded_at": iso(record.recorded_at),
        "idempotency_key": record.idempotency_key,
        "prev_hash": record.prev_hash.hex(),
        "hash": record.hash.hex(),
        "payload": payload_of(record),
    }


def summary(record: EventRecord) -> str:
    """A short human line of what an event says."""
    payload = payload_of(record)
    if not isinstance(payload, dict):
        return _clip(orjson.dumps(payload).decode())
    keys = _SUMMARY_KEYS.get(record.type)
    if keys is not None:
        shown = {key: payload[key] for key in keys if payload.get(key) is not None}
    else:
        shown = {key: value for key, value in payload.items()
                 if not isinstance(value, dict | list)}
    return _clip(" ".join(f"{key}={_short(value)}" for key, value in shown.items()))


_SUMMARY_KEYS: Final = {
    "task_submitted": ("agent", "parent_task_id", "parent_seq"),
    "tool_call_intended": ("call_id", "tool", "attempt", "idempotency_key"),
    "tool_call_completed": ("call_id", "result"),
    "tool_call_failed": ("call_id", "attempt", "error_type", "error", "retryable"),
    "llm_call_intended": ("call_id", "model", "attempt"),
    "llm_call_completed": ("call_id", "input_tokens", "output_tokens", "cost_usd"),
    "llm_call_failed": ("call_id", "attempt", "error_type", "error", "retryable"),
    "message_appended": ("role", "content"),
    "step_checkpointed": ("step", "next_action"),
    "task_completed": ("output",),
    "task_failed": ("reason", "error"),
}


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def _clip(text: str) -> str:
    return text if len(text) <= summary_chars_max else text[:summary_chars_max - 3] + "..."


def state_json(state: AgentState, head: TaskHead) -> dict[str, Any]:
    """The folded state of ``show --json``: what the task knows and where it stands."""
    plain = msgspec.to_builtins(state)
    return {
        "task_id": state.task_id,
        "agent": state.agent,
        "status": str(state.status),
        "step": state.step,
        "next_action": state.next_action,
        "last_seq": state.last_seq,
        "last_hash": state.last_hash.hex(),
        "attempts": state.attempts,
        "input": state.input,
        "messages": [{"role": m.role, "content": m.content, "name": m.name}
                     for m in state.messages],
        "calls": len(state.calls),
        "pending_calls": [msgspec.to_builtins(call) for call in state.in_doubt],
        "usage": usage_json(state),
        "budget": msgspec.to_builtins(state.budget),
        "budget_exceeded": plain.get("budget_exceeded"),
        "waiting_on": plain.get("waiting_on"),
        "approvals": plain.get("approvals", {}),
        "plan": plain.get("plan", {}),
        "plan_completed": list(state.plan_completed),
        "env": dict(state.env),
        "output": state.output,
        "failure": plain.get("failure"),
        "parent_task_id": state.parent_task_id,
        "parent_seq": state.parent_seq,
        "lease_owner": head.lease_owner,
        "lease_epoch": head.lease_epoch,
        "lease_expires_at": iso(head.lease_expires_at),
        "wake_at": iso(head.wake_at),
        "updated_at": iso(head.updated_at),
    }


def usage_json(state: AgentState) -> dict[str, Any]:
    """Token, cost and call usage with every field present."""
    usage = state.usage
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "cost_usd": usage.cost_usd, "tool_calls": usage.tool_calls,
            "llm_calls": usage.llm_calls}


def verify_json(report: VerifyReport) -> dict[str, Any]:
    """One line of ``verify --json``."""
    violation = report.violation
    return {
        "task_id": report.task_id,
        "ok": report.ok,
        "events": report.events,
        "head_seq": report.head_seq,
        "head_hash": report.head_hash.hex(),
        "violation": None if violation is None else {
            "seq": violation.seq, "kind": violation.kind, "detail": violation.detail},
    }


def anchor_json(anchor: Anchor, path: str) -> dict[str, Any]:
    """What ``anchor --json`` says about the anchor it wrote (not its heads)."""
    signature = anchor.signature
    return {
        "file": path,
        "database": anchor.database,
        "created_at": anchor.created_at,
        "mode": anchor.mode,
        "tasks": anchor.tasks,
        "root": anchor.root,
        "signed": signature is not None,
        "public_key": None if signature is None else signature.public_key,
    }


def anchor_report_json(report: AnchorReport, anchor: Anchor, path: str) -> dict[str, Any]:
    """The line of ``verify --anchor --json`` about the anchor (chain lines are separate)."""
    return {
        "anchor": path,
        "ok": report.ok,
        "anchored_tasks": report.anchored_tasks,
        "signed": report.signed,
        "mode": anchor.mode,
        "created_at": anchor.created_at,
        "root": anchor.root,
        "findings": [{"task_id": finding.task_id, "seq": finding.seq, "kind": finding.kind,
                      "detail": finding.detail} for finding in report.findings],
    }
