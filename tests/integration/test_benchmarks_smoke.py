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
