"""The partitioning benchmark runs end to end at a tiny size, so it cannot rot (no speed is
asserted: a tiny fill on a shared machine says nothing about partitions)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import asyncpg

from tests.helpers import run_module
from wal_engine.testing.postgres import TestServer

RUN_TIMEOUT_S = 120.0


async def test_partitioning_benchmark_tiny_run(pg_server: TestServer, tmp_path: Path) -> None:
    """Both layouts are filled alike (the same rows), every measure runs on both (`verify`
    asserts the filled old task's chain), removing the oldest month removes the same rows
    in both (by DELETE in one, by dropping its partitions in the other), and the append
    is timed by number of partitions."""
    results = tmp_path / "partitioning.json"
    prefix = f"part_ci_{os.getpid()}"
    try:
        output = await run_module(
            "benchmarks.partitioning", "--admin-dsn", pg_server.admin_dsn,
            "--database-prefix", prefix, "--tasks", "1500", "--events", "15000",
            "--rounds", "1", "--ops", "6", "--blocks", "4", "--months-back", "0",
            "--json", str(results),
            timeout_s=RUN_TIMEOUT_S)
    finally:
        admin = await asyncpg.connect(pg_server.admin_dsn)
        try:
            for label in ("flat", "month", "count_flat", "count_partitions_5"):
                await admin.execute(f'DROP DATABASE IF EXISTS "{prefix}_{label}" WITH (FORCE)')
        finally:
            await admin.close()
    assert "retention_month" in output, output
    document = json.loads(results.read_text())
    assert document["fill"]["flat"]["event_rows"] == document["fill"]["month"]["event_rows"]
    latencies = document["latencies"]
    for name in ("append_new", "append_old", "read_old", "resume_1000", "verify"):
        assert latencies[name]["flat"]["n"] > 0 and latencies[name]["month"]["n"] > 0, name
    month = latencies["retention_month"]
    assert month["flat"]["events"] == month["month"]["events"] > 0, month
    assert set(latencies["observe_by_partitions"]) == {"flat", "partitions_5"}
