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


@pytest.mark.deep
@pytest.mark.skipif(os.environ.get("RELIABILITY_DEEP") != "1",
                    reason="deep tier (RELIABILITY_DEEP=1): 20-40 s, mostly the child's imports")
async def test_suite_pydantic_ai_row_runs_in_memory_wal_engine_and_dbos_side_by_side(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks --only pydantic-ai` runs the row: the in-memory run (the
    reference), wal-engine's and, when dbos is installed, DBOS's, each with its cost per
    step and its ratio; without dbos the DBOS contender is skipped with its reason."""
    from benchmarks import suite

    results = tmp_path / "agents.json"
    output = await run_module("benchmarks", "--quick", "--only", "pydantic-ai", "--rounds",
                              "1", "--ops", "1", "--dsn", database_dsn, "--json", str(results),
                              timeout_s=RUN_TIMEOUT_S)
    document = json.loads(results.read_text())
    (workload,) = document["workloads"]
    assert workload["name"] == "pydantic-ai"
    names = [contender["name"] for contender in workload["contenders"]]
    expected = dict(suite.PYDANTIC_AI_NAMES)
    if suite.first_missing(("dbos",)) is not None:
        del expected["dbos"]
        assert "not installed" in document["skipped"]["pydantic-ai DBOS"]
    assert names == list(expected.values())
    row = document["notes"]["agent_rows"]["pydantic-ai"]
    assert set(row["per_step_us"]) == set(names)
    assert row["per_step_ratio"][expected["in_memory"]] == 1.0
    if "dbos" in expected:
        assert row["dbos_steps_per_run"] == row["steps_per_run"]  # Every request and call.
    assert "`pydantic-ai` per step" in output
    assert "### Targets" not in output  # No peer workload ran: no empty summary.
