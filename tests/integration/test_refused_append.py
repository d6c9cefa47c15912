"""A write the database refuses is no ending of the agent's (issue 17's deploy gate).

A fresh-clone CI run once failed the rolling-deploy test at the deploy gate: the replay of
the finished task ``v2timer-3`` against version 2 "diverged at seq 5: recorded=None,
requested=tool 'notify'". That is the signature of a version 2 history that ends with
``task_failed`` (``agent_error``) right after ``prepare``: the run's ``ctx.patched`` marker
was refused by the database (then, a group commit voided by another task's stale wake-up,
fixed since in the store), the refusal reached the agent code as an exception, and the run
recorded it as the code's own failure. The gate replays a history the code ended as the
code's ending, so today's code, which does not raise there, went on past it: ``patched``
answers False at the end of a finished history, and the old branch asked for ``notify``.

The tests here pin both halves: that history shape replays into exactly the divergence CI
reported (the replayer answers as it must), and a run whose write the database refuses
hands its task back instead of failing it, with its state as the log has it, so that the
task completes on the next run and its history replays cleanly.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from replay import args_hash
from tests.fault import deploy_agents as agents
from tests.helpers import claim, drive
from wal_engine import events as ev
from wal_engine.engine import Engine
from wal_engine.errors import InvalidInput, WalError
from wal_engine.runtime.context import AgentContext
from wal_engine.runtime.replayer import check_history, replay_events
from wal_engine.store import PendingAppend, Store

TIMER_TASK: Final = {"n": 4, "wait": "timer", "sleep_s": 0.05}
REFUSAL: Final = "IllegalTransition: illegal transition on task 'v2timer-3': RUNNING -> RUNNING"



def refuse_first(event_type: str) -> tuple[str, ...]:
    """Statements that make the database refuse the first insert of ``event_type`` (as the
    status trigger refuses a move: SQLSTATE WE001, an ``IllegalTransition``)."""
    return (
        "CREATE SEQUENCE test_refusals",
        """CREATE FUNCTION test_refuse_first() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            -- A sequence is not rolled back with the refused statement: only the first
            -- insert of the type is refused, as the database refused the CI run's marker.
            IF NEW.type = TG_ARGV[0] AND nextval('test_refusals') = 1 THEN
                RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'WE001',
                    COLUMN = 'RUNNING', CONSTRAINT = 'RUNNING';
            END IF;
            RETURN NEW;
        END $$""",
        f"""CREATE TRIGGER test_refuse_first BEFORE INSERT ON wal_events
            FOR EACH ROW EXECUTE FUNCTION test_refuse_first('{event_type}')""",
    )


def _prepared_then(*tail: ev.Event) -> list[tuple[int, ev.Event]]:
    """A version 2 timer task claimed, ``prepare`` recorded, then ``tail``."""
    prepare_args = {"n": TIMER_TASK["n"], "gate": False}
    events: list[ev.Event] = [
        ev.TaskSubmitted(agent=agents.AGENT, input=TIMER_TASK, agent_version="2"),
        ev.TaskClaimed(worker_id="v2-0", attempt=1, agent_version="2"),
        ev.ToolCallIntended(call_id="tool-0", tool="prepare", args=prepare_args,
                            args_hash=args_hash(prepare_args), idempotency_key="k-0"),
        ev.ToolCallCompleted(call_id="tool-0", result={"prepared": TIMER_TASK["n"]}),
        *tail,
    ]
    return list(enumerate(events, 1))


async def test_a_task_failed_on_a_refused_marker_replays_into_the_ci_divergence(
        engine: Engine) -> None:
    """The history CI's gate refused (``task_failed`` agent_error at seq 5, right after
    ``prepare``) gives exactly its divergence; the same task handed back at that point
    instead replays to the end of its history with no divergence."""
    agents.register_v2(engine)
    failed = _prepared_then(ev.TaskFailed(reason="agent_error", error=REFUSAL))
    report = await replay_events(failed, engine.agents, task_id="v2timer-3")
    assert report.divergence is not None
    divergence = report.divergence
    assert (divergence.seq, divergence.recorded) == (5, None), divergence
    assert (divergence.requested or "").startswith("tool 'notify'"), divergence

    handed_back = _prepared_then(ev.TaskReleased(worker_id="v2-0", reason=REFUSAL))
    report = await replay_events(handed_back, engine.agents, task_id="v2timer-3")
    assert report.ok and report.outcome == "reached_end", report
    assert report.calls_replayed == 1


async def test_a_refused_write_hands_the_task_back_and_the_next_run_completes_it(
        engine: Engine) -> None:
    """The database refuses version 2's first ``patch_marked``: the run does not record
    ``agent_error`` or keep the marker the log lacks; it hands the task back, the next run
    marks the patch, skips ``notify`` and completes, and the deploy gate's replay of the
    history passes."""
    agents.register_v2(engine)
    await agents.prepare_tables(engine)
    for statement in refuse_first("patch_marked"):
        await engine.database.fetch(statement)
    task_id = await engine.submit(agents.AGENT, TIMER_TASK, task_id="v2timer-refused")
    result = await drive(engine, task_id)

    history = await engine.store.read_events(task_id, from_seq=1, limit=100)
    types = [record.type for record in history]
    assert str(result.status) == "COMPLETED", types
    assert result.output["charged"]["currency"] == "EUR" and "receipt" in result.output
    assert types.count("task_released") == 1, types
    assert "task_failed" not in types
    # The marker the database refused is not in the log; the next run's is, once.
    state = await engine.state(task_id)
    assert state.patches == list(agents.PATCHES), state.patches
    assert "IllegalTransition" in _released_reason(history)
    refusals = await engine.database.fetch("SELECT last_value FROM test_refusals")
    assert refusals[0]["last_value"] >= 2  # Refused once, then accepted.
    effects = await engine.database.fetch(
        "SELECT tool FROM wal_test_effects WHERE task_id = $1 LIMIT 10", task_id)
    assert sorted(row["tool"] for row in effects) == ["charge", "prepare", "receipt"]
    report = await check_history(engine, task_id)
    assert report.ok and report.outcome == "completed", report


async def test_code_that_swallows_a_refused_write_does_not_complete_on_it(
        engine: Engine) -> None:
    """Agent code that catches the refusal of its message and returns: that run's ending is
    not recorded (its message is not in the log); the task is handed back and completes on
    the next run, whose message lands."""
    runs: list[str] = []

    @engine.agent("swallower")
    async def swallower(ctx: AgentContext, task_input: Any) -> Any:
        try:
            await ctx.message("assistant", "noted")
        except WalError as refused:
            runs.append(type(refused).__name__)
            return "swallowed"
        runs.append("noted")
        return "noted"

    for statement in refuse_first("message_appended"):
        await engine.database.fetch(statement)
    task_id = await engine.submit("swallower", {})
    result = await drive(engine, task_id)
    assert runs == ["IllegalTransition", "noted"], runs
    assert str(result.status) == "COMPLETED" and result.output == "noted"
    assert [m.content for m in result.messages] == ["noted"]
    history = await engine.store.read_events(task_id, from_seq=1, limit=100)
    assert [r.type for r in history].count("task_released") == 1
    assert (await engine.store.verify_task(task_id)).ok


def _released_reason(history: list[Any]) -> str:
    for record in history:
        if record.type == "task_released":
            reason: str = orjson.loads(bytes(record.payload))["reason"]
            return reason
    return ""


REFUSE_ONE_TASK: Final = (
    """CREATE FUNCTION test_refuse_task() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.task_id = 'g-1' AND NEW.type = 'message_appended' THEN
            RAISE EXCEPTION 'refused by the test' USING ERRCODE = '22023';
        END IF;
        RETURN NEW;
    END $$""",
    """CREATE TRIGGER test_refuse_task BEFORE INSERT ON wal_events
        FOR EACH ROW EXECUTE FUNCTION test_refuse_task()""",
)


async def test_a_refusal_of_any_kind_voids_only_its_own_task_in_a_group_commit(
        store: Store) -> None:
    """One task's rows refused for a reason the group commit did not list (here an
    ``InvalidInput``, SQLSTATE 22023) used to void the shared statement and reach every run
    in the group as its own failure; only that task is refused now."""
    for n in range(3):
        await store.create_task(f"g-{n}", "agent")
    await claim(store.database)
    heads = [await store.read_head(f"g-{n}") for n in range(3)]
    for statement in REFUSE_ONE_TASK:
        await store.database.fetch(statement)
    results = await store.append_many([
        PendingAppend(task_id=h.task_id, epoch=h.lease_epoch, expected_seq=h.head_seq,
                      prev_hash=h.head_hash,
                      events=[ev.MessageAppended(role="user", content=h.task_id)])
        for h in heads])
    assert isinstance(results["g-1"], InvalidInput), results
    for task_id in ("g-0", "g-2"):
        assert not isinstance(results[task_id], Exception), results
        assert (await store.read_head(task_id)).head_seq == 3
        assert (await store.verify_task(task_id)).ok
    assert (await store.read_head("g-1")).head_seq == 2
