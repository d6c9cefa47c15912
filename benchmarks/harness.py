"""The shared benchmark harness: DSN, machine header, interleaved rounds, statistics, output.

A benchmark script describes one or more :class:`Workload` objects, each a set of
:class:`Contender` objects doing the same logical work in different ways, exactly one of them
the raw-asyncpg ``reference``. :func:`run_workload` runs the contenders interleaved in rounds
(round r starts with contender r mod n: A B, B A, A B, ...), so machine noise and slow drift
(autovacuum, checkpoints, neighbours on a shared machine) hit all contenders alike, and the
start position does not favour anyone. Many short rounds beat a few long ones on a noisy
machine: a burst of noise spoils one round's median, not a contender's whole result.

Per contender the harness keeps every operation's latency (``time.perf_counter_ns``) and
reports the median and p99 over all rounds, the min and max of the per-round medians (the
spread a reader should trust the median to), operations and events per second, and the
ratio of its median latency and of its event throughput to the reference of the same run.

Benchmarks that append to the log share :func:`create_claimed_tasks` (submit and claim tasks
of agent ``bench``, refusing a database where that would take other agents' tasks),
:class:`LocalHead` (the head a worker keeps between appends) and :func:`complete_tasks`.

Typical use::

    parser = harness.argument_parser("append", __doc__, rounds=20, ops=50)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=4, quick_ops=10)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    machine = await harness.describe_machine(dsn)
    results = [await harness.run_workload(workload, rounds=settings.rounds)]
    print(harness.format_report("append", machine, results))
    harness.write_json("append", machine, results, settings)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, Final, TextIO

import asyncpg
import structlog

from wal_engine import events as vocabulary
from wal_engine.store import PendingAppend, Store
from wal_engine.store.connection import (
    DSN_ENV,
    ensure_database,
    redact_dsn,
    resolve_dsn,
    with_database,
)

BENCH_DATABASE: Final = "wal_bench"
"""The database benchmarks use on the embedded server or on ``WAL_ENGINE_DSN``'s server."""

RESULTS_DIR: Final = Path(__file__).resolve().parent / "results"

POSTGRES_SETTINGS: Final = (
    "server_version", "fsync", "synchronous_commit", "full_page_writes", "wal_sync_method",
    "wal_level", "commit_delay", "shared_buffers", "max_connections",
)
"""Server settings printed in the machine header: the ones that decide commit latency."""

PACKAGES: Final = ("asyncpg", "msgspec", "orjson", "wal-engine")

Operation = Callable[[], Awaitable[int | None]]
"""One timed operation. It may return its own duration in ns (to exclude untimed setup
inside it); ``None`` means the harness's wall-clock measurement around the call counts."""


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True, slots=True)
class Contender:
    """One way of doing a workload's operation.

    Attributes:
        name: Shown in the table, e.g. ``"wal-engine append_events"``.
        operation: One operation (see :data:`Operation`).
        events_per_op: Events (rows, steps) one operation writes or reads; events/s is
            ``ops/s * events_per_op``.
        reference: The raw-asyncpg floor the others are compared with (one per workload).
        before_round: Untimed hook awaited before each of this contender's rounds.
    """

    name: str
    operation: Operation
    events_per_op: int = 1
    reference: bool = False
    before_round: Callable[[int], Awaitable[None]] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """Contenders doing the same logical work, compared within one run.

    Attributes:
        name: Short id, e.g. ``"single"``; the table's first column.
        description: One sentence for the report.
        contenders: Exactly one of them has ``reference=True`` (or none: no ratios).
        ops_per_round: Timed operations per contender per round.
        warmup_ops: Untimed operations before each contender's round, so that its
            connection and caches are warm again after the other contenders ran.
    """

    name: str
    description: str
    contenders: Sequence[Contender]
    ops_per_round: int
    warmup_ops: int = 2


@dataclasses.dataclass(frozen=True, slots=True)
class ContenderResult:
    """The figures of one contender in one workload (latencies in microseconds)."""

    name: str
    reference: bool
    events_per_op: int
    ops: int
    p50_us: float
    p99_us: float
    mean_us: float
    round_p50_min_us: float
    round_p50_max_us: float
    ops_per_s: float
    events_per_s: float
    p50_ratio: float | None
    """Median latency divided by the reference's (1.25 = 25 % slower)."""
    throughput_ratio: float | None
    """Events per second divided by the reference's (2.0 = twice the events)."""
    round_p50s_us: list[float]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadResult:
    """The result of one workload: its contenders' figures, reference first."""

    name: str
    description: str
    rounds: int
    ops_per_round: int
    contenders: list[ContenderResult]

    def contender(self, name: str) -> ContenderResult:
        """The result of the contender called ``name``."""
        for result in self.contenders:
            if result.name == name:
                return result
        raise KeyError(name)


@dataclasses.dataclass(frozen=True, slots=True)
class RunSettings:
    """How long a run is: rounds per workload and timed operations per round."""

    rounds: int
    ops: int
    quick: bool

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, quick_rounds: int, quick_ops: int
    ) -> RunSettings:
        """Settings from :func:`argument_parser`'s arguments; ``--quick`` lowers defaults."""
        rounds = args.rounds or (quick_rounds if args.quick else args.default_rounds)
        ops = args.ops or (quick_ops if args.quick else args.default_ops)
        return cls(rounds=max(1, rounds), ops=max(1, ops), quick=bool(args.quick))


# ----------------------------------------------------------------------------- running


async def run_workload(
    workload: Workload, *, rounds: int, progress: TextIO | None = sys.stderr
) -> WorkloadResult:
    """Run the workload's contenders interleaved in ``rounds`` rounds; return their figures."""
    contenders = list(workload.contenders)
    if len({c.name for c in contenders}) != len(contenders):
        raise ValueError(f"contender names repeat in workload {workload.name!r}")
    if sum(c.reference for c in contenders) > 1:
        raise ValueError(f"workload {workload.name!r} has more than one reference")
    samples: dict[str, list[list[int]]] = {c.name: [] for c in contenders}
    started = time.monotonic()
    live = progress is not None and progress.isatty()
    for round_index in range(rounds):
        shift = round_index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            samples[contender.name].append(await _run_round(workload, contender, round_index))
        if live and progress is not None:
            progress.write(f"\r{workload.name}: round {round_index + 1}/{rounds}"
                           f" ({time.monotonic() - started:.1f} s)")
            progress.flush()
    if progress is not None:
        progress.write(f"\r{workload.name}: {rounds} rounds in "
                       f"{time.monotonic() - started:.1f} s\n")
    return summarize(workload, rounds, samples)


async def _run_round(workload: Workload, contender: Contender, round_index: int) -> list[int]:
    if contender.before_round is not None:
        await contender.before_round(round_index)
    for _ in range(workload.warmup_ops):
        await contender.operation()
    # Collect now so that garbage left by the previous contender is not charged to this one.
    gc.collect()
    latencies: list[int] = []
    operation = contender.operation
    for _ in range(workload.ops_per_round):
        start = time.perf_counter_ns()
        measured = await operation()
        elapsed = time.perf_counter_ns() - start
        latencies.append(elapsed if measured is None else measured)
    return latencies


def summarize(
    workload: Workload, rounds: int, samples: dict[str, list[list[int]]]
) -> WorkloadResult:
    """Turn per-round latencies (ns) into per-contender figures with reference ratios."""
    raw = {c.name: _figures(c, samples[c.name]) for c in workload.contenders}
    reference = next((raw[c.name] for c in workload.contenders if c.reference), None)
    results = [
        dataclasses.replace(
            figures,
            p50_ratio=None if reference is None else figures.p50_us / reference.p50_us,
            throughput_ratio=(
                None if reference is None else figures.events_per_s / reference.events_per_s
            ),
        )
        for figures in raw.values()
    ]
    results.sort(key=lambda result: not result.reference)
    return WorkloadResult(
        name=workload.name, description=workload.description, rounds=rounds,
        ops_per_round=workload.ops_per_round, contenders=results,
    )


def _figures(contender: Contender, rounds: list[list[int]]) -> ContenderResult:
    every = sorted(latency for round_ in rounds for latency in round_)
    round_medians = [statistics.median(round_) / 1000 for round_ in rounds if round_]
    total_s = sum(every) / 1e9
    ops_per_s = len(every) / total_s if total_s > 0 else math.inf
    return ContenderResult(
        name=contender.name,
        reference=contender.reference,
        events_per_op=contender.events_per_op,
        ops=len(every),
        p50_us=statistics.median(every) / 1000,
        p99_us=percentile(every, 99) / 1000,
        mean_us=statistics.fmean(every) / 1000,
        round_p50_min_us=min(round_medians),
        round_p50_max_us=max(round_medians),
        ops_per_s=ops_per_s,
        events_per_s=ops_per_s * contender.events_per_op,
        p50_ratio=None,
        throughput_ratio=None,
        round_p50s_us=[round(median, 1) for median in round_medians],
    )


def percentile(ordered: Sequence[int], q: float) -> float:
    """The nearest-rank ``q``-th percentile of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


# ----------------------------------------------------------------------------- connections


async def no_session_reset(connection: asyncpg.Connection) -> None:
    """The pool release the store uses (see ``store.connection``): raw references get the
    same, so that neither side pays asyncpg's RESET round trip and ratios stay fair."""
    if connection.is_in_transaction():
        await connection.execute("ROLLBACK")


async def resolve_bench_dsn(dsn: str | None = None, *, database: str = BENCH_DATABASE) -> str:
    """The DSN to benchmark against.

    ``dsn`` (``--dsn``) is used as given. Otherwise the server of ``WAL_ENGINE_DSN``, else the
    embedded server (started on demand with fsync on, in its default data directory), is
    used with the dedicated database ``database``, created if missing, so benchmark rows
    never land in an application's log.
    """
    if dsn:
        return dsn
    server_dsn = os.environ.get(DSN_ENV) or await resolve_dsn()
    await ensure_database(server_dsn, database)
    return with_database(server_dsn, database)


async def describe_machine(dsn: str) -> dict[str, Any]:
    """Cores, CPU, memory, versions, and the server settings that decide commit latency."""
    connection = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await connection.fetch(
            "SELECT name, current_setting(name) AS value FROM unnest($1::text[]) AS name",
            list(POSTGRES_SETTINGS),
            timeout=10,
        )
    finally:
        await connection.close()
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": {name: _version(name) for name in PACKAGES},
        "git": _git_revision(),
        "postgres": {row["name"]: row["value"] for row in rows},
        "dsn": redact_dsn(dsn),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[1]
    try:
        revision = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{revision}{'+dirty' if dirty else ''}"


# ----------------------------------------------------------------------------- tasks

BENCH_AGENT: Final = "bench"
"""Agent name of every task a benchmark creates; other agents' tasks are never claimed."""
LEASE_TTL_MS: Final = 3_600_000
CLAIM_ROUNDS_MAX: Final = 50
GROUP_COMMIT_TASKS_MAX: Final = 64

CLAIM_TASKS: Final = (
    "SELECT task_id, lease_epoch, head_seq, head_hash"
    " FROM wal_claim_tasks($1, $2, $3, ARRAY['bench'])"
)

class LocalHead:
    """A claimed task's head as a worker keeps it between appends (no read per append)."""

    __slots__ = ("epoch", "hash", "seq", "task_id")

    def __init__(self, task_id: str, epoch: int, seq: int, head_hash: bytes) -> None:
        self.task_id, self.epoch, self.seq, self.hash = task_id, epoch, seq, head_hash


async def create_claimed_tasks(
    store: Store, task_ids: Sequence[str], *, worker: str = "bench"
) -> list[LocalHead]:
    """Submit the tasks (agent ``bench``) and claim them: RUNNING at epoch 1, heads returned.

    The claim takes only tasks of agent ``bench``, never another application's tasks.
    """
    for task_id in task_ids:
        await store.create_task(task_id, BENCH_AGENT)
    wanted: set[str] = set(task_ids)
    found: dict[str, Any] = {}
    for _ in range(CLAIM_ROUNDS_MAX):
        rows = await store.database.fetch(CLAIM_TASKS, worker, 1000, LEASE_TTL_MS)
        found.update({row["task_id"]: row for row in rows if row["task_id"] in wanted})
        if wanted <= found.keys():
            break
    else:
        raise RuntimeError(f"could not claim {sorted(wanted - found.keys())}")
    return [
        LocalHead(t, found[t]["lease_epoch"], found[t]["head_seq"], found[t]["head_hash"])
        for t in task_ids
    ]


async def complete_tasks(store: Store, heads: Sequence[LocalHead]) -> None:
    """Record task_completed on each head (group commits), leaving no live benchmark task."""
    for start in range(0, len(heads), GROUP_COMMIT_TASKS_MAX):
        await store.append_many([
            PendingAppend(task_id=h.task_id, epoch=h.epoch, expected_seq=h.seq,
                          prev_hash=h.hash, events=[vocabulary.TaskCompleted()])
            for h in heads[start : start + GROUP_COMMIT_TASKS_MAX]
        ])


# ----------------------------------------------------------------------------- output


def format_machine(machine: dict[str, Any]) -> str:
    """The machine description as Markdown bullet lines."""
    pg = machine["postgres"]
    packages = ", ".join(f"{name} {version}" for name, version in machine["packages"].items())
    load = " ".join(str(value) for value in machine["load_average"])
    durability = ", ".join(
        f"{name}={pg.get(name)}"
        for name in ("fsync", "synchronous_commit", "full_page_writes", "wal_sync_method",
                     "commit_delay", "shared_buffers")
    )
    return "\n".join([
        f"- cpu: {machine['cores']} cores ({machine['cores_usable']} usable), "
        f"{machine['cpu_model']}; memory {machine['memory_gib']} GiB; load average {load}",
        f"- os: {machine['os']}; {machine['python']}; {packages}; git {machine['git']}",
        f"- postgresql {pg.get('server_version')} at {machine['dsn']}: {durability}",
    ])


def format_table(results: Sequence[WorkloadResult]) -> str:
    """One Markdown table for all workloads: latencies in µs, ratios to each reference."""
    lines = [
        "| workload | contender | p50 µs | p99 µs | round p50 min-max µs | ops/s | events/s"
        " | p50 vs raw | events/s vs raw |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for workload in results:
        for result in workload.contenders:
            lines.append(
                f"| {workload.name} | {result.name}{' (ref)' if result.reference else ''}"
                f" | {_us(result.p50_us)} | {_us(result.p99_us)}"
                f" | {_us(result.round_p50_min_us)}-{_us(result.round_p50_max_us)}"
                f" | {result.ops_per_s:,.0f} | {result.events_per_s:,.0f}"
                f" | {_ratio(result.p50_ratio)} | {_ratio(result.throughput_ratio)} |"
            )
    return "\n".join(lines)


def format_report(
    name: str, machine: dict[str, Any], results: Sequence[WorkloadResult],
    settings: RunSettings | None = None,
) -> str:
    """Machine header, workload descriptions and the table, as one Markdown block."""
    heading = f"## benchmarks.{name}"
    if settings is not None:
        heading += f" ({'quick, ' if settings.quick else ''}{settings.rounds} rounds)"
    described = [
        f"- `{workload.name}`: {workload.description} "
        f"({workload.rounds} rounds x {workload.ops_per_round} ops per contender)"
        for workload in results
    ]
    return "\n".join([
        heading, "", format_machine(machine), "", *described, "", format_table(results), "",
    ])


def _us(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def write_json(
    name: str,
    machine: dict[str, Any],
    results: Sequence[WorkloadResult],
    settings: RunSettings | None = None,
    *,
    path: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the run to ``benchmarks/results/<name>.json`` (atomically); return the path."""
    target = path or RESULTS_DIR / f"{name}.json"
    document = {
        "benchmark": name,
        "machine": machine,
        "settings": None if settings is None else dataclasses.asdict(settings),
        "workloads": [dataclasses.asdict(result) for result in results],
        **(extra or {}),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    temporary.replace(target)
    return target


# ----------------------------------------------------------------------------- command line


def argument_parser(
    name: str, description: str | None, *, rounds: int, ops: int,
    database: str = BENCH_DATABASE,
) -> argparse.ArgumentParser:
    """The options every benchmark takes: --dsn, --quick, --rounds, --ops, --json/--no-json."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dsn", help=f"PostgreSQL DSN used as given (default: database {database!r} "
        f"on ${DSN_ENV}'s server, else on the embedded server)",
    )
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {rounds})")
    parser.add_argument("--ops", type=int, help=f"timed operations per round (default {ops})")
    parser.add_argument(
        "--json", type=Path, dest="json_path",
        help=f"where to write the JSON results (default benchmarks/results/{name}.json)",
    )
    parser.add_argument("--no-json", action="store_true", help="do not write JSON results")
    parser.add_argument(
        "--only", type=lambda text: [name for name in text.split(",") if name],
        help="comma-separated workload names to run (default: all)",
    )
    parser.set_defaults(default_rounds=rounds, default_ops=ops)
    return parser


def selected(names: Sequence[str], args: argparse.Namespace) -> list[str]:
    """The workload names ``--only`` keeps (all when absent); unknown names are an error."""
    wanted = args.only or list(names)
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise SystemExit(
            f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(names)}"
        )
    return [name for name in names if name in wanted]


def run_main(main: Callable[[], Coroutine[Any, Any, int]]) -> None:
    """Run a benchmark's async main with library logs on stderr; exit with its code."""
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    sys.exit(asyncio.run(main()))
