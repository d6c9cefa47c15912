"""The whole benchmark suite runs end to end in --quick, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_module

RUN_TIMEOUT_S = 300.0


async def test_suite_quick_run_prints_the_table_and_writes_the_json(
    database_dsn: str, tmp_path: Path
) -> None:
    """`python -m benchmarks --quick` exits 0, prints its tables and writes its JSON; a peer
    that is not installed is skipped with a reason, never a failure."""
    results = tmp_path / "latest.json"
    # Histories of 50 and 100 steps, not --quick's 100 and 1,000: LangGraph writes about 30
    # steps a second here, and the sizes do not matter to whether the suite still runs.
    # The agent rows (pydantic-ai, openai-agents) have tests of their own, beside their
    # standalone benchmarks' (test_pydantic_ai_benchmark.py, test_openai_agents_benchmark.py).
    output = await run_module("benchmarks", "--quick", "--sizes", "50,100",
                              "--only", "step,step64,resume", "--dsn",
                              database_dsn, "--json", str(results), timeout_s=RUN_TIMEOUT_S)
    assert "| workload | contender |" in output
    assert "| contender | step p50 / p99 ms |" in output
    assert "### Targets" in output
    document = json.loads(results.read_text())
    assert document["machine"]["postgres"]["fsync"] in {"on", "off"}
    workloads = {workload["name"]: workload for workload in document["workloads"]}
    assert {"step", "step64", "resume@50", "resume@100"} <= workloads.keys()
    names = {contender["name"] for contender in workloads["step"]["contenders"]}
    assert {"raw asyncpg: 2 INSERT commits", "wal-engine tool step"} <= names
    ran = {row["key"] for row in document["summary"]}
    for peer in ("langgraph", "dbos"):
        assert (peer in ran) != (peer in document["skipped"]), (peer, document["skipped"])
    assert {"raw", "wal"} <= ran
    assert all(target["name"] for target in document["targets"])
