"""Replay: fold throughput, and resume latency against the floor of reading the state.

* **fold**: events per second of ``replay.fold`` on one core over a realistic mix (steps of
  a ~500-byte user message, an LLM call with a ~600-byte request and a ~500-byte answer, a
  tool call with a ~1 KB result, a ~500-byte assistant message and a checkpoint), both over
  decoded events and over stored rows (JSON decode included). Target: 300,000 events/s.
* **resume**: for tasks of 1,000, 10,000 and 100,000 events (``--quick``: the first two),
  each operation opens a fresh connection (not timed, reported apart), then times
  ``wal_engine.runtime.resume.read_state`` with the latest snapshot (at the last checkpoint, a few
  events before the head), and without it (the whole log folded). The reference is the
  **floor**: the same snapshot's state as one row holding the whole state (``encode_state``,
  kept in ``bench_replay_floor``), selected and msgpack-decoded on a fresh connection; resume
  can hardly beat reading the state it returns. Targets: resume within 1.5x of the floor at
  every size; p99 under 100 ms at 10,000 events.

The benchmark tasks are built once per database (agent ``bench``, ids ``bench-replay-<n>-<tag>``)
with batched ``Store.append_events`` of 500 events, completed, and reused by later runs.

Usage: ``python -m benchmarks.replay [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import asyncpg
import msgspec

from benchmarks import harness
from replay import decode_state, fold
from replay.snapshot import STATE_FORMAT, Segment, decode_snapshot, encode_state
from wal_engine import events as vocabulary
from wal_engine import limits
from wal_engine.chain import GENESIS_HASH, event_hash
from wal_engine.errors import UnknownTask
from wal_engine.runtime.resume import read_state, save_snapshot
from wal_engine.state_machine import Status
from wal_engine.store import Database, Store, TaskHead
from wal_engine.store.connection import session_settings

NAME: Final = "replay"
SIZES: Final = (1_000, 10_000, 100_000)
QUICK_SIZES: Final = (1_000, 10_000)
HISTORY_TAG: Final = f"h1f{STATE_FORMAT}"
"""Changes when the generated history or the snapshot format changes (new tasks are built)."""
APPEND_BATCH_EVENTS: Final = 500
FOLD_EVENTS: Final = 100_000
FOLD_REPEATS: Final = 5
FOLD_TARGET_EVENTS_PER_S: Final = 300_000
RESUME_RATIO_TARGET: Final = 1.5
P99_TARGET_MS_AT_10K: Final = 100.0
BENCH_WORKER: Final = "bench-replay"

FLOOR_TABLE: Final = "bench_replay_floor"
CREATE_FLOOR: Final = f"""
CREATE TABLE IF NOT EXISTS {FLOOR_TABLE} (task_id text PRIMARY KEY, state bytea NOT NULL)
"""
UPSERT_FLOOR: Final = (
    f"INSERT INTO {FLOOR_TABLE} (task_id, state) VALUES ($1, $2)"
    " ON CONFLICT (task_id) DO UPDATE SET state = excluded.state"
)
SELECT_SNAPSHOT: Final = f"SELECT state FROM {FLOOR_TABLE} WHERE task_id = $1"
SNAPSHOT_PARTS: Final = """
SELECT s.state AS head, g.field, g.ordinal, g.digest, g.data
  FROM wal_snapshots s
  LEFT JOIN wal_snapshot_segments g
         ON g.tenant = s.tenant AND g.task_id = s.task_id AND g.digest = ANY (s.segments)
 WHERE s.tenant = current_setting('wal.tenant', true) AND s.task_id = $1 AND s.seq = $2
"""
SNAPSHOT_BYTES: Final = """
SELECT pg_column_size(s.state)
       + coalesce((SELECT sum(pg_column_size(g.data)) FROM wal_snapshot_segments g
                    WHERE g.tenant = s.tenant AND g.task_id = s.task_id
                      AND g.digest = ANY (s.segments)), 0) AS stored
  FROM wal_snapshots s
 WHERE s.tenant = current_setting('wal.tenant', true) AND s.task_id = $1 AND s.seq = $2
"""

_words: Final = ("the", "tool", "returned", "forecast", "for", "Lisbon", "tomorrow", "with",
                 "rain", "and", "wind", "of", "km/h", "so", "plan", "an", "indoor", "visit",
                 "museum", "at", "ten", "because", "user", "asked", "about", "weather")


# ----------------------------------------------------------------------------- histories


class _Text:
    """Deterministic prose-like text of a given length."""

    def __init__(self, seed: int) -> None:
        self.random = random.Random(seed)

    def __call__(self, length: int) -> str:
        return " ".join(self.random.choices(_words, k=length // 4))[:length]


def step(n: int, text: _Text) -> list[vocabulary.Event]:
    """One agent step: 8 events, ~3.7 KB of payload."""
    request = {"messages": [{"role": "user", "content": text(560)}], "model": "large"}
    result = {"rows": [{"id": i, "text": text(80)} for i in range(10)]}
    return [
        vocabulary.MessageAppended(role="user", content=text(480)),
        vocabulary.LlmCallIntended(call_id=f"llm-{n}", model="large", request=request,
                                   request_hash=f"{n:064x}", idempotency_key=f"idem:l{n}"),
        vocabulary.LlmCallCompleted(call_id=f"llm-{n}", response={"content": text(480)},
                                    input_tokens=900, output_tokens=120, cost_usd=0.0042),
        vocabulary.ToolCallIntended(call_id=f"tool-{n}", tool="search", args={"q": text(40)},
                                    args_hash=f"{n:064x}", idempotency_key=f"idem:t{n}"),
        vocabulary.ToolCallCompleted(call_id=f"tool-{n}", result=result),
        vocabulary.MessageAppended(role="assistant", content=text(480)),
        vocabulary.StepCheckpointed(step=n, next_action={"step": n + 1}),
        vocabulary.StepStarted(step=n + 1),
    ]


def body(events: int) -> list[vocabulary.Event]:
    """The events after submission and claim (seq 3 on) of a task of ``events`` events,
    ending with task_completed a few events after the last checkpoint."""
    text = _Text(7)
    out: list[vocabulary.Event] = []
    n = 0
    while len(out) < events - 3:
        out += step(n, text)
        n += 1
    del out[events - 3:]
    if isinstance(out[-1], vocabulary.StepCheckpointed):
        out[-1] = vocabulary.MessageAppended(role="assistant", content=text(480))
    return [*out, vocabulary.TaskCompleted(output={"steps": n})]


def whole_history(events: int) -> list[vocabulary.Event]:
    """A full history of ``events`` events, seq 1 first."""
    return [vocabulary.TaskSubmitted(agent=harness.BENCH_AGENT),
            vocabulary.TaskClaimed(worker_id=BENCH_WORKER), *body(events)]


# ----------------------------------------------------------------------------- fold


class _Row(msgspec.Struct, frozen=True):
    seq: int
    type: str
    version: int
    payload: bytes
    hash: bytes


def fold_throughput() -> dict[str, Any]:
    """Events/s of fold over decoded events and over stored rows (best and median)."""
    events = whole_history(FOLD_EVENTS)
    decoded = list(enumerate(events, start=1))
    rows: list[_Row] = []
    previous = GENESIS_HASH
    for seq, event in decoded:
        kind, version, payload = vocabulary.encode_event(event)
        previous = event_hash(previous, "fold-bench", seq, kind, version, 1, payload)
        rows.append(_Row(seq, kind, version, payload, previous))
    figures: dict[str, Any] = {"events": len(events),
                               "payload_bytes_avg": sum(len(r.payload) for r in rows) / len(rows)}
    for label, items in (("decoded", decoded), ("rows", rows)):
        rates = []
        for _ in range(FOLD_REPEATS):
            start = time.perf_counter()
            fold(items, task_id="fold-bench")
            rates.append(len(items) / (time.perf_counter() - start))
        figures[label] = {"best": max(rates), "median": statistics.median(rates)}
    return figures


# ----------------------------------------------------------------------------- tasks


class BenchTask:
    """A built task: its id, head, snapshot seq and snapshot size."""

    def __init__(self, task_id: str, events: int, snapshot_seq: int, raw: int, stored: int):
        self.task_id, self.events, self.snapshot_seq = task_id, events, snapshot_seq
        self.snapshot_bytes, self.snapshot_stored_bytes = raw, stored


async def bench_task(store: Store, events: int) -> BenchTask:
    """Reuse this database's task of ``events`` events, or build it."""
    task_id = f"bench-replay-{events}-{HISTORY_TAG}"
    try:
        head: TaskHead | None = await store.read_head(task_id)
    except UnknownTask:
        head = None
    if head is not None and not (head.status is Status.COMPLETED and head.head_seq == events):
        task_id = f"{task_id}-{time.strftime('%m%d%H%M%S')}"  # A broken build: start anew.
        head = None
    if head is None:
        await build_task(store, task_id, events)
    row = await store.database.fetchrow(
        "SELECT max(seq) AS seq FROM wal_snapshots WHERE task_id = $1 AND state_format = $2",
        task_id, STATE_FORMAT)
    whole = await floor_row(store.database, task_id, row["seq"])
    sizes = await store.database.fetchrow(SNAPSHOT_BYTES, task_id, row["seq"])
    return BenchTask(task_id, events, row["seq"], len(whole), sizes["stored"])


async def floor_row(database: Database, task_id: str, seq: int) -> bytes:
    """Store the snapshot's whole state as one row (the floor's row); return its bytes."""
    parts = await database.fetch(SNAPSHOT_PARTS, task_id, seq)
    segments = [Segment(field=part["field"], ordinal=part["ordinal"], digest=part["digest"],
                        data=part["data"]) for part in parts if part["digest"] is not None]
    whole = encode_state(decode_snapshot(parts[0]["head"], segments, task_id=task_id, seq=seq))
    await database.fetch(CREATE_FLOOR)
    await database.fetch(UPSERT_FLOOR, task_id, whole)
    return whole


async def build_task(store: Store, task_id: str, events: int) -> None:
    """Append the history in batches; snapshot at the last checkpoint; complete the task."""
    started = time.monotonic()
    (head,) = await harness.create_claimed_tasks(store, [task_id], worker=BENCH_WORKER)
    rest = body(events)
    checkpoints = [i for i, e in enumerate(rest) if isinstance(e, vocabulary.StepCheckpointed)]
    split = checkpoints[-1] + 1
    await append_all(store, head, rest[:split])
    state = (await read_state(store, task_id, use_snapshot=False)).state
    await save_snapshot(store.database, state)
    await append_all(store, head, rest[split:])
    print(f"built {task_id}: {events} events in {time.monotonic() - started:.1f} s", flush=True)


async def append_all(store: Store, head: harness.LocalHead,
                     events: list[vocabulary.Event]) -> None:
    """Append ``events`` in batches of APPEND_BATCH_EVENTS, keeping ``head`` current."""
    for start in range(0, len(events), APPEND_BATCH_EVENTS):
        result = await store.append_events(
            head.task_id, events[start:start + APPEND_BATCH_EVENTS], epoch=head.epoch,
            expected_seq=head.seq, prev_hash=head.hash,
        )
        head.seq, head.hash = result.head_seq, result.head_hash


# ----------------------------------------------------------------------------- operations


class FreshConnections:
    """Operations that each run on a new connection (opened and closed outside the timing)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.connect_ms: list[float] = []

    async def _pool(self) -> asyncpg.Pool:
        start = time.perf_counter()
        pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=1, timeout=limits.connect_timeout_s,
            command_timeout=limits.command_timeout_s,
            server_settings=session_settings("default", "bench:replay"),
        )
        self.connect_ms.append((time.perf_counter() - start) * 1000)
        assert pool is not None
        return pool

    def resume(self, task: BenchTask, *, use_snapshot: bool) -> Callable[[], Awaitable[int]]:
        """Time read_state on a fresh connection."""

        async def operation() -> int:
            pool = await self._pool()
            try:
                store = Store(Database(pool, self.dsn))
                start = time.perf_counter_ns()
                resumed = await read_state(store, task.task_id, use_snapshot=use_snapshot)
                elapsed = time.perf_counter_ns() - start
            finally:
                await pool.close()
            assert resumed.state.last_seq == task.events
            return elapsed

        return operation

    def floor(self, task: BenchTask) -> Callable[[], Awaitable[int]]:
        """Time selecting the whole-state row and decoding it, on a fresh connection."""

        async def operation() -> int:
            pool = await self._pool()
            try:
                start = time.perf_counter_ns()
                async with pool.acquire() as connection:
                    state = await connection.fetchval(SELECT_SNAPSHOT, task.task_id)
                decoded = decode_state(state)
                elapsed = time.perf_counter_ns() - start
            finally:
                await pool.close()
            assert decoded.last_seq == task.snapshot_seq
            return elapsed

        return operation


def resume_workload(fresh: FreshConnections, task: BenchTask, ops: int) -> harness.Workload:
    """Floor, resume from the snapshot, resume from the log, for one task."""
    return harness.Workload(
        name=f"{task.events:,} events",
        description=(f"task of {task.events:,} events, snapshot at seq {task.snapshot_seq} "
                     f"({task.snapshot_bytes / 1e6:.1f} MB, {task.events - task.snapshot_seq} "
                     f"events of tail)"),
        ops_per_round=ops,
        warmup_ops=1,
        contenders=[
            harness.Contender("floor: snapshot row + decode", fresh.floor(task),
                              events_per_op=task.events, reference=True),
            harness.Contender("resume: snapshot + tail", fresh.resume(task, use_snapshot=True),
                              events_per_op=task.events),
            harness.Contender("resume: whole log", fresh.resume(task, use_snapshot=False),
                              events_per_op=task.events),
        ],
    )


# ----------------------------------------------------------------------------- report


def summary(fold_figures: dict[str, Any], tasks: list[BenchTask],
            results: list[harness.WorkloadResult], fresh: FreshConnections) -> str:
    """The resume table and the verdicts against the targets."""
    decoded, rows = fold_figures["decoded"], fold_figures["rows"]
    lines = [
        f"Fold ({fold_figures['events']:,} events, avg payload "
        f"{fold_figures['payload_bytes_avg']:.0f} B): decoded events {decoded['best']:,.0f}/s "
        f"(median {decoded['median']:,.0f}); stored rows incl. JSON decode "
        f"{rows['best']:,.0f}/s (median {rows['median']:,.0f}). "
        f"Target >= {FOLD_TARGET_EVENTS_PER_S:,}/s.",
        "",
        "| events | snapshot MB (stored) | floor p50/p99 ms | resume snapshot p50/p99 ms "
        "| ratio p50/p99 | resume whole log p50/p99 ms |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for task, result in zip(tasks, results, strict=True):
        floor, snap, whole = (result.contender(name) for name in (
            "floor: snapshot row + decode", "resume: snapshot + tail", "resume: whole log"))
        lines.append(
            f"| {task.events:,} | {task.snapshot_bytes / 1e6:.2f}"
            f" ({task.snapshot_stored_bytes / 1e6:.2f})"
            f" | {floor.p50_us / 1000:.1f} / {floor.p99_us / 1000:.1f}"
            f" | {snap.p50_us / 1000:.1f} / {snap.p99_us / 1000:.1f}"
            f" | {snap.p50_us / floor.p50_us:.2f}x / {snap.p99_us / floor.p99_us:.2f}x"
            f" | {whole.p50_us / 1000:.1f} / {whole.p99_us / 1000:.1f} |"
        )
    lines += ["", f"Fresh connection (not timed above): p50 "
                  f"{statistics.median(fresh.connect_ms):.1f} ms over {len(fresh.connect_ms)}.",
              f"Targets: resume/floor <= {RESUME_RATIO_TARGET}x at every size; p99 < "
              f"{P99_TARGET_MS_AT_10K:.0f} ms at 10,000 events."]
    return "\n".join(lines)


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=10, ops=4)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=2)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    database = await Database.open(dsn, max_size=4, application_name="bench:replay-build")
    store = Store(database)
    try:
        machine = await harness.describe_machine(dsn)
        fold_figures = fold_throughput()
        tasks = [await bench_task(store, size) for size in (QUICK_SIZES if args.quick else SIZES)]
    finally:
        await database.close()
    fresh = FreshConnections(dsn)
    results = []
    for task in tasks:
        # The 100,000-event whole-log resume takes about a second: one op per round there.
        ops = settings.ops if task.events <= 10_000 else 1
        workload = resume_workload(fresh, task, ops)
        results.append(await harness.run_workload(workload, rounds=settings.rounds))
    print(harness.format_report(NAME, machine, results, settings))
    print(summary(fold_figures, tasks, results, fresh))
    if not args.no_json:
        extra = {"fold": fold_figures, "connect_ms_p50": statistics.median(fresh.connect_ms)}
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path,
                                  extra=extra)
        print(f"Results written to {path}")
    return 0


if __name__ == "__main__":
    harness.run_main(main)
