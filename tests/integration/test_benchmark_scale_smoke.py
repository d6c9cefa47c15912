"""The scale benchmark runs end to end at a tiny size, so it cannot rot (no speed is asserted:
the figures of a tiny fill on a shared CI machine say nothing about scale)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import run_module
from wal_engine.testing.postgres import TestServer

RUN_TIMEOUT_S = 120.0
DEEP = pytest.mark.skipif(os.environ.get("RELIABILITY_DEEP") != "1",
                          reason="deep tier: set RELIABILITY_DEEP=1 to run it")
TINY = ("--tasks", "2000", "--events", "20000", "--empty-tasks", "200",
        "--empty-events", "2000", "--rounds", "1", "--ops", "6")


async def test_scale_benchmark_tiny_latencies_run(pg_server: TestServer, tmp_path: Path) -> None:
    """(CI subset) The fill by COPY and every latency measure, on both databases: `verify`
    of the filled old task asserts its chain, the claims and heartbeats assert their rows."""
    results = tmp_path / "scale.json"
    output = await run_module(
        "benchmarks.scale", "--admin-dsn", pg_server.admin_dsn,
        "--database-prefix", f"scale_ci_{os.getpid()}", *TINY, "--timers", "0",
        "--running", "0", "--cpu-steps", "0", "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    assert "| measure | empty p50 µs |" in output, output
    document = json.loads(results.read_text())
    assert document["fill"]["filled"]["task_rows"] == 2000
    for figure in document["latencies"].values():
        assert figure["empty"]["n"] > 0 and figure["filled"]["n"] > 0, figure


@pytest.mark.deep
@DEEP
async def test_scale_benchmark_tiny_run_measures_both_databases(
    pg_server: TestServer, tmp_path: Path
) -> None:
    """`python -m benchmarks.scale` at a tiny size fills a database by COPY (valid chains:
    `verify` of a filled task is among the measures and asserts it), measures every latency
    on it and on the empty one, wakes timers with 4 worker processes, runs a worker and the
    client-CPU comparison, and writes every figure with its ratio and target verdict."""
    results = tmp_path / "scale.json"
    output = await run_module(
        "benchmarks.scale", "--admin-dsn", pg_server.admin_dsn,
        "--database-prefix", f"scale_smoke_{os.getpid()}",
        *TINY, "--timers", "16",
        "--running", "8", "--processes", "1", "--window", "1", "--cpu-steps", "100",
        "--cpu-rounds", "1", "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    assert "| measure | empty p50 µs |" in output, output
    document = json.loads(results.read_text())
    filled = document["fill"]["filled"]
    assert filled["task_rows"] == 2000 and filled["event_rows"] >= 15_000, filled
    latencies = document["latencies"]
    assert set(latencies) >= {"append_new", "append_old", "claim", "heartbeat_1000",
                              "sweep_1000", "resume_1000", "verify", "list_page"}
    for figure in latencies.values():
        assert figure["empty"]["n"] > 0 and figure["filled"]["n"] > 0, figure
        assert figure["p50_ratio"] > 0 and isinstance(figure["target_met"], bool), figure
    for side in ("empty", "filled"):
        assert document["timers"][side]["timers"] == 16
        (workers,) = document["workers"][side]
        assert workers["steps_per_s"] > 0 and workers["ceiling_rows_per_s"] > 0, workers
        assert len(workers["loop_on_cpu"]) == len(workers["loop_waiting_for_cpu"]) == 1, workers
        assert document["cpu_step"][side]["raw_cpu_us_median"] > 0
