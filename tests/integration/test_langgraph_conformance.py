"""LangGraph's own conformance suite (langgraph-checkpoint-conformance) against the saver."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

pytest.importorskip(
    "langgraph.checkpoint.conformance",
    reason="the [langgraph] extra is not installed: pip install 'wal-engine[langgraph]'",
)

from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    BASE_CAPABILITIES,
    EXTENDED_CAPABILITIES,
)

from wal_engine.integrations.langgraph import AGENT, WalCheckpointSaver
from wal_engine.store import Store


async def test_conformance_suite_reports_full(store: Store) -> None:
    """validate() passes every base and every extended capability: FULL, 8 of 8."""

    @checkpointer_test(name="WalCheckpointSaver")
    async def saver_factory() -> AsyncIterator[WalCheckpointSaver]:
        saver = WalCheckpointSaver(store)
        await saver.setup()
        yield saver

    report = await validate(saver_factory)
    report.print_report()
    failures = {name: result.failures for name, result in report.results.items()
                if result.failures}
    assert failures == {}
    assert report.conformance_level() == "FULL"
    every = {capability.value for capability in BASE_CAPABILITIES | EXTENDED_CAPABILITIES}
    assert len(every) == 8
    assert {name for name, result in report.results.items() if result.passed} == every


async def test_every_thread_of_the_suite_verifies(store: Store) -> None:
    """After the whole suite (puts, writes, deletes, prunes, copies) every task's chain verifies."""

    @checkpointer_test(name="WalCheckpointSaver-verify")
    async def saver_factory() -> AsyncIterator[WalCheckpointSaver]:
        saver = WalCheckpointSaver(store)
        await saver.setup()
        yield saver

    await validate(saver_factory)
    heads = await store.list_tasks(agent=AGENT, limit=10_000)
    assert len(heads) > 50
    reports = [await store.verify_task(head.task_id) for head in heads]
    assert [report.violation for report in reports if not report.ok] == []
