"""Named bounds: every size, count and duration the engine limits, with units last."""

from __future__ import annotations

from typing import Final

task_id_length_max: Final = 128
"""Longest task id accepted (characters of ``[A-Za-z0-9_.:-]``)."""

tenant_length_max: Final = 64
"""Longest tenant id accepted (characters of ``[A-Za-z0-9_.:-]``)."""

name_length_max: Final = 200
"""Longest agent, tool, signal or event-type name."""

payload_bytes_max: Final = 1024 * 1024
"""Default cap on one event's encoded payload (1 MiB); configurable per engine."""

payload_depth_max: Final = 64
"""Deepest nesting of lists and objects accepted in a payload."""

batch_events_max: Final = 1000
"""Most events in one append statement."""

read_page_events: Final = 1000
"""Rows fetched per page when a history is streamed."""

history_events_max: Final = 10_000_000
"""Default cap on the events of one task; an append past it is refused. Configurable per
engine, hence per tenant (``connect(events_per_task_max=...)``)."""

tasks_max: Final = None
"""Default cap on the tasks of one tenant: none (``connect(tasks_max=...)`` sets one; an
administrator may set one in ``wal_tenants.tasks_max``)."""

pool_size_min: Final = 1
pool_size_max: Final = 20
statement_timeout_ms: Final = 30_000
"""``statement_timeout`` of every engine session, sent at connection start."""
idle_in_transaction_timeout_ms: Final = 60_000
"""``idle_in_transaction_session_timeout`` of every engine session, sent at connection
start."""
connect_timeout_s: Final = 10.0
command_timeout_s: Final = 60.0
