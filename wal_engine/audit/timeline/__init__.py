"""A task's life as one self-contained HTML timeline (``wal-engine timeline TASK --html F``).

The page draws, on a time or seq axis: who held the lease (worker and epoch of each
stretch), the status, the steps, every tool and LLM call attempt with its duration (intent
to outcome), retries and in-doubt calls, durable waits (timers, signals, approvals),
orphaning and resumption, budget use over time against its limits (folded by the replay
fold, as the budget arithmetic counts it), and one mark per event;
a click on a mark (or a span, or a row of the event table) shows the event's payload.
The file holds its CSS, script and data inline and fetches nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

from wal_engine.audit.timeline.model import UsageFold, build_model
from wal_engine.audit.timeline.page import render_page
from wal_engine.errors import InvalidInput
from wal_engine.store import Store

timeline_events_max: Final = 50_000
"""Most events one page draws (a browser stays responsive); pick a window with from/to."""


async def read_timeline(store: Store, task_id: str, *, from_seq: int = 1,
                        to_seq: int | None = None) -> dict[str, Any]:
    """Read a task's head and events (a window of them) and build the timeline model.

    The budget lane's usage is cumulative from seq 1 (the events before the window are
    folded, not drawn), so it is comparable with the limits whatever the window.

    Raises:
        UnknownTask: no such task.
        InvalidInput: the window holds more than ``timeline_events_max`` events.
    """
    head = await store.read_head(task_id)
    last = head.head_seq if to_seq is None else min(to_seq, head.head_seq)
    count = max(0, last - max(1, from_seq) + 1)
    if count > timeline_events_max:
        raise InvalidInput(
            f"task {task_id!r} has {count} events from seq {from_seq} to {last}; a timeline "
            f"draws at most {timeline_events_max}: choose a window with --from and --to")
    usage = UsageFold(task_id=task_id)
    if from_seq > 1:  # Usage is cumulative: fold what comes before the window, undrawn.
        async for record in store.stream_events(task_id, to_seq=min(from_seq - 1, last)):
            if not usage.advance(record):
                break  # Pages hold no connection: leaving the stream early is safe.
    records = [record async for record in store.stream_events(task_id, from_seq=from_seq,
                                                               to_seq=last)]
    return build_model(head, records, usage)


async def write_timeline(store: Store, task_id: str, path: str | os.PathLike[str], *,
                         from_seq: int = 1, to_seq: int | None = None) -> int:
    """Write the timeline page of ``task_id`` to ``path``; return how many events it draws."""
    model = await read_timeline(store, task_id, from_seq=from_seq, to_seq=to_seq)
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(render_page(model), encoding="utf-8")
    partial.replace(target)  # Never leave a half-written page behind.
    return len(model["events"])


__all__ = ["UsageFold", "build_model", "read_timeline", "render_page", "timeline_events_max",
           "write_timeline"]
