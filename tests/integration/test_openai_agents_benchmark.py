"""The OpenAI Agents SDK benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "agents", reason="the [openai-agents] extra is not installed: pip install"
    " 'wal-engine[openai-agents]'")

from benchmarks import openai_agents
from tests.helpers import run_module

SUITE_TIMEOUT_S = 240.0


async def test_openai_agents_benchmark_reports_both_runners_and_per_step_cost(
        database_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """One quick round in this process (a new one would spend seconds importing the SDK):
    both runners in both workloads, and a per-step cost for each."""
    results = tmp_path / "openai_agents.json"
    monkeypatch.setattr(sys, "argv", [
        "openai_agents", "--quick", "--rounds", "1", "--ops", "1", "--dsn", database_dsn,
        "--json", str(results)])
    assert await openai_agents.main() == 0
    document = json.loads(results.read_text())
    assert [workload["name"] for workload in document["workloads"]] == [
        "run@1", f"run@{openai_agents.QUICK_STEPS}"]
    for workload in document["workloads"]:
        names = {contender["name"] for contender in workload["contenders"]}
        assert names == {openai_agents.SDK, openai_agents.WAL}
    assert set(document["per_step_us"]) == names
    assert "Per step" in capsys.readouterr().out


async def test_suite_openai_agents_rows_run_in_memory_wal_engine_and_dbos_side_by_side(
        database_dsn: str, tmp_path: Path) -> None:
    """`python -m benchmarks --only openai-agents` runs runs of 1 and of S steps: the SDK in
    memory (the reference), wal-engine's and, when dbos-openai-agents is installed, DBOS's;
    the marginal cost per step of each; without DBOS its contender is skipped with a reason."""
    from benchmarks import suite

    results = tmp_path / "agents.json"
    output = await run_module("benchmarks", "--quick", "--only", "openai-agents", "--rounds",
                              "1", "--ops", "1", "--dsn", database_dsn, "--json", str(results),
                              timeout_s=SUITE_TIMEOUT_S)
    document = json.loads(results.read_text())
    steps = suite.OPENAI_AGENTS_QUICK_STEPS
    assert [workload["name"] for workload in document["workloads"]] == [
        "openai-agents@1", f"openai-agents@{steps}"]
    expected = dict(suite.OPENAI_AGENTS_NAMES)
    if suite.first_missing(("dbos", "dbos_openai_agents")) is not None:
        del expected["dbos"]
        assert "not installed" in document["skipped"]["openai-agents DBOS"]
    for workload in document["workloads"]:
        assert [c["name"] for c in workload["contenders"]] == list(expected.values())
    row = document["notes"]["agent_rows"]["openai-agents"]
    assert set(row["per_step_us"]) == set(expected.values()) and row["steps"] == steps
    if "dbos" in expected:
        # A model response per turn (steps + 1) and a tool call per step, all recorded.
        assert row["dbos_steps_per_run"] == 2 * steps + 1
    assert "`openai-agents` per step" in output


async def test_an_agent_row_whose_framework_is_missing_is_skipped_with_its_reason(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A row whose framework cannot be imported is left out with one line saying which module
    is missing and how to install it, and the run goes on (nothing is started for it)."""
    from benchmarks import harness, suite

    row = suite.AgentRow("openai-agents", "openai_agents", "OpenAI Agents SDK",
                         ("no_such_framework_module",), "pip install -e '.[openai-agents]'",
                         ("dbos",), "pip install -e '.[openai-agents,bench]'")
    monkeypatch.setattr(suite, "AGENT_ROWS", (row,))
    run = suite.Run(settings=harness.RunSettings(rounds=1, ops=1, quick=True), sizes=(),
                    dsn="postgresql://nobody@127.0.0.1:1/none", dbos_url="", run_id="x",
                    peers=[])
    await suite.run_agent_rows(run, ["openai-agents"])
    assert run.results == []
    reason = run.skipped["openai-agents"]
    assert "no_such_framework_module" in reason and "[openai-agents]" in reason
    assert f"skipping openai-agents: {reason}" in capsys.readouterr().err
