"""Plain-JSON views of heads, events and states (the ``--json`` shapes), and short summaries.

The ``--json`` shapes are an interface for scripts: keys are only ever added, never renamed
or removed. Hashes are lowercase hex, times RFC 3339 in UTC, payloads the stored JSON.
Records are rendered through :func:`record_json` (``msgspec.to_builtins``), so a field
added to a record reaches its view without a hand-kept copy; ``tests/unit/test_cli_render.py``
pins every shape.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
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


def record_json(record: msgspec.Struct, *, omit: Collection[str] = ()) -> dict[str, Any]:
    """A record's fields as plain JSON (``msgspec.to_builtins``), without those in ``omit``.

    The record's own fields keep the CLI's encodings: bytes as lowercase hex (msgspec would
    write base64) and datetimes as ``isoformat`` text (msgspec would write ``Z`` for UTC).
    Nested values are left to ``emit``, which encodes them the same way.
    """
    plain = msgspec.to_builtins(record, builtin_types=_passed_through)
    return {name: _text(value) for name, value in plain.items() if name not in omit}


_passed_through: Final = (bytes, dt.datetime)


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value


def head_json(head: TaskHead) -> dict[str, Any]:
    """A task head as plain JSON (one line of ``tasks --json``): every field of the head."""
    return record_json(head)


def payload_of(record: EventRecord) -> Any:
    """The stored payload as JSON (it is stored as canonical JSON bytes)."""
    try:
        return orjson.loads(record.payload)
    except orjson.JSONDecodeError:
        return {"undecodable_payload_hex": record.payload.hex()}


def event_json(record: EventRecord) -> dict[str, Any]:
    """One stored event as plain JSON (one line of ``history --json``); the payload decoded."""
    return {**record_json(record, omit=_event_omitted), "payload": payload_of(record)}


_event_omitted: Final = frozenset({"payload", "chain_version", "row_payload", "payload_cut"})
"""``chain_version`` is not in the ``history --json`` shape (``verify`` reads it), nor are
the store's large-value bookkeeping (the row's own bytes with digests in place of large
values, and whether a read page was cut): ``payload`` is the whole value."""


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
    plain = record_json(state)
    lease = record_json(head)
    return {
        **{name: plain[name] for name in _state_shown},
        "messages": [{"role": m.role, "content": m.content, "name": m.name}
                     for m in state.messages],
        "calls": len(state.calls),
        "pending_calls": [record_json(call) for call in state.in_doubt],
        "usage": usage_json(state),
        **{name: lease[name] for name in _lease_shown},
    }


_state_shown: Final = (
    "task_id", "agent", "status", "step", "next_action", "last_seq", "last_hash", "attempts",
    "input", "budget", "budget_exceeded", "waiting_on", "approvals", "plan", "plan_completed",
    "env", "output", "failure", "parent_task_id", "parent_seq",
)
"""The state's own fields in ``show --json`` (messages, calls and usage are shaped below)."""

_lease_shown: Final = ("lease_owner", "lease_epoch", "lease_expires_at", "wake_at",
                       "updated_at")


def usage_json(state: AgentState) -> dict[str, Any]:
    """Token, cost and call usage with every field present (even those at zero)."""
    return msgspec.structs.asdict(state.usage)


def verify_json(report: VerifyReport) -> dict[str, Any]:
    """One line of ``verify --json``."""
    return {**record_json(report), "ok": report.ok}


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
        "archived_tasks": report.archived,
        "signed": report.signed,
        "mode": anchor.mode,
        "created_at": anchor.created_at,
        "root": anchor.root,
        "findings": [record_json(finding) for finding in report.findings],
    }
