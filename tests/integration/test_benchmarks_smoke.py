"""The append benchmark runs end to end, so the suite cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_module

RUN_TIMEOUT_S = 120.0


async def test_append_benchmark_quick_run_prints_both_contenders(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks.append --quick` exits 0 and reports wal-engine beside raw asyncpg."""
    results = tmp_path / "append.json"
    output = await run_module("benchmarks.append", "--quick", "--dsn", database_dsn,
                              "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    assert "| workload | contender |" in output
    table = [line for line in output.splitlines() if line.startswith("| single |")]
    assert any("raw INSERT 1 row (ref)" in line for line in table), output
    assert any("wal-engine append_events" in line for line in table), output
    document = json.loads(results.read_text())
    single = next(w for w in document["workloads"] if w["name"] == "single")
    names = {contender["name"] for contender in single["contenders"]}
    assert names == {"raw INSERT 1 row", "wal-engine append_events"}
    assert document["machine"]["postgres"]["fsync"] in {"on", "off"}


async def test_append_breakdown_quick_run_measures_the_current_statements(
    database_dsn: str
) -> None:
    """`python -m benchmarks.append_breakdown --quick` exits 0 and times the store's own
    observation statement (it once named a statement the store no longer had)."""
    output = await run_module("benchmarks.append_breakdown", "--quick", "--no-json",
                              "--dsn", database_dsn, timeout_s=RUN_TIMEOUT_S)
    rows = [line for line in output.splitlines() if line.startswith("| single |")]
    assert any("raw INSERT (direct) (ref)" in line for line in rows), output
    assert any("store OBSERVE_ONE statement" in line for line in rows), output
    assert any("Store.append_events via pool" in line for line in rows), output


async def test_tenancy_quick_run_compares_the_policies(database_dsn: str) -> None:
    """`python -m benchmarks.tenancy --quick` exits 0 and times the former and the current
    policies, as a tenant's role, in each workload."""
    output = await run_module("benchmarks.tenancy", "--quick", "--no-json",
                              "--dsn", database_dsn, timeout_s=RUN_TIMEOUT_S)
    for workload in ("append", "claim", "policy"):
        rows = [line for line in output.splitlines() if line.startswith(f"| {workload} |")]
        assert any("before: policy on wal.tenant (ref)" in line for line in rows), output
        assert any("after: policy on the login role" in line for line in rows), output


async def test_sync_tools_quick_run_compares_def_tools_with_async_ones(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks.sync_tools --quick` exits 0 and reports, for the executor hop
    and for a whole tool step, the def tool beside the async reference of the same run."""
    results = tmp_path / "sync_tools.json"
    output = await run_module("benchmarks.sync_tools", "--quick", "--dsn", database_dsn,
                              "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    for workload, reference, contender in (
            ("dispatch", "async tool on the loop (ref)", "def tool on the thread pool"),
            ("tool_step", "async tool step (ref)", "def tool step")):
        rows = [line for line in output.splitlines() if line.startswith(f"| {workload} |")]
        assert any(reference in line for line in rows), output
        assert any(contender in line for line in rows), output
    document = json.loads(results.read_text())
    assert {w["name"] for w in document["workloads"]} == {"dispatch", "tool_step"}


async def test_loop_stall_quick_run_reports_the_worst_lag(database_dsn: str,
                                                          tmp_path: Path) -> None:
    """`python -m benchmarks.loop_stall` exits 0 and writes the worst loop lag it saw while
    def tools blocked (on this revision, off the loop)."""
    results = tmp_path / "loop_stall.json"
    await run_module("benchmarks.loop_stall", "--tasks", "1", "--label", "smoke",
                     "--dsn", database_dsn, "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    figures = json.loads(results.read_text())["smoke"]
    assert figures["calls"] == 8 and figures["probes"] > 0
    assert figures["worst_lag_ms"] >= figures["p99_lag_ms"] >= figures["p50_lag_ms"]


async def test_cpu_step_quick_run_reports_both_contenders(database_dsn: str) -> None:
    """`python -m benchmarks.cpu_step` exits 0 and gives wal-engine's client CPU per step
    beside the raw reference of the same run, and their ratio."""
    output = await run_module("benchmarks.cpu_step", "--steps", "20", "--rounds", "1",
                              "--json", "--dsn", database_dsn, timeout_s=RUN_TIMEOUT_S)
    figures = json.loads(output.strip().splitlines()[-1])
    assert figures["steps"] == 20 and len(figures["wal_cpu_us"]) == 1
    assert figures["wal_cpu_us_median"] > 0 and figures["raw_cpu_us_median"] > 0
    assert figures["ratio_median"] == figures["wal_cpu_us"][0] / figures["raw_cpu_us"][0]


def test_compare_reports_each_run_against_its_own_reference(tmp_path: Path) -> None:
    """`python -m benchmarks.compare A B --report DIR` summarises the runs a comparison left:
    each run's ratios to its own reference, and each side's median and spread."""
    from benchmarks.compare import report

    for side, i, wal, ref in (("before", 1, 2000.0, 1600.0), ("after", 1, 2100.0, 1500.0),
                              ("after", 2, 1800.0, 1500.0), ("before", 2, 1900.0, 1700.0)):
        workload = {"name": "step", "contenders": [
            {"name": "raw asyncpg: 2 INSERT commits", "reference": True, "p50_us": ref,
             "events_per_s": 1e6 / ref},
            {"name": "wal-engine tool step", "reference": False, "p50_us": wal,
             "events_per_s": 1e6 / wal}]}
        (tmp_path / f"{side}-{i}.json").write_text(json.dumps(
            {"machine": {"packages": {"git": side}}, "workloads": [workload]}))
        (tmp_path / f"{side}-{i}.cpu.json").write_text(json.dumps(
            {"wal_cpu_us": [wal / 2], "raw_cpu_us": [ref / 4]}))
    text = report(tmp_path, "aaaa", "bbbb")
    assert "| before-1 | 2,000 / 1,600 = 1.25x |" in text
    assert "| step | 1.18x (1.12-1.25, n=2) | 1.30x (1.20-1.40, n=2) |" in text
    assert "| client CPU/step | 2.37x (2.24-2.50, n=2) | 2.60x (2.40-2.80, n=2) |" in text
