"""Named bounds: every size, count and duration the engine limits, with units last."""

from __future__ import annotations

from typing import Final

task_id_length_max: Final = 128
"""Longest task id accepted (characters of ``[A-Za-z0-9_.:-]``)."""

tenant_length_max: Final = 64
"""Longest tenant id accepted (characters of ``[A-Za-z0-9_.:-]``)."""

name_length_max: Final = 200
"""Longest agent, tool, signal or event-type name."""

payload_bytes_max: Final = 64 * 1024 * 1024
"""Default cap on one event's encoded payload, large values included (64 MiB, the per-value
limit of docs/architecture.md decision 61); configurable per engine, at most
:data:`payload_bytes_ceiling`. The part stored in the ``wal_events`` row stays small: every
value over :data:`blob_threshold_bytes` goes to ``wal_blobs`` (:mod:`wal_engine.blobs`)."""

blob_threshold_bytes: Final = 64 * 1024
"""A user value of an event (a tool result, an LLM response, a message, a task's input...)
whose canonical encoding is longer than this is stored once per task in ``wal_blobs``,
content-addressed, and the event's row holds its digest (decision 61)."""

blob_chunk_bytes: Final = 1024 * 1024
"""Uncompressed bytes of a large value per ``wal_blobs`` row (one zstd frame each): what a
read or write holds of it at a time on the wire and in the database."""

row_compress_bytes_min: Final = 256
"""An event row this long or longer is stored as one zstd frame of its bytes when the frame
is shorter (decision 71): a tool step's intent and result rows shrink by 40-60%; the
events the database writes itself, and most status moves, stay shorter and plain."""


blob_bytes_per_task_max: Final = 4 * 1024 * 1024 * 1024
"""The database's cap on the stored (compressed) bytes of one task's large values (4 GiB;
the trigger ``wal_count_blob_bytes`` of ``schema.sql``)."""

blob_page_value_bytes_max: Final = 128 * 1024 * 1024
"""Most bytes of large values one page of a history read puts back (a page ends early at
the event that would pass it, but holds at least one event): a streamed read of a history
holds at most this much of its large values, plus one value, at a time."""

blob_read_page_chunks: Final = 8
"""Chunks fetched per round trip when large values are read back (at most 8 MiB of
compressed data in flight)."""

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

events_per_task_ceiling: Final = 10_000_000
"""The database's own cap on the events of one task (``wal_events_per_task_max()`` in
``schema.sql``), whatever an engine asks for: ``connect(events_per_task_max=...)`` may set
a lower one, checked by the writer."""

payload_bytes_ceiling: Final = 64 * 1024 * 1024
"""The largest ``payload_bytes_max`` an engine may set (64 MiB): the database's own cap on
one large value (a CHECK on ``wal_blobs.value_bytes``). The row part of an event is capped
by the database at :data:`row_payload_bytes_ceiling`."""

row_payload_bytes_ceiling: Final = 16 * 1024 * 1024
"""The database's cap on the bytes of one ``wal_events.payload`` (the CHECK
``wal_events_bounds``): the inline part of an event, its large values being in blobs."""

epoch_max: Final = 2**31 - 1
"""Most lease epochs a task may go through (each claim, orphaning or cancellation takes one);
a CHECK of ``schema.sql`` refuses an event beyond it."""

cancel_text_bytes_max: Final = 4096
"""Longest cancellation reason, and requester, in UTF-8 bytes (checked by the database too)."""

dedup_key_bytes_max: Final = 512
"""Longest signal dedup key in UTF-8 bytes (checked by the database too: a longer key would
overflow its unique index)."""

signal_payload_bytes_max: Final = 1024 * 1024
"""Largest signal payload (the database's cap, ``wal_send_signal``)."""

signals_per_task_max: Final = 1000
signal_bytes_per_task_max: Final = 16 * 1024 * 1024
"""The database's caps on the signals one task may hold: count and payload bytes."""

signals_per_tenant_max: Final = 1_000_000
signal_bytes_per_tenant_max: Final = 4 * 1024 * 1024 * 1024
"""The database's default caps on a tenant's signals (an administrator may set others in
``wal_tenants``)."""

llm_cost_usd_max: Final = 1_000_000
"""Largest cost one LLM call may report (USD); the database refuses more, and any
non-finite or negative amount."""

recorded_at_skew_max_s: Final = 86_400
"""How far ``recorded_at`` may go back from one event to the next before ``verify`` reports
it (writers' clocks differ a little; a backdated forgery by much more)."""

anchor_bytes_max: Final = 256 * 1024 * 1024
"""Largest anchor file read (``verify --anchor``): a bigger one is refused, not read."""

pool_size_min: Final = 1
pool_size_max: Final = 20
statement_timeout_ms: Final = 30_000
"""``statement_timeout`` of every engine session, sent at connection start."""
idle_in_transaction_timeout_ms: Final = 60_000
"""``idle_in_transaction_session_timeout`` of every engine session, sent at connection
start."""
connect_timeout_s: Final = 10.0
command_timeout_s: Final = 60.0
