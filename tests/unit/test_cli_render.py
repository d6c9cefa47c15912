"""The ``--json`` shapes of the CLI, pinned field by field (scripts read them).

The views are rendered from the records through ``msgspec.to_builtins``; these literals are
what the hand-written copies printed before, so a renamed, dropped or re-encoded field
fails here. The one addition: a head's ``agent_version``, which the hand copy had missed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson

from tests.unit import render_samples as s
from wal_engine.cli import render
from wal_engine.security.tenants import TenantCredentials, TenantRole

HEX32 = bytes(range(32)).hex()
T0 = "2024-05-06T07:08:09.123456+00:00"


def printed(view: dict[str, Any]) -> Any:
    """What ``emit`` writes, read back (so bytes and datetimes are as scripts see them)."""
    return orjson.loads(orjson.dumps(view, option=orjson.OPT_SORT_KEYS))


def test_head_json_is_every_field_of_the_head() -> None:
    assert printed(render.head_json(s.HEAD)) == {
        "task_id": "t-1", "agent": "a", "status": "WAITING", "head_seq": 7, "head_hash": HEX32,
        "lease_owner": "w-1", "lease_epoch": 3, "lease_expires_at": T0, "wake_at": None,
        "waiting_signal": "go", "budget": {"max_steps": 20, "max_cost_usd": 1.5},
        "parent_task_id": "p-1", "parent_seq": 4, "attempts": 2,
        "created_at": "2024-05-06T07:08:10+02:00", "started_at": None, "updated_at": T0,
        "agent_version": "v9"}
    assert set(render.head_json(s.HEAD)) == set(msgspec.structs.asdict(s.HEAD))


def test_event_json_keeps_its_keys_and_decodes_the_payload() -> None:
    assert printed(render.event_json(s.RECORD)) == {
        "task_id": "t-1", "seq": 2, "type": "task_claimed", "version": 1, "epoch": 3,
        "recorded_at": T0, "idempotency_key": None, "hash": "ff" * 32,
        "payload": {"worker_id": "w-1", "attempt": 1}}
    assert printed(render.event_json(s.BAD)) == {
        "task_id": "t-1", "seq": 3, "type": "x", "version": 1, "epoch": 0,
        "recorded_at": None, "idempotency_key": "k", "hash": "02",
        "payload": {"undecodable_payload_hex": "0102"}}


def test_state_json_is_the_folded_state_and_the_lease() -> None:
    assert printed(render.state_json(s.STATE, s.HEAD)) == {
        "task_id": "t-1", "agent": "a", "status": "RUNNING", "step": 0, "next_action": None,
        "last_seq": 6, "last_hash": "", "attempts": 1, "input": {"q": 1},
        "messages": [{"role": "user", "content": "hi", "name": None}], "calls": 2,
        "pending_calls": [{"call_id": "c1", "kind": "tool", "name": "t", "args_hash": "h",
                           "seq": 4, "idempotency_key": "k1"}],
        "usage": {"input_tokens": 3, "output_tokens": 4, "cost_usd": 0.25, "tool_calls": 1,
                  "llm_calls": 1},
        "budget": {"max_tokens": 100}, "budget_exceeded": None, "waiting_on": None,
        "approvals": {}, "plan": {}, "plan_completed": [], "env": {}, "output": None,
        "failure": None, "parent_task_id": None, "parent_seq": None, "lease_owner": "w-1",
        "lease_epoch": 3, "lease_expires_at": T0, "wake_at": None, "updated_at": T0}


def test_usage_json_has_every_field_even_at_zero() -> None:
    from replay import initial_state

    assert render.usage_json(initial_state("t")) == {
        "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0, "tool_calls": 0,
        "llm_calls": 0}


def test_verify_json_has_ok_and_the_violation() -> None:
    assert [printed(render.verify_json(r)) for r in s.REPORTS] == [
        {"task_id": "t-1", "ok": True, "events": 7, "head_seq": 7, "head_hash": "abababab",
         "violation": None},
        {"task_id": "t-2", "ok": False, "events": 3, "head_seq": 4, "head_hash": "01",
         "violation": {"seq": 4, "kind": "gap", "detail": "seq 4 missing"}}]


def test_anchor_views() -> None:
    assert printed(render.anchor_json(s.ANCHOR, "f")) == {
        "file": "f", "database": "db", "created_at": "2024-05-06T07:08:09+00:00",
        "mode": "heads", "tasks": 1, "root": "ab", "signed": True, "public_key": "pk"}
    assert printed(render.anchor_json(s.UNSIGNED, "g")) == {
        "file": "g", "database": "db", "created_at": "c", "mode": "root", "tasks": 0,
        "root": "", "signed": False, "public_key": None}
    assert printed(render.anchor_report_json(s.REPORT, s.ANCHOR, "f")) == {
        "anchor": "f", "ok": False, "anchored_tasks": 2, "archived_tasks": 0, "signed": True,
        "mode": "heads",
        "created_at": "2024-05-06T07:08:09+00:00", "root": "ab",
        "findings": [{"task_id": "t-1", "seq": 5, "kind": "truncated", "detail": "d"},
                     {"task_id": None, "seq": None, "kind": "root", "detail": "r"}]}


def test_tenant_views() -> None:
    role = TenantRole(tenant="acme", role="wal_t_acme", enabled=True, created_at=s.T0,
                      sessions=2)
    assert printed(render.record_json(role)) == {
        "tenant": "acme", "role": "wal_t_acme", "enabled": True, "can_login": True,
        "sessions": 2, "created_at": T0, "rotated_at": None}
    credentials = TenantCredentials(tenant="acme", role="r", password="p", dsn="postgres://")
    assert printed(render.record_json(credentials)) == {
        "tenant": "acme", "role": "r", "password": "p", "dsn": "postgres://"}
