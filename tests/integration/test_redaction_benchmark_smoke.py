"""The redaction benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_module

RUN_TIMEOUT_S = 120.0


async def test_redaction_benchmark_quick_run_reports_before_and_after(tmp_path: Path) -> None:
    """`python -m benchmarks.redaction --quick` exits 0 and reports, for hostile text and
    for prose, the old patterns (the reference) beside the current ones."""
    results = tmp_path / "redaction.json"
    output = await run_module("benchmarks.redaction", "--quick", "--json", str(results),
                              timeout_s=RUN_TIMEOUT_S)
    assert "| hostile/'eyJ-' | before (ref) |" in output, output
    assert "| prose-1KB | after |" in output, output
    document = json.loads(results.read_text())
    names = [workload["name"] for workload in document["workloads"]]
    assert "prose-1KB" in names and any(name.startswith("hostile-") for name in names)
    jwt = next(w for w in document["workloads"] if w["name"] == "hostile/'eyJ-'")
    assert [c["name"] for c in jwt["contenders"]] == ["before", "after"]
    assert all(c["median_us"] > 0 for c in jwt["contenders"])
