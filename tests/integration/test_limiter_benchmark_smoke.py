"""The limiter benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_module

RUN_TIMEOUT_S = 120.0


async def test_limiter_benchmark_quick_run_reports_overhead_and_hold(database_dsn: str,
                                                                     tmp_path: Path) -> None:
    """`python -m benchmarks.limiter --quick` exits 0, reports the per-call p50 with and
    without a limiter, and a token hold that never went past the limit by more than the
    usage reported over the estimates."""
    results = tmp_path / "limiter.json"
    output = await run_module("benchmarks.limiter", "--quick", "--dsn", database_dsn,
                              "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    assert "| no limiter (ref) |" in output and "| limiter |" in output, output
    document = json.loads(results.read_text())
    assert document["overhead"]["limited"]["calls"] == document["overhead"]["plain"]["calls"]
    hold = document["hold"]
    assert hold["calls"] > 0 and hold["windows"] > 0
    # Usage is drawn in 300..700 against estimates of 500: a window can hold at most the
    # limit plus what settled calls reported over their estimate while others waited.
    assert 0 < hold["max"] <= 1.4, hold
