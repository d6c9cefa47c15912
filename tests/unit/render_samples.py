"""Records the CLI render tests pin: one of each kind, with awkward values."""

from __future__ import annotations

import datetime as dt

from replay import fold
from wal_engine import events as ev
from wal_engine.audit.anchor import (
    Anchor,
    AnchoredHead,
    AnchorFinding,
    AnchorReport,
    AnchorSignature,
)
from wal_engine.chain import VerifyReport, Violation
from wal_engine.state_machine import Status
from wal_engine.store import EventRecord, TaskHead

T0 = dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC)
T1 = dt.datetime(2024, 5, 6, 7, 8, 10, tzinfo=dt.timezone(dt.timedelta(hours=2)))
HEAD = TaskHead(task_id="t-1", agent="a", status=Status.WAITING, head_seq=7,
                head_hash=bytes(range(32)), lease_owner="w-1", lease_epoch=3,
                lease_expires_at=T0, wake_at=None, waiting_signal="go",
                budget={"max_steps": 20, "max_cost_usd": 1.5}, parent_task_id="p-1",
                parent_seq=4, attempts=2, created_at=T1, started_at=None, updated_at=T0,
                agent_version="v9")
RECORD = EventRecord(task_id="t-1", seq=2, type="task_claimed", version=1, epoch=3,
                     payload=b'{"worker_id":"w-1","attempt":1}', idempotency_key=None,
                     hash=b"\xff" * 32, recorded_at=T0, chain_version=2)
BAD = EventRecord(task_id="t-1", seq=3, type="x", version=1, epoch=0, payload=b"\x01\x02",
                  idempotency_key="k", hash=b"\x02")
HISTORY = [
    ev.TaskSubmitted(agent="a", input={"q": 1}, budget=ev.Budget(max_tokens=100)),
    ev.TaskClaimed(worker_id="w", attempt=1),
    ev.MessageAppended(role="user", content="hi"),
    ev.ToolCallIntended(call_id="c1", tool="t", args_hash="h", idempotency_key="k1"),
    ev.LlmCallIntended(call_id="c2", model="m", request_hash="r", idempotency_key="k2"),
    ev.LlmCallCompleted(call_id="c2", response={"x": 1}, input_tokens=3, output_tokens=4,
                        cost_usd=0.25),
]
STATE = fold(list(enumerate(HISTORY, start=1)), task_id="t-1")
REPORTS = [VerifyReport(task_id="t-1", events=7, head_seq=7, head_hash=b"\xab" * 4),
           VerifyReport(task_id="t-2", events=3, head_seq=4, head_hash=b"\x01",
                        violation=Violation(seq=4, kind="gap", detail="seq 4 missing"))]
ANCHOR = Anchor(created_at="2024-05-06T07:08:09+00:00", database="db", tasks=1, root="ab",
                heads=[AnchoredHead("t-1", 7, "cd")],
                signature=AnchorSignature(public_key="pk", value="sig"))
UNSIGNED = Anchor(created_at="c", database="db", mode="root", tasks=0, root="", heads=[])
REPORT = AnchorReport(anchored_tasks=2, signed=True, findings=[
    AnchorFinding(task_id="t-1", seq=5, kind="truncated", detail="d"),
    AnchorFinding(task_id=None, seq=None, kind="root", detail="r")], chains=REPORTS)
