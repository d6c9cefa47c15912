"""The gateway benchmark runs end to end, so it cannot rot (no speed is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_module
from tests.redis_support import require_redis

RUN_TIMEOUT_S = 180.0


async def test_gateway_benchmark_quick_run_reports_every_contender(
        database_dsn: str, tmp_path: Path) -> None:
    """`python -m benchmarks.gateway --quick` exits 0 and reports the direct reference, both
    stores' miss and hit paths, and the throughput of one gateway process."""
    require_redis()
    results = tmp_path / "gateway.json"
    output = await run_module("benchmarks.gateway", "--quick", "--dsn", database_dsn,
                              "--concurrency", "8", "--json", str(results),
                              timeout_s=RUN_TIMEOUT_S)
    assert "| latency | direct to upstream (ref) |" in output
    assert "Added latency per request" in output
    document = json.loads(results.read_text())
    names = {workload["name"]: {c["name"] for c in workload["contenders"]}
             for workload in document["workloads"]}
    assert names["latency"] == {
        "direct to upstream", "gateway redis, new key", "gateway redis, repeat (dedup hit)",
        "gateway postgres, new key", "gateway postgres, repeat (dedup hit)"}
    assert names["throughput"] == {"direct to upstream", "gateway redis, new keys",
                                   "gateway postgres, new keys"}
