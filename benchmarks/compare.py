"""Two revisions side by side: "nothing got slower", measured on a shared, noisy machine.

    python -m benchmarks.compare BEFORE AFTER [--pairs 3] [--rounds 10]

Each revision is checked out in a worktree of its own (``git worktree``, removed at the
end) and measured alternately, BEFORE AFTER AFTER BEFORE ..., on the same PostgreSQL (the
embedded server of one data directory, or ``--dsn``), so that a drift of the machine's load
falls on both sides alike:

* the suite (``python -m benchmarks --peers "" --only step,step64,resume``) in the
  revision's checkout: every run has its own raw-asyncpg reference, and the comparison is
  of the ratios to it, run by run;
* the client CPU per tool step (:mod:`benchmarks.cpu_step`, this checkout's, run against
  the revision's ``wal_engine``), also against its own raw reference.

The report gives every run and, per side, the median and the min-max of each ratio: two
sides are within noise when their medians differ by less than the spread of either.
``--report DIR`` only summarises the JSON files a previous run left in ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
WORKLOADS: Final = ("step", "step64", "resume@1,000", "resume@10,000")
DATA_DIR_ENV: Final = "WAL_ENGINE_DATA_DIR"


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def _order(pairs: int) -> list[tuple[str, int]]:
    """BEFORE AFTER, AFTER BEFORE, ...: each side runs first in half of the pairs."""
    runs = []
    for i in range(1, pairs + 1):
        sides = ("before", "after") if i % 2 else ("after", "before")
        runs += [(side, i) for side in sides]
    return runs


def _run(side: str, i: int, tree: Path, out: Path, args: argparse.Namespace,
         env: dict[str, str]) -> None:
    env = {**env, "PYTHONPATH": str(tree)}
    suite = [sys.executable, "-m", "benchmarks", "--peers", "", "--only",
             "step,step64,resume", "--rounds", str(args.rounds),
             "--json", str(out / f"{side}-{i}.json")]
    if args.dsn:
        suite += ["--dsn", args.dsn]
    print(f"{side}-{i}: suite", flush=True)
    with open(out / f"{side}-{i}.log", "w") as log:
        subprocess.run(suite, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    print(f"{side}-{i}: client CPU per step", flush=True)
    # This checkout's cpu_step.py (an older revision may not have it) with the revision's
    # packages: run_path, because running the file would put benchmarks/ first on sys.path,
    # where benchmarks/replay.py hides the replay package.
    cpu_args = ["--steps", str(args.cpu_steps), "--rounds", "1", "--json",
                *(["--dsn", args.dsn] if args.dsn else [])]
    script = str(ROOT / "benchmarks" / "cpu_step.py")
    cpu_command = [sys.executable, "-c",
                   f"import runpy, sys; sys.argv = {[script, *cpu_args]!r}; "
                   f"runpy.run_path({script!r}, run_name='__main__')"]
    cpu = subprocess.run(cpu_command, cwd=tree, env=env, capture_output=True, text=True,
                         check=True)
    (out / f"{side}-{i}.cpu.json").write_text(cpu.stdout.strip().splitlines()[-1])


def _load(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted(out.glob("*-*.json")):
        match = re.fullmatch(r"(before|after)-(\d+)(\.cpu)?\.json", path.name)
        if match is None:
            continue
        key = (match.group(1), int(match.group(2)))
        figures = runs.setdefault(key, {})
        data = json.loads(path.read_text())
        if match.group(3):
            figures["cpu"] = (data["wal_cpu_us"][0], data["raw_cpu_us"][0])
            continue
        figures["git"] = data.get("machine", {}).get("packages", {}).get("git")
        figures["load"] = data.get("machine", {}).get("load_average")
        for workload in data["workloads"]:
            ref = next(c for c in workload["contenders"] if c["reference"])
            wal = next(c for c in workload["contenders"] if c["name"].startswith("wal-engine"))
            figures[workload["name"]] = (wal["p50_us"], ref["p50_us"], wal["events_per_s"],
                                         ref["events_per_s"])
    return runs


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}, "
            f"n={len(values)})")


def report(out: Path, before: str, after: str) -> str:
    """The Markdown comparison of the runs in ``out``."""
    runs = _load(out)
    header = ["run", *(f"{w} p50 wal / ref µs" for w in WORKLOADS),
              "step64 events/s wal / ref", "client CPU/step wal / ref µs"]
    lines = [f"## benchmarks.compare: {before} (before) vs {after} (after)", "",
             "| " + " | ".join(header) + " |", "|---|" + "--:|" * (len(header) - 1)]
    ratios: dict[tuple[str, str], list[float]] = {}
    for key in sorted(runs, key=lambda k: (k[1], k[0] != "before")):
        figures = runs[key]
        cells = [f"{key[0]}-{key[1]}"]
        for name in WORKLOADS:
            if name not in figures:
                cells.append("-")
                continue
            wal, ref, _, _ = figures[name]
            ratios.setdefault((name, key[0]), []).append(wal / ref)
            cells.append(f"{wal:,.0f} / {ref:,.0f} = {wal / ref:.2f}x")
        if "step64" in figures:
            _, _, wal_tput, ref_tput = figures["step64"]
            ratios.setdefault(("step64 events/s", key[0]), []).append(wal_tput / ref_tput)
            cells.append(f"{wal_tput:,.0f} / {ref_tput:,.0f} = {wal_tput / ref_tput:.2f}x")
        else:
            cells.append("-")
        if "cpu" in figures:
            wal, ref = figures["cpu"]
            ratios.setdefault(("client CPU/step", key[0]), []).append(wal / ref)
            cells.append(f"{wal:,.0f} / {ref:,.0f} = {wal / ref:.2f}x")
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| ratio to the run's own reference | before: median (min-max) | "
              "after: median (min-max) |", "|---|--:|--:|"]
    for name in (*WORKLOADS, "step64 events/s", "client CPU/step"):
        sides = [ratios.get((name, side)) for side in ("before", "after")]
        if all(sides):
            lines.append(f"| {name} | {_spread(sides[0] or [])} | {_spread(sides[1] or [])} |")
    lines += ["", "Latency ratios: wal-engine's p50 over the reference's (lower is better); "
              "events/s: wal-engine's over the reference's (higher is better)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="the revision measured as before (any git revision)")
    parser.add_argument("after", help="the revision measured as after")
    parser.add_argument("--pairs", type=int, default=3, help="before/after pairs (3)")
    parser.add_argument("--rounds", type=int, default=10, help="suite rounds per run (10)")
    parser.add_argument("--cpu-steps", type=int, default=3000,
                        help="sequential steps of the client-CPU measure (3000)")
    parser.add_argument("--dsn", help="PostgreSQL server to use (default: one embedded)")
    parser.add_argument("--out", type=Path, help="where runs and the report go")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="only summarise the runs a previous comparison left in DIR")
    args = parser.parse_args()
    if args.report:
        print(report(args.report, args.before, args.after), end="")
        return 0
    revisions = {side: _git("rev-parse", "--short", rev)
                 for side, rev in (("before", args.before), ("after", args.after))}
    out = args.out or ROOT / "benchmarks" / "results" / (
        f"compare-{revisions['before']}-{revisions['after']}")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    scratch = Path(tempfile.mkdtemp(prefix="wal-compare-"))
    # One embedded server for both sides, of its own (as root under /var/tmp, so that its
    # unprivileged account can reach it), stopped at the end.
    own_server = not args.dsn and DATA_DIR_ENV not in env
    if own_server:
        env[DATA_DIR_ENV] = (str(scratch / "pgdata") if os.geteuid() else
                             f"/var/tmp/wal-engine/compare-{os.getpid()}/pgdata")
    trees: dict[str, Path] = {}
    try:
        for side, revision in revisions.items():
            trees[side] = scratch / side
            _git("worktree", "add", "--detach", str(trees[side]), revision)
        for side, i in _order(args.pairs):
            _run(side, i, trees[side], out, args, env)
    finally:
        if own_server:
            subprocess.run([sys.executable, "-m", "wal_engine.cli", "embedded", "stop"],
                           cwd=ROOT, env=env, check=False, capture_output=True)
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], check=False, capture_output=True)
    text = report(out, revisions["before"], revisions["after"])
    (out / "compare.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
