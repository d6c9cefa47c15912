"""The LangGraph saver benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_module

pytest.importorskip(
    "langgraph.checkpoint.postgres",
    reason="the [langgraph] extra is not installed: pip install 'wal-engine[langgraph]'",
)

RUN_TIMEOUT_S = 240.0


async def test_langgraph_benchmark_quick_run_reports_both_savers(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks.langgraph_saver --quick` exits 0 with both savers and bytes/step."""
    results = tmp_path / "langgraph_saver.json"
    output = await run_module("benchmarks.langgraph_saver", "--quick", "--dsn", database_dsn,
                              "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    document = json.loads(results.read_text())
    workloads = {workload["name"] for workload in document["workloads"]}
    assert {"put", "put_writes", "get@100"} <= workloads
    for workload in document["workloads"]:
        names = {contender["name"] for contender in workload["contenders"]}
        assert names == {"langgraph AsyncPostgresSaver", "wal-engine WalCheckpointSaver"}
    assert set(document["bytes_per_step"]) == names
    assert "Bytes per step" in output
