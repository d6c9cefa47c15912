"""The journal under crashes: generated agent programs re-run after a crash at any point.

A tiny runtime runs an agent program (``tests.strategies.programs``) the way the engine
does: write ahead, act, record; after a crash it folds the log, resumes the task and runs
the program again from the top, asking the journal before every external call. The world
counts every invocation of an external function and deduplicates on the idempotency key,
as a well-behaved callee would.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from replay import (
    AgentState,
    CallStatus,
    Fresh,
    InDoubt,
    Journal,
    NonDeterminismError,
    Recorded,
    args_hash,
    fold,
)
from tests.strategies import Operation, programs
from wal_engine import events as ev
from wal_engine.state_machine import LEASED, TERMINAL, Status

TASK = "task-1"
CALL_KINDS = ("tool", "llm", "value")


class Crash(Exception):
    """The process died before an append reached the log."""


class World:
    """External functions: deterministic, deduplicating on the idempotency key."""

    def __init__(self) -> None:
        self.invocations = 0
        self.effects: dict[str, Any] = {}

    def invoke(self, kind: str, name: str, request: Any, key: str) -> Any:
        self.invocations += 1
        if key not in self.effects:
            self.effects[key] = {"by": name, "echo": request}
        return self.effects[key]

    def draw(self, call_id: str) -> str:
        """A clock or random reading; a draw lost in a crash is drawn again at the same place
        with the same result, so that a crash-free run and a crashed one can be compared (the
        invocation count still shows every redraw)."""
        self.invocations += 1
        return _digest(call_id)


def _digest(value: Any) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:12]


class Runtime:
    """Runs a program against a log, appending to it until ``appends_left`` runs out."""

    def __init__(self, log: list[ev.Event], world: World, appends_left: int | None) -> None:
        self.log = log
        self.world = world
        self.appends_left = appends_left
        self.status: Status | None = fold(self._numbered(), task_id=TASK).status
        self.checkpoints = 0

    def _numbered(self) -> list[tuple[int, ev.Event]]:
        return list(enumerate(self.log, start=1))

    def append(self, event: ev.Event) -> None:
        assert self.status not in TERMINAL, "a finished history was appended to"
        moves = type(event).TARGET_STATUS
        if self.status is Status.CHECKPOINTED and moves in (None, Status.CHECKPOINTED):
            self.append(ev.StepStarted(step=self.checkpoints))
        if self.appends_left is not None:
            if self.appends_left == 0:
                raise Crash
            self.appends_left -= 1
        self.log.append(event)
        self.status = type(event).TARGET_STATUS or self.status

    def run(self, program: list[Operation]) -> None:
        state = fold(self._numbered(), task_id=TASK)
        self._take_over(state)
        journal = Journal.from_state(state)
        recorded_messages = [m.content for m in state.messages]
        recorded_checkpoints = sum(isinstance(e, ev.StepCheckpointed) for e in self.log)
        messages = 0
        last: Any = None
        for kind, name, argument in program:
            if kind == "checkpoint":
                if self.checkpoints >= recorded_checkpoints:
                    self.append(ev.StepCheckpointed(step=self.checkpoints,
                                                    next_action={"after": _digest(last)}))
                self.checkpoints += 1
                continue
            if kind == "message":
                content = argument
                if messages < len(recorded_messages):
                    assert recorded_messages[messages] == content
                else:
                    self.append(ev.MessageAppended(role=name, content=content))
                messages += 1
                continue
            last = self._call(journal, kind, name, {"arg": argument, "prev": _digest(last)})
        journal.finish()
        if self.status not in TERMINAL:
            self.append(ev.TaskCompleted(output=_digest(last)))

    def _take_over(self, state: AgentState) -> None:
        """Claim the task, or resume it from whoever held it when the process died."""
        if state.status is Status.QUEUED:
            self.append(ev.TaskClaimed(worker_id="w", attempt=state.attempts + 1))
        elif state.status in LEASED or state.status is Status.RESUMING:
            if state.status in LEASED:
                self.append(ev.TaskOrphaned(previous_owner="w"))
            self.append(ev.TaskResumed(worker_id="w", attempt=state.attempts + 1))

    def _call(self, journal: Journal, kind: str, name: str, request: Any) -> Any:
        hashed = "" if kind == "value" else args_hash(request)
        outcome = journal.next_call(kind, name, hashed)
        if isinstance(outcome, Recorded):
            return outcome.result
        if kind == "value":
            assert isinstance(outcome, Fresh), "a value is never in doubt"
            value = self.world.draw(outcome.call_id)
            self.append(ev.ValueRecorded(call_id=outcome.call_id, kind=name, value=value))
            return value
        if isinstance(outcome, InDoubt):
            call_id, key = outcome.call_id, outcome.idempotency_key
            assert key is not None
        else:
            assert isinstance(outcome, Fresh)
            call_id, key = outcome.call_id, f"idem:{TASK}:{outcome.call_id}"
            self.append(self._intent(kind, call_id, name, request, hashed, key))
        result = self.world.invoke(kind, name, request, key)
        if kind == "tool":
            self.append(ev.ToolCallCompleted(call_id=call_id, result=result))
        else:
            self.append(ev.LlmCallCompleted(call_id=call_id, response=result, input_tokens=7,
                                            output_tokens=3, cost_usd=0.5))
        return result

    @staticmethod
    def _intent(kind: str, call_id: str, name: str, request: Any, hashed: str,
                key: str) -> ev.Event:
        if kind == "tool":
            return ev.ToolCallIntended(call_id=call_id, tool=name, args=request,
                                       args_hash=hashed, idempotency_key=key)
        return ev.LlmCallIntended(call_id=call_id, model=name, request=request,
                                  request_hash=hashed, idempotency_key=key)


def _outcome_view(state: AgentState) -> tuple[Any, ...]:
    """What a crash must not change: status, messages, call outcomes, usage, output."""
    calls = [(r.call_id, r.kind, r.name, r.args_hash, r.status, r.result)
             for r in state.calls.values()]
    messages = [(m.role, m.content) for m in state.messages]
    return (state.status, messages, calls, state.usage, state.output, state.next_action)


def _calls_in(program: list[Operation]) -> int:
    return sum(kind in CALL_KINDS for kind, _, _ in program)


def _committed(log: list[ev.Event]) -> int:
    state = fold(list(enumerate(log, start=1)), task_id=TASK)
    return sum(r.status is CallStatus.COMPLETED for r in state.calls.values())


def _reference(program: list[Operation]) -> list[ev.Event]:
    log: list[ev.Event] = [ev.TaskSubmitted(agent="agent")]
    Runtime(log, World(), None).run(program)
    return log


def _recover(program: list[Operation], crashes: list[int]) -> list[ev.Event]:
    """Run ``program`` through crashes after the given numbers of appends, then to the end,
    checking that each run invokes only calls the log holds no result for."""
    log: list[ev.Event] = [ev.TaskSubmitted(agent="agent")]
    world = World()
    for appends_left in [*crashes, None]:
        uncommitted = _calls_in(program) - _committed(log)
        before = world.invocations
        try:
            Runtime(log, world, appends_left).run(program)
        except Crash:
            assert world.invocations - before <= uncommitted
            continue
        assert world.invocations - before == uncommitted
        break
    assert len(world.effects) == sum(kind in ("tool", "llm") for kind, _, _ in program)
    return log


@given(programs())
def test_journal_skips_exactly_the_committed_calls(program: list[Operation]) -> None:
    """After a crash at any point, the re-run invokes only the calls without a recorded
    result, and ends in the crash-free run's state."""
    reference_log = _reference(program)
    reference = _outcome_view(fold(list(enumerate(reference_log, 1)), task_id=TASK))
    for crash in range(len(reference_log) + 1):
        log = _recover(program, [crash])
        assert _outcome_view(fold(list(enumerate(log, 1)), task_id=TASK)) == reference


@given(programs(), st.data())
def test_journal_survives_repeated_crashes(program: list[Operation], data: st.DataObject) -> None:
    """Several crashes in a row (a crash during recovery included) change nothing either."""
    reference_log = _reference(program)
    points = st.integers(0, len(reference_log))
    crashes = data.draw(st.lists(points, min_size=2, max_size=4), label="crashes")
    log = _recover(program, crashes)
    assert _outcome_view(fold(list(enumerate(log, 1)), task_id=TASK)) == _outcome_view(
        fold(list(enumerate(reference_log, 1)), task_id=TASK))


def _call_positions(program: list[Operation]) -> list[int]:
    return [index for index, (kind, _, _) in enumerate(program) if kind in CALL_KINDS]


@st.composite
def divergences(draw: Any) -> tuple[list[Operation], list[Operation], str, int]:
    """A program, a mutated copy, the kind of mutation and the call index it touches."""
    program = draw(programs().filter(lambda p: any(k in ("tool", "llm") for k, _, _ in p)))
    positions = _call_positions(program)
    mutation = draw(st.sampled_from(["other_name", "other_args", "fewer", "more"]))
    changed = list(program)
    if mutation == "fewer":
        del changed[positions[-1]]
        return program, changed, mutation, len(positions) - 1
    if mutation == "more":
        changed.append(("tool", "search", "extra"))
        return program, changed, mutation, len(positions)
    # A journaled value has no arguments: only its name can change.
    candidates = [i for i in positions if program[i][0] != "value" or mutation == "other_name"]
    target = draw(st.sampled_from(candidates))
    kind, name, argument = program[target]
    if mutation == "other_name":
        name = {"tool": "never_used", "llm": "other_model", "value": "other_value"}[kind]
    else:
        argument = {"changed": argument}
    changed[target] = (kind, name, argument)
    return program, changed, mutation, positions.index(target)


@given(divergences())
def test_every_kind_of_nondeterminism_is_caught(
    case: tuple[list[Operation], list[Operation], str, int],
) -> None:
    """Other name, other args, fewer or more calls against a finished history raise
    NonDeterminismError at the right call, seq and fork point; forking there lets the
    changed program finish."""
    program, changed, mutation, call_index = case
    log = _reference(program)
    state = fold(list(enumerate(log, 1)), task_id=TASK)
    try:
        Runtime(list(log), World(), 0).run(changed)
    except NonDeterminismError as error:
        divergence = error
    else:
        raise AssertionError(f"{mutation} was not detected")
    assert divergence.call_index == call_index
    assert divergence.fork_point == divergence.seq - 1
    if mutation == "more":
        assert divergence.recorded is None and divergence.seq == state.last_seq
    else:
        record = list(state.calls.values())[call_index]
        assert divergence.seq == record.seq and divergence.recorded is not None
        assert divergence.recorded.name == record.name
        assert (divergence.requested is None) == (mutation == "fewer")
    _fork_and_finish(log, divergence.fork_point, changed)


def _fork_and_finish(log: list[ev.Event], fork_point: int, program: list[Operation]) -> None:
    """The changed program completes on the prefix up to the fork point."""
    child = [msgspec.structs.replace(log[0], parent_task_id=TASK, parent_seq=fork_point),
             *log[1:fork_point], ev.TaskForked(parent_task_id=TASK, parent_seq=fork_point)]
    status = fold(list(enumerate(child, 1)), task_id="child").status
    if status in LEASED:
        child.append(ev.TaskReleased(reason="forked"))
    Runtime(child, World(), None).run(program)
    assert fold(list(enumerate(child, 1)), task_id="child").status is Status.COMPLETED
