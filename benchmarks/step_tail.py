"""What makes the sequential step's tail: every sample attributed to what overlapped it.

``python -m benchmarks.step_tail [--dsn DSN] [--steps N] [--block B] [--json PATH]`` runs
the suite's live contenders in this one process (:class:`benchmarks.peers_raw.RawPeer`, two
raw INSERT commits per step, and :class:`benchmarks.peers_wal.WalPeer`, a tool step through
the runtime with a checkpoint every 100 steps), ``N`` timed steps each, alternating in
blocks of ``B`` (A B, B A, ...). While they run it records the intervals of:

* ``gc0``/``gc1``/``gc2``: collections by generation (``gc.callbacks``);
* ``checkpoint``: wal-engine's ``TaskRun.maybe_snapshot`` (the policy, and before decision
  72 the snapshot written inline);
* ``snapshot_write``: ``wal_engine.runtime.resume.save_snapshot`` (inline or in the
  background).

The last two are timed by wrapping those two functions for the run (instrumentation of this
benchmark only). Each sample is attributed to every interval that overlapped it; the
report gives each contender's p50/p90/p99/p99.9, what overlapped its slowest 2 %, the
median of the samples each kind overlapped, and the collections' durations. Samples that
overlap nothing on both sides are the machine's (raw's slowest have no engine to blame).
No target is asserted; see docs/architecture.md, decision 72.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from benchmarks import harness, peers_raw, peers_wal
from wal_engine.runtime import resume as resume_module
from wal_engine.runtime import run as run_module

NAME: Final = "step_tail"
SLOWEST_FRACTION: Final = 0.02
WARMUP_STEPS: Final = 2

Interval = tuple[str, int, int]


class Recorder:
    """The intervals of collections, checkpoints and snapshot writes, while installed."""

    def __init__(self) -> None:
        self.marks: list[Interval] = []
        self._gc_started = 0
        self._undo: list[Callable[[], None]] = []

    def _collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter_ns()
        else:
            self.marks.append((f"gc{info['generation']}", self._gc_started,
                               time.perf_counter_ns()))

    def _timed(self, kind: str, function: Callable[..., Awaitable[Any]]
               ) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return await function(*args, **kwargs)
            finally:
                self.marks.append((kind, started, time.perf_counter_ns()))
        return wrapper

    def install(self) -> None:
        """Start recording (wraps the two functions, adds the gc callback)."""
        gc.callbacks.append(self._collection)
        self._undo.append(lambda: gc.callbacks.remove(self._collection))
        checkpoint = run_module.TaskRun.maybe_snapshot
        run_module.TaskRun.maybe_snapshot = self._timed(  # type: ignore[method-assign, assignment]
            "checkpoint", checkpoint)
        self._undo.append(lambda: setattr(run_module.TaskRun, "maybe_snapshot", checkpoint))
        save = resume_module.save_snapshot
        resume_module.save_snapshot = self._timed(  # type: ignore[assignment]
            "snapshot_write", save)
        self._undo.append(lambda: setattr(resume_module, "save_snapshot", save))

    def remove(self) -> None:
        """Stop recording; the functions are the engine's own again."""
        while self._undo:
            self._undo.pop()()

    def overlapping(self, start: int, end: int) -> list[str]:
        """The kinds of interval that overlapped ``[start, end]``."""
        return sorted({kind for kind, first, last in self.marks if first < end and last > start})


async def measure(dsn: str, steps: int, block: int) -> dict[str, Any]:
    """Run both contenders, alternating in blocks; attribute every sample."""
    peers: dict[str, Any] = {"raw": peers_raw.RawPeer(dsn), "wal": peers_wal.WalPeer(dsn)}
    for peer in peers.values():
        await peer.open()
    recorder = Recorder()
    samples: dict[str, list[tuple[int, int]]] = {key: [] for key in peers}
    recorder.install()
    try:
        for index in range(max(1, steps // block)):
            order = list(peers) if index % 2 == 0 else list(reversed(peers))
            for key in order:
                for _ in range(WARMUP_STEPS):
                    await peers[key].step_one()
                for _ in range(block):
                    started = time.perf_counter_ns()
                    await peers[key].step_one()
                    samples[key].append((started, time.perf_counter_ns()))
    finally:
        recorder.remove()
        for peer in peers.values():
            await peer.close()
    return {"contenders": {key: _figures(recorder, spans) for key, spans in samples.items()},
            "collections": _collections(recorder)}


def _figures(recorder: Recorder, spans: list[tuple[int, int]]) -> dict[str, Any]:
    latencies = sorted(end - start for start, end in spans)

    def at(q: float) -> float:
        return round(harness.percentile(latencies, q) / 1000, 1)

    threshold = latencies[int((1 - SLOWEST_FRACTION) * len(latencies))]
    slowest: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for start, end in spans:
        kinds = recorder.overlapping(start, end)
        if end - start >= threshold:
            slowest["+".join(kinds) or "none"] += 1
        for kind in kinds:
            by_kind[kind].append((end - start) / 1000)
    return {
        "samples": len(latencies), "p50_us": at(50), "p90_us": at(90), "p99_us": at(99),
        "p99_9_us": at(99.9), "max_us": round(latencies[-1] / 1000, 1),
        "slowest_2pct": dict(slowest.most_common()),
        "overlapped": {kind: {"samples": len(values),
                              "median_us": round(statistics.median(values), 1)}
                       for kind, values in sorted(by_kind.items())},
    }


def _collections(recorder: Recorder) -> dict[str, Any]:
    durations: dict[str, list[float]] = collections.defaultdict(list)
    for kind, start, end in recorder.marks:
        if kind.startswith("gc"):
            durations[kind].append((end - start) / 1000)
    return {kind: {"count": len(values), "median_us": round(statistics.median(values), 1),
                   "max_us": round(max(values), 1)} for kind, values in sorted(durations.items())}


def report(document: dict[str, Any]) -> str:
    """The figures as Markdown."""
    lines = [f"## benchmarks.step_tail: {document['steps']:,} steps per contender, blocks of "
             f"{document['block']}", "", harness.format_machine(document["machine"]), "",
             "| contender | samples | p50 µs | p90 µs | p99 µs | p99.9 µs | max µs "
             "| slowest 2 % overlapped |", "|---|--:|--:|--:|--:|--:|--:|---|"]
    for key, figures in document["contenders"].items():
        slowest = ", ".join(f"{kind} {count}" for kind, count
                            in figures["slowest_2pct"].items())
        lines.append(f"| {key} | {figures['samples']:,} | {figures['p50_us']:,} "
                     f"| {figures['p90_us']:,} | {figures['p99_us']:,} "
                     f"| {figures['p99_9_us']:,} | {figures['max_us']:,} | {slowest} |")
    lines.append("")
    for key, figures in document["contenders"].items():
        for kind, overlap in figures["overlapped"].items():
            lines.append(f"- {key}: {overlap['samples']} samples overlapped {kind}, median "
                         f"{overlap['median_us']:,} µs")
    for kind, figures in document["collections"].items():
        lines.append(f"- {kind}: {figures['count']} collections, median "
                     f"{figures['median_us']:,} µs, max {figures['max_us']:,} µs")
    return "\n".join(lines) + "\n"


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_tail", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", help="PostgreSQL DSN (default: database 'wal_bench' on "
                        "$WAL_ENGINE_DSN's server, else on the embedded server)")
    parser.add_argument("--steps", type=int, default=4000, help="timed steps per contender")
    parser.add_argument("--block", type=int, default=100, help="steps per block")
    parser.add_argument("--json", type=Path, dest="json_path")
    args = parser.parse_args(argv)
    dsn = await harness.resolve_bench_dsn(args.dsn)
    machine = await harness.describe_machine(dsn)
    document = {"benchmark": NAME, "machine": machine, "steps": args.steps,
                "block": args.block, **await measure(dsn, args.steps, args.block)}
    document["load_after"] = list(os.getloadavg())
    print(report(document))
    if args.json_path:
        args.json_path.write_text(json.dumps(document, indent=2, default=str) + "\n",
                                  encoding="utf-8")
        print(f"Results written to {args.json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
