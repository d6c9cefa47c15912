"""L5: recorded histories replay unchanged with today's code (RELIABILITY.md L5, I10, I13).

Each file in ``histories/`` is one task's log as an older version of the code wrote it
(``python -m tests.golden.record``). Loaded into a fresh database, it must verify (hash
chain, recorded head), fold to the same state from the database as from the file, and
replay against today's agent code with no divergence, the recorded end, and zero calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import msgspec
import pytest

from replay.fold import fold
from replay.upcasting import upcasters
from tests.golden.record import HISTORIES, register_all
from wal_engine.engine import Engine, connect
from wal_engine.events import EVENT_TYPES
from wal_engine.runtime.replayer import replay_events
from wal_engine.testing.ledger import EffectLedger
from wal_engine.testing.replay import insert_history, load_history, mismatch, verify_history

FILES = sorted(HISTORIES.glob("*.jsonl"))
NEXT_COMMAND: dict[str, str] = {
    "demo_waiting_for_approval": "send_report",
    "deployed_v1_waiting": "'go'",
}
"""For histories that are not finished: what today's code must ask for next."""

DEMO_EFFECTS = "SELECT coalesce(sum(deliveries), 0) AS n FROM demo_effects"


NEW_IN_FORMAT_5: Final = ("patch_marked", "run_interrupted", "hook_failed")
"""Event types added with issue 17 (STATE_FORMAT 5): each must be in a golden history."""


def test_there_are_golden_histories() -> None:
    """The fixtures exist (a glob that matches nothing would make L5 vacuous)."""
    assert len(FILES) >= 8


def test_new_event_types_have_golden_histories_and_upcaster_chains() -> None:
    """Every type added with issue 17 is in a recorded history, and every type of the
    vocabulary has an upcaster from each of its older versions (none yet: all are at 1)."""
    recorded = {record.type for path in FILES for record in load_history(path)}
    assert set(NEW_IN_FORMAT_5) <= recorded, set(NEW_IN_FORMAT_5) - recorded
    assert set(NEW_IN_FORMAT_5) <= set(EVENT_TYPES)
    assert upcasters.missing_steps() == []


@pytest.fixture
async def engine(database_dsn: str) -> Any:
    made = await connect(database_dsn, migrate=False)
    await register_all(made)
    try:
        yield made
    finally:
        await made.close()


async def _calls(engine: Engine) -> int:
    demo_rows = await engine.database.fetch(DEMO_EFFECTS)
    ledger = await EffectLedger.for_engine(engine).totals()
    return int(demo_rows[0]["n"]) + ledger.deliveries


@pytest.mark.parametrize("path", FILES, ids=[path.stem for path in FILES])
async def test_l5_golden_history_replays_with_todays_code(engine: Engine, path: Path) -> None:
    """Load, verify, fold from the database, replay against today's code: no divergence,
    the recorded ending (or the expected next command), and nothing called."""
    records = load_history(path)
    file_report = verify_history(records)
    assert file_report.ok, file_report.violation
    task_id = records[0].task_id
    from_file = await insert_history(engine.database, records)
    assert (await engine.store.verify_task(task_id)).ok
    from_database = await engine.state(task_id)
    assert msgspec.msgpack.encode(from_database) == msgspec.msgpack.encode(from_file)
    calls_before = await _calls(engine)
    report = await replay_events(await engine.history(task_id), engine.agents, task_id=task_id)
    assert mismatch(report) is None, mismatch(report)
    assert await _calls(engine) == calls_before == 0
    if from_file.terminal:
        assert report.outcome in ("completed", "failed", "reached_end"), report
    else:
        assert report.outcome == "reached_end", report
        assert NEXT_COMMAND[path.stem] in (report.stopped_at or ""), report.stopped_at
    print(f"L5 {path.stem}: {len(records)} events, {report.calls_replayed} calls replayed, "
          f"outcome {report.outcome}, 0 calls made, violations 0")


async def test_l5_a_tampered_golden_history_is_refused(engine: Engine) -> None:
    """Flip one byte of a recorded payload: the chain check names the seq (the golden check
    is not vacuous)."""
    records = load_history(HISTORIES / "demo_completed.jsonl")
    bad = list(records)
    victim = bad[5]
    bad[5] = msgspec.structs.replace(victim, payload=victim.payload.replace(b"a", b"b", 1))
    report = verify_history(bad)
    assert not report.ok and report.violation is not None and report.violation.seq == 6


async def test_l5_changed_code_diverges_from_a_golden_history(engine: Engine) -> None:
    """Today's code with two calls swapped diverges from the recorded demo history."""
    from wal_engine.cli import demo

    records = load_history(HISTORIES / "demo_completed.jsonl")
    original = engine.agents[demo.AGENT_NAME].function

    async def swapped(ctx: Any, task_input: Any) -> Any:
        await ctx.message("user", task_input["question"])
        await ctx.tool("web_search", lambda args: None, {"query": task_input["question"]})
        return await original(ctx, task_input)

    report = await replay_events(records, swapped, task_id=records[0].task_id)
    assert report.divergence is not None
    assert fold(records).status is not None


@pytest.mark.parametrize("name", ["deployed_v1_completed", "deployed_v1_finished_on_v2"])
async def test_l5_v2_without_its_patches_diverges_from_v1_golden_histories(
        database_dsn: str, name: str) -> None:
    """Version 2's changes made without ``ctx.patched`` break the histories version 1
    wrote: the golden check refuses the incompatible change (it is not vacuous)."""
    from tests.fault import deploy_agents

    unpatched = await connect(database_dsn, migrate=False)
    try:
        deploy_agents.register_v2_unpatched(unpatched)
        records = load_history(HISTORIES / f"{name}.jsonl")
        report = await replay_events(records, unpatched.agents, task_id=records[0].task_id)
    finally:
        await unpatched.close()
    assert report.divergence is not None and report.divergence.kind == "call", report
