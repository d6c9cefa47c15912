"""The LangGraph saver benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "langgraph.checkpoint.postgres",
    reason="the [langgraph] extra is not installed: pip install 'wal-engine[langgraph]'",
)

REPOSITORY = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240.0


async def test_langgraph_benchmark_quick_run_reports_both_savers(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks.langgraph_saver --quick` exits 0 with both savers and bytes/step."""
    results = tmp_path / "langgraph_saver.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.langgraph_saver", "--quick", "--dsn", database_dsn,
        "--json", str(results), cwd=REPOSITORY,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    output = stdout.decode()
    assert process.returncode == 0, f"exit {process.returncode}\n{output}\n{stderr.decode()}"
    document = json.loads(results.read_text())
    workloads = {workload["name"] for workload in document["workloads"]}
    assert {"put", "put_writes", "get@100"} <= workloads
    for workload in document["workloads"]:
        names = {contender["name"] for contender in workload["contenders"]}
        assert names == {"langgraph AsyncPostgresSaver", "wal-engine WalCheckpointSaver"}
    assert set(document["bytes_per_step"]) == names
    assert "Bytes per step" in output
