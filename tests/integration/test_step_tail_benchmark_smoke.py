"""The step-tail attribution benchmark runs end to end (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_module

RUN_TIMEOUT_S = 120.0


async def test_step_tail_attributes_every_sample(database_dsn: str, tmp_path: Path) -> None:
    """`python -m benchmarks.step_tail` times both contenders' steps, attributes the slowest
    to what overlapped them, and leaves the engine's functions unwrapped afterwards."""
    results = tmp_path / "tail.json"
    output = await run_module("benchmarks.step_tail", "--dsn", database_dsn, "--steps", "20",
                              "--block", "10", "--json", str(results),
                              timeout_s=RUN_TIMEOUT_S)
    assert "| contender | samples |" in output, output
    document = json.loads(results.read_text())
    for key in ("raw", "wal"):
        figures = document["contenders"][key]
        assert figures["samples"] == 20, figures
        assert sum(figures["slowest_2pct"].values()) >= 1, figures
        assert figures["p50_us"] <= figures["p99_us"] <= figures["max_us"], figures
