"""Metrics: counters and histograms with prometheus-client installed, no cost without it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import urllib.request
from typing import Any

import pytest

from wal_engine.observability import metrics

needs_extra = pytest.mark.skipif(not metrics.available(),
                                 reason="the metrics extra (prometheus-client) is not installed")


def prometheus() -> Any:
    """The prometheus_client module (the tests using it are skipped without the extra)."""
    import prometheus_client

    return prometheus_client


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    """The current value of a sample in the default registry (0 when absent)."""
    return prometheus().REGISTRY.get_sample_value(name, labels or {}) or 0.0


@needs_extra
def test_hooks_count_into_the_default_registry() -> None:
    """Every hook moves its own metric, with its labels."""
    before = {
        "events": sample("wal_engine_events_appended_total"),
        "claims": sample("wal_engine_tasks_claimed_total"),
        "orphans": sample("wal_engine_tasks_orphaned_total"),
        "retries": sample("wal_engine_call_retries_total", {"kind": "tool", "reason": "failure"}),
        "doubt": sample("wal_engine_call_retries_total", {"kind": "llm", "reason": "in_doubt"}),
        "trips": sample("wal_engine_budget_trips_total", {"budget": "max_tokens"}),
        "dedup": sample("wal_engine_effects_deduplicated_total"),
        "appends": sample("wal_engine_append_seconds_count", {"path": "group"}),
        "folded": sample("wal_engine_resume_events_folded_sum", {"source": "snapshot"}),
    }
    metrics.events_appended(5)
    metrics.tasks_claimed(2)
    metrics.tasks_orphaned(1)
    metrics.call_failed("tool", retryable=True)
    metrics.call_failed("tool", retryable=False)  # A final failure is no retry.
    metrics.call_retried("llm", "in_doubt")
    metrics.budget_tripped("max_tokens")
    metrics.effect_deduplicated()
    metrics.append_observed("group", metrics.clock(), 3)
    metrics.resumed(40, from_snapshot=True)
    assert sample("wal_engine_events_appended_total") == before["events"] + 5 + 3
    assert sample("wal_engine_tasks_claimed_total") == before["claims"] + 2
    assert sample("wal_engine_tasks_orphaned_total") == before["orphans"] + 1
    assert sample("wal_engine_call_retries_total",
                  {"kind": "tool", "reason": "failure"}) == before["retries"] + 1
    assert sample("wal_engine_call_retries_total",
                  {"kind": "llm", "reason": "in_doubt"}) == before["doubt"] + 1
    assert sample("wal_engine_budget_trips_total", {"budget": "max_tokens"}) == \
        before["trips"] + 1
    assert sample("wal_engine_effects_deduplicated_total") == before["dedup"] + 1
    assert sample("wal_engine_append_seconds_count", {"path": "group"}) == \
        before["appends"] + 1
    assert sample("wal_engine_resume_events_folded_sum", {"source": "snapshot"}) == \
        before["folded"] + 40


@needs_extra
def test_instruments_register_in_any_registry() -> None:
    """A private registry gets the whole set (for applications with their own registry)."""
    registry = prometheus().CollectorRegistry()
    instruments = metrics.Instruments(registry)
    instruments.tasks_claimed.inc(3)
    assert registry.get_sample_value("wal_engine_tasks_claimed_total") == 3


@needs_extra
def test_live_tasks_gauge_sums_tenants_and_keeps_a_drained_version_at_zero() -> None:
    """Readings are per tenant (a later one replaces the earlier), summed at scrape; a
    series absent from the latest readings reads 0 instead of vanishing; an unpinned
    version is the empty label. The hook folds the statement's per-status rows."""
    registry = prometheus().CollectorRegistry()
    live = metrics.Instruments(registry).live_tasks

    def gauge(version: str) -> float | None:
        value = registry.get_sample_value("wal_engine_live_tasks",
                                          {"agent": "a", "version": version})
        return None if value is None else float(value)

    live.update("t1", {("a", "1"): 3, ("a", "2"): 1})
    live.update("t2", {("a", "2"): 4, ("a", ""): 2})
    assert (gauge("1"), gauge("2"), gauge("")) == (3, 5, 2)
    live.update("t1", {("a", "2"): 1})
    assert (gauge("1"), gauge("2"), gauge("")) == (0, 5, 2)
    assert gauge("never") is None

    rows = [{"agent": "hook-agent", "agent_version": "7", "status": "QUEUED", "tasks": 2},
            {"agent": "hook-agent", "agent_version": "7", "status": "WAITING", "tasks": 3},
            {"agent": "hook-agent", "agent_version": None, "status": "QUEUED", "tasks": 1}]
    metrics.live_tasks_read("hook-tenant", rows)
    assert sample("wal_engine_live_tasks", {"agent": "hook-agent", "version": "7"}) == 5
    assert sample("wal_engine_live_tasks", {"agent": "hook-agent", "version": ""}) == 1


@needs_extra
def test_serve_exposes_the_metrics_over_http() -> None:
    """serve() answers /metrics with the engine's metrics; shutdown() stops it."""
    server = metrics.serve(0, "127.0.0.1")
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "wal_engine_events_appended_total" in text


def test_without_the_extra_every_hook_is_free_and_serve_says_how_to_install() -> None:
    """prometheus-client absent: hooks do nothing (not even read a clock); serve explains."""
    code = textwrap.dedent("""
        import sys, time
        sys.modules["prometheus_client"] = None  # The extra is not installed.
        from wal_engine.observability import metrics
        from wal_engine.errors import ConfigurationError
        assert not metrics.available() and metrics.instruments() is None
        def no_clock():
            raise AssertionError("a clock was read")
        time.perf_counter = no_clock
        assert metrics.clock() == 0.0
        metrics.append_observed("single", 0.0, 1)
        metrics.events_appended(1); metrics.tasks_claimed(1); metrics.tasks_orphaned(1)
        metrics.call_failed("tool", True); metrics.call_retried("tool", "in_doubt")
        metrics.budget_tripped("max_steps"); metrics.effect_deduplicated()
        metrics.resumed(10, False)
        metrics.live_tasks_read("t", [{"agent": "a", "agent_version": "1", "tasks": 1}])
        try:
            metrics.serve(9999)
        except ConfigurationError as error:
            assert "wal-engine[metrics]" in str(error)
        else:
            raise AssertionError("serve() worked without prometheus-client")
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@needs_extra
def test_queue_gauges_follow_the_latest_reading_per_tenant() -> None:
    """Queue readings become gauges by tenant and queue; a limit that is not set is absent;
    a queue gone from a tenant's latest reading is dropped; claims count by queue."""
    from wal_engine.store.queues import QueueStats

    def stats(queue: str, depth: int, running: int, limit: int | None) -> QueueStats:
        return QueueStats(queue=queue, configured=limit is not None, depth=depth,
                          running=running, waiting=0, concurrency_max=limit,
                          worker_concurrency_max=None, oldest_wait_s=1.5 if depth else None,
                          updated_at=None)

    metrics.queues_read("qt", [stats("llm", 4, 2, 3), stats("default", 0, 1, None)])
    llm, default = {"tenant": "qt", "queue": "llm"}, {"tenant": "qt", "queue": "default"}
    assert (sample("wal_engine_queue_depth", llm), sample("wal_engine_queue_running", llm),
            sample("wal_engine_queue_concurrency_max", llm),
            sample("wal_engine_queue_oldest_wait_seconds", llm)) == (4, 2, 3, 1.5)
    registry = prometheus().REGISTRY
    assert registry.get_sample_value("wal_engine_queue_concurrency_max", default) is None
    assert registry.get_sample_value("wal_engine_queue_running", default) == 1
    metrics.queues_read("qt", [stats("llm", 0, 0, 3)])
    assert registry.get_sample_value("wal_engine_queue_running", default) is None
    before = sample("wal_engine_queue_claims_total", {"queue": "llm"})
    metrics.claimed_in_queue("llm")
    assert sample("wal_engine_queue_claims_total", {"queue": "llm"}) == before + 1
