"""The suite's report: the interleaved table, a summary per contender, and the targets.

Every figure here comes from the run itself; a figure a run could not measure (a peer not
installed, a history not written step by step) is printed as ``-`` and stored as null.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from importlib import metadata
from typing import TYPE_CHECKING, Any, Final

from benchmarks import harness

if TYPE_CHECKING:
    from benchmarks.suite import Run

STEP_RATIO_TARGET: Final = 1.10
STEP_P99_RATIO_TARGET: Final = 1.5
P99_SAMPLES_MIN: Final = 2_000
"""A p99 from fewer samples (the third-worst of 250) is not judged against a target."""
CONCURRENT_PEER_FACTOR: Final = 2.0
CONCURRENT_RAW_FACTOR: Final = 2.5
"""64 tasks: wal-engine's steps/s at least this multiple of raw one-row-per-commit."""
RESUME_FLOOR_RATIO_TARGET: Final = 0.6
"""Resume of the largest history (100,000 steps in a full run) against the floor."""
RESUME_P99_SIZE: Final = 10_000
RESUME_LANGGRAPH_FACTOR: Final = 2.0
RESUME_DBOS_FACTOR: Final = 10.0
"""What "far ahead of DBOS's recovery" is taken to mean: ten times faster, at least."""
RESUME_P99_TARGET_MS: Final = 100.0
BYTES_GROWTH_MAX: Final = 1.25
"""Bytes per step count as constant when the largest history's (average, and over its last
tenth) stays within this factor of the smallest history's average."""

AGENT_ROW_PREFIXES: Final = ("pydantic-ai", "openai-agents")
"""Workloads of the agent rows (benchmarks.suite.AGENT_ROWS), which have no summary row."""

ROWS: Final = (
    ("raw", "raw asyncpg (reference)", "raw asyncpg: 2 INSERT commits",
     "floor: state row + decode"),
    ("wal", "wal-engine", "wal-engine tool step", "wal-engine resume"),
    ("langgraph", "LangGraph AsyncPostgresSaver", "LangGraph graph step",
     "LangGraph aget_tuple"),
    ("dbos", "DBOS Transact", "DBOS step", "DBOS recovery"),
)


def peer_versions(packages: dict[str, tuple[str, ...]]) -> dict[str, str | None]:
    """Installed versions of the peers' packages (None when absent)."""
    found: dict[str, str | None] = {}
    for names in packages.values():
        for name in names:
            try:
                found[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                found[name] = None
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """One target of the issue, what the run measured against it, and whether it holds."""

    name: str
    measured: str
    met: bool | None
    """None: the run could not measure it (a peer missing, a phase not run)."""


def _ms(value_us: float | None) -> str:
    if value_us is None:
        return "-"
    value = value_us / 1000
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


class Report:
    """Renders a finished :class:`~benchmarks.suite.Run`."""

    def __init__(self, run: Run, machine: dict[str, Any]) -> None:
        self.run = run
        self.machine = machine
        self.workloads = {result.name: result for result in run.results}

    # ------------------------------------------------------------------ lookups

    def _result(self, workload: str, contender_prefix: str) -> harness.ContenderResult | None:
        found = self.workloads.get(workload)
        if found is None:
            return None
        for result in found.contenders:
            if result.name.startswith(contender_prefix):
                return result
        return None

    def _build(self, key: str, steps: int) -> dict[str, Any] | None:
        return self.run.builds.get(key, {}).get(str(steps))

    def _resume(self, prefix: str, steps: int) -> harness.ContenderResult | None:
        return self._result(f"resume@{steps:,}", prefix)

    # ------------------------------------------------------------------ summary

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row of figures per contender (also the JSON ``summary``)."""
        rows = []
        small, large = self.run.sizes[0], self.run.sizes[-1]
        for key, label, step_name, resume_name in ROWS:
            if key in self.run.skipped:
                continue
            step = self._result("step", step_name)
            many = self._result("step64", step_name)
            row: dict[str, Any] = {
                "key": key, "contender": label,
                "step_p50_us": None if step is None else step.p50_us,
                "step_p99_us": None if step is None else step.p99_us,
                "steps_per_s": None if step is None else step.events_per_s,
                "steps_per_s_64": None if many is None else many.events_per_s,
                "live_peak_rss_mib": self.run.live.get(key, {}).get("peak_rss_mib"),
            }
            for size in (small, large):
                resumed = self._resume(resume_name, size)
                build = self._build(key, size) or {}
                row[f"resume_{size}"] = None if resumed is None else {
                    "p50_us": resumed.p50_us, "p99_us": resumed.p99_us}
                row[f"bytes_{size}"] = {"avg": build.get("bytes_per_step"),
                                        "last": build.get("bytes_per_step_last")}
                row[f"build_{size}"] = {"steps_per_s": build.get("steps_per_s"),
                                        "steps_per_s_last": build.get("steps_per_s_last"),
                                        "peak_rss_mib": build.get("peak_rss_mib")}
            rows.append(row)
        return rows

    def summary_table(self) -> str:
        """The per-contender summary as a Markdown table."""
        small, large = self.run.sizes[0], self.run.sizes[-1]
        s, b = f"{small:,}", f"{large:,}"
        lines = [
            "| contender | step p50 / p99 ms | steps/s, 1 task | steps/s, 64 tasks "
            f"| resume {s} p50 / p99 ms | resume {b} p50 / p99 ms "
            f"| bytes/step {s}: avg / last tenth | bytes/step {b}: avg / last tenth "
            f"| build steps/s {s} / {b} | peak RSS MiB: live / {s} / {b} |",
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
        ]
        for row in self.summary_rows():
            cells = [
                row["contender"],
                f"{_ms(row['step_p50_us'])} / {_ms(row['step_p99_us'])}",
                _number(row["steps_per_s"]), _number(row["steps_per_s_64"]),
            ]
            for size in (small, large):
                resumed = row[f"resume_{size}"]
                cells.append("-" if resumed is None else
                             f"{_ms(resumed['p50_us'])} / {_ms(resumed['p99_us'])}")
            for size in (small, large):
                sizes = row[f"bytes_{size}"]
                cells.append(f"{_number(sizes['avg'])} / {_number(sizes['last'])}")
            cells.append(" / ".join(_number(self._rate(row, size)) for size in (small, large)))
            cells.append(" / ".join(_number(value, 0) for value in (
                row["live_peak_rss_mib"],
                *(row[f"build_{size}"]["peak_rss_mib"] for size in (small, large)))))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    @staticmethod
    def _rate(row: dict[str, Any], size: int) -> float | None:
        build = row[f"build_{size}"]
        rate: float | None = build["steps_per_s"]
        return rate if rate is not None else build["steps_per_s_last"]

    # ------------------------------------------------------------------ targets

    def targets(self) -> list[Target]:
        """The issue's targets, measured in this run."""
        return [self._step_target(), self._step_p99_target(), self._concurrent_target(),
                *self._resume_targets(), self._bytes_target()]

    def _step_p99_target(self) -> Target:
        raw, wal = self._result("step", "raw"), self._result("step", "wal")
        name = (f"sequential tool step p99 within {STEP_P99_RATIO_TARGET}x of raw's p99 "
                f"(at least {P99_SAMPLES_MIN:,} samples each)")
        if raw is None or wal is None:
            return Target(name, "-", None)
        samples = min(raw.ops, wal.ops)
        ratio = wal.p99_us / raw.p99_us
        measured = (f"{ratio:.2f}x ({_ms(wal.p99_us)} ms vs {_ms(raw.p99_us)} ms; "
                    f"{samples:,} samples each)")
        return Target(name, measured,
                      ratio <= STEP_P99_RATIO_TARGET if samples >= P99_SAMPLES_MIN else None)

    def _step_target(self) -> Target:
        raw, wal = self._result("step", "raw"), self._result("step", "wal")
        if raw is None or wal is None:
            return Target("sequential tool step within 1.3x of two raw INSERT commits", "-", None)
        ratio = wal.p50_us / raw.p50_us
        return Target(
            f"sequential tool step p50 within {STEP_RATIO_TARGET}x of two raw INSERT commits",
            f"{ratio:.2f}x ({_ms(wal.p50_us)} ms vs {_ms(raw.p50_us)} ms)",
            ratio <= STEP_RATIO_TARGET)

    def _concurrent_target(self) -> Target:
        name = (f"64 tasks: wal-engine steps/s >= {CONCURRENT_PEER_FACTOR:.0f}x LangGraph's "
                f"and DBOS's, and >= {CONCURRENT_RAW_FACTOR}x raw one-row-per-commit")
        wal, raw = self._result("step64", "wal"), self._result("step64", "raw")
        if wal is None or raw is None:
            return Target(name, "-", None)
        parts = [f"wal-engine {wal.events_per_s:,.0f}/s, raw {raw.events_per_s:,.0f}/s "
                 f"({wal.events_per_s / raw.events_per_s:.2f}x)"]
        met: bool | None = wal.events_per_s >= CONCURRENT_RAW_FACTOR * raw.events_per_s
        for prefix, label in (("LangGraph", "LangGraph"), ("DBOS", "DBOS")):
            peer = self._result("step64", prefix)
            if peer is None:
                parts.append(f"{label} not run")
                met = None if met else met
                continue
            factor = wal.events_per_s / peer.events_per_s
            parts.append(f"{label} {peer.events_per_s:,.0f}/s ({factor:.1f}x)")
            met = met and factor >= CONCURRENT_PEER_FACTOR if met is not None else None
        return Target(name, "; ".join(parts), met)

    def _resume_targets(self) -> list[Target]:
        steps = self.run.sizes[-1]
        wal, floor = self._resume("wal", steps), self._resume("floor", steps)
        if wal is None or floor is None:
            return [Target(f"resume of {steps:,} steps", "-", None)]
        targets = [
            Target(f"resume {steps:,} steps: p50 within {RESUME_FLOOR_RATIO_TARGET}x of the "
                   "floor", f"{wal.p50_us / floor.p50_us:.2f}x ({_ms(wal.p50_us)} ms vs "
                   f"{_ms(floor.p50_us)} ms)", wal.p50_us / floor.p50_us
                   <= RESUME_FLOOR_RATIO_TARGET),
        ]
        moderate = self._resume("wal", RESUME_P99_SIZE)
        if moderate is not None:
            targets.append(Target(
                f"resume {RESUME_P99_SIZE:,} steps: p99 under {RESUME_P99_TARGET_MS:.0f} ms",
                f"{_ms(moderate.p99_us)} ms", moderate.p99_us / 1000 < RESUME_P99_TARGET_MS))
        for prefix, factor in (("LangGraph", RESUME_LANGGRAPH_FACTOR),
                               ("DBOS", RESUME_DBOS_FACTOR)):
            # The largest history the peer resumed (LangGraph and DBOS skip 100,000 steps).
            size = next((size for size in reversed(self.run.sizes)
                         if self._resume(prefix, size) is not None), steps)
            peer, ours = self._resume(prefix, size), self._resume("wal", size)
            name = f"resume {size:,} steps: >= {factor:.0f}x faster than {prefix}"
            if peer is None or ours is None:
                targets.append(Target(name, "not run", None))
                continue
            measured = peer.p50_us / ours.p50_us
            targets.append(Target(name, f"{measured:.1f}x ({_ms(peer.p50_us)} ms)",
                                  measured >= factor))
        return targets

    def _bytes_target(self) -> Target:
        small, large = self.run.sizes[0], self.run.sizes[-1]
        first, last = self._build("wal", small), self._build("wal", large)
        name = f"bytes per step constant from {small:,} to {large:,} steps"
        if first is None or last is None:
            return Target(name, "-", None)
        base = first["bytes_per_step"]
        growth = max(last["bytes_per_step"], last["bytes_per_step_last"]) / base
        measured = (f"wal-engine {base:,.0f} -> {last['bytes_per_step']:,.0f} avg, "
                    f"{last['bytes_per_step_last']:,.0f} last tenth ({growth:.2f}x)")
        lg_small, lg_large = self._build("langgraph", small), self._build("langgraph", large)
        if lg_small and lg_large:
            before, after = lg_small["bytes_per_step_last"], lg_large["bytes_per_step_last"]
            measured += (f"; LangGraph last tenth {before:,.0f} -> {after:,.0f} "
                         f"({after / before:.0f}x)")
        return Target(name, measured, growth <= BYTES_GROWTH_MAX)

    # ------------------------------------------------------------------ output

    def markdown(self) -> str:
        """The whole report."""
        run = self.run
        mode = "quick" if run.settings.quick else "full"
        lines = [
            f"## benchmarks: the suite ({mode}, {run.settings.rounds} rounds; "
            f"{run.notes.get('suite_s', '?')} s)", "",
            harness.format_machine(self.machine),
            f"- peak RSS of the suite's own process (each contender runs in its own): "
            f"{self.machine_rss():.0f} MiB",
        ]
        lines += [f"- skipped {key}: {reason}" for key, reason in run.skipped.items()]
        lines += ["", *self._descriptions(), "", harness.format_table(run.results), ""]
        if self.peer_workloads_ran():
            lines += ["### Per contender", "", self.summary_table(), "", "### Targets", ""]
            for target in self.targets():
                mark = {True: "met", False: "MISSED", None: "not measured"}[target.met]
                lines.append(f"- **{mark}**: {target.name}: {target.measured}")
            lines.append("")
        lines += list(self._notes())
        return "\n".join(lines)

    def peer_workloads_ran(self) -> bool:
        """Whether a workload of the peers (step, step64, resume) ran: else no summary."""
        return any(not name.startswith(AGENT_ROW_PREFIXES) for name in self.workloads)

    def _descriptions(self) -> Iterable[str]:
        for workload in self.run.results:
            yield (f"- `{workload.name}`: {workload.description} ({workload.rounds} rounds x "
                   f"{workload.ops_per_round} ops per contender)")

    def _notes(self) -> Iterable[str]:
        notes = self.run.notes
        if "raw_row_bytes" in notes:
            yield (f"- Raw rows average {notes['raw_row_bytes']:.0f} bytes (pg_column_size), "
                   "sized like wal-engine's intent and result events.")
        if "group_commit" in notes:
            counts = notes["group_commit"]
            yield (f"- wal-engine group commit: {counts['appends']:,} appends in "
                   f"{counts['flushes']:,} flushes.")
        for size, size_bytes in notes.get("state_bytes", {}).items():
            yield f"- State at {int(size):,} steps: {size_bytes / 1e6:.1f} MB (msgpack)."
        for reason in notes.get("history_skips", []):
            yield f"- {reason}."
        yield (f"- p99 figures from fewer than {P99_SAMPLES_MIN:,} samples (`step64`, "
               "resume, agent rows: see each workload's rounds x ops) are indicative only.")
        for size, samples in self.run.recoveries.items():
            if samples:
                reexecution = statistics.median(s["reexecution_ns"] for s in samples) / 1e6
                launch = statistics.median(s["launch_ms"] for s in samples)
                yield (f"- DBOS recovery of {int(size):,} steps: re-execution alone p50 "
                       f"{reexecution:,.0f} ms (the rest is the internal queue's poll); "
                       f"DBOS.launch in the fresh process (untimed) p50 {launch:,.0f} ms.")
        for key, builds in self.run.builds.items():
            for size, figures in builds.items():
                if figures.get("bulk_prefix"):
                    yield (f"- {key} {int(size):,} steps: the first steps were written as one "
                           f"state update; bytes and steps/s are over the last "
                           f"{figures['window_steps']} real steps only.")
        for key, row in notes.get("agent_rows", {}).items():
            per_step = row.get("per_step_us", {})
            ratios = row.get("per_step_ratio", {})
            how = ("p50 of a run / steps per run" if key == "pydantic-ai" else
                   f"marginal, (p50 at {row.get('steps')} - p50 at 1) / {row.get('steps', 1) - 1}")
            figures = "; ".join(f"{name} {value / 1000:.2f} ms ({_number(ratios.get(name), 2)}x)"
                                for name, value in per_step.items())
            counted = row.get("dbos_steps_per_run")
            dbos = "" if counted is None else f" DBOS recorded {counted} steps per run."
            yield f"- `{key}` per step ({how}): {figures}.{dbos}"
        if not self.peer_workloads_ran():
            return
        yield ("- bytes/step: growth of the contender's tables (heap, indexes, TOAST) while "
               "its task was written, per step; 'last tenth' is over the last tenth of the "
               "steps. Build steps/s: the same writes, one task, one step at a time.")
        yield ("- Peak RSS (VmHWM): 'live' is the contender's process that ran `step` and "
               "`step64` (1 + 64 tasks); the sizes are the process that wrote that history.")

    def machine_rss(self) -> float:
        """Peak RSS of the suite's own process, in MiB."""
        from benchmarks.peers_workload import peak_rss_mib

        return peak_rss_mib()

    def extra(self) -> dict[str, Any]:
        """The JSON fields beyond the harness's: builds, recoveries, summary, targets."""
        return {
            "sizes": list(self.run.sizes),
            "skipped": self.run.skipped,
            "builds": self.run.builds,
            "dbos_recoveries": self.run.recoveries,
            "notes": self.run.notes,
            "summary": self.summary_rows(),
            "targets": [dataclasses.asdict(target) for target in self.targets()],
        }
