"""The Pydantic AI benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import run_module

pytest.importorskip(
    "pydantic_ai.durable_exec",
    reason="the [pydantic-ai] extra is not installed: pip install 'wal-engine[pydantic-ai]'",
)

RUN_TIMEOUT_S = 240.0


@pytest.mark.deep
@pytest.mark.skipif(os.environ.get("RELIABILITY_DEEP") != "1",
                    reason="deep tier (RELIABILITY_DEEP=1): 10-17 s, mostly the child's imports")

async def test_pydantic_ai_benchmark_quick_run_reports_its_three_contenders(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks.pydantic_ai_agent --quick` exits 0 with the in-memory run, the
    durable run and the replay, and their cost per step."""
    results = tmp_path / "pydantic_ai_agent.json"
    output = await run_module("benchmarks.pydantic_ai_agent", "--quick", "--rounds", "1",
                              "--ops", "1", "--dsn", database_dsn,
                              "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    document = json.loads(results.read_text())
    (workload,) = document["workloads"]
    names = {contender["name"] for contender in workload["contenders"]}
    assert names == {"pydantic-ai in-memory", "pydantic-ai + WalDurability",
                     "WalDurability replay"}
    assert set(document["p50_us_per_step"]) == names
    assert "p50 per step" in output
