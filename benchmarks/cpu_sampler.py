"""Who uses the cores during a benchmark: CPU per second by kind of process (issue 23).

``python -m benchmarks.cpu_sampler --postmaster PID --out FILE [--seconds N]`` writes one
JSON line per interval: the time, the machine's busy cores (``/proc/stat``), and the CPU
(cores) used by the PostgreSQL server whose postmaster is PID (it and its children), by
the scale benchmark's worker processes (``benchmarks.scale --worker``, and how many run),
by the benchmark's own process, and by everything else on the machine. Run beside
``python -m benchmarks.scale --admin-dsn ...`` on the same server to say what saturates
when 1, 2 and 4 worker processes share 2 cores with PostgreSQL (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, CPU seconds so far)."""
    out: dict[int, tuple[int, str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue
        out[int(entry.name)] = (int(stat[1]), command,
                                (int(stat[11]) + int(stat[12])) / TICKS)
    return out


def _machine_busy() -> tuple[float, float]:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / TICKS, sum(fields) / TICKS


def _kind(pid: int, parent: int, command: str, postmaster: int) -> str:
    if pid == postmaster or parent == postmaster:
        return "postgres"
    if "benchmarks.scale" in command and "--worker" in command:
        return "workers"
    if "benchmarks.scale" in command:
        return "benchmark"
    return "other"


def sample(postmaster: int, out: Path, seconds: float, interval: float) -> None:
    before = _processes()
    busy_before, total_before = _machine_busy()
    deadline = time.monotonic() + seconds
    with out.open("a", encoding="utf-8") as sink:
        while time.monotonic() < deadline:
            time.sleep(interval)
            now = _processes()
            busy, total = _machine_busy()
            used: dict[str, float] = {"postgres": 0.0, "workers": 0.0, "benchmark": 0.0,
                                      "other": 0.0}
            worker_processes = sum(1 for pid, (parent, command, _) in now.items()
                                   if _kind(pid, parent, command, postmaster) == "workers")
            for pid, (parent, command, cpu) in now.items():
                previous = before.get(pid)
                delta = cpu - (previous[2] if previous else 0.0)
                if previous is None and delta > interval * 2:
                    delta = 0.0  # A process older than the sampler seen for the first time.
                used[_kind(pid, parent, command, postmaster)] += max(0.0, delta)
            cores = os.cpu_count() or 1
            elapsed = (total - total_before) / cores
            sink.write(json.dumps({
                "t": round(time.time(), 1),
                "machine_busy_cores": round((busy - busy_before) / max(1e-9, elapsed), 2),
                "worker_processes": worker_processes,
                **{kind: round(value / max(1e-9, elapsed), 2) for kind, value in used.items()},
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }) + "\n")
            sink.flush()
            before, busy_before, total_before = now, busy, total


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_sampler",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postmaster", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    sample(args.postmaster, args.out, args.seconds, args.interval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
