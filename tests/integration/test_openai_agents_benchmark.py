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
