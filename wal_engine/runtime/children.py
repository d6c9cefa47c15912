"""Child tasks: ``ctx.spawn``, ``handle.result()``, ``ctx.gather`` (issue 24).

A spawn is journaled like a clock reading: the value ``spawn:<agent>`` records the child's
id. The child's id is derived from the parent's id and the spawn's call id
(``<parent>:child:<call id>``), so the same spawn always names the same child, and the
child is created idempotently before the value is recorded: a parent that crashes between
the two re-runs the spawn, finds its child already there, and records it then. Replay
answers the spawn from the log and creates nothing.

A child's row names its parent (``parent_task_id``, no fork seq). The child's terminal
move puts the internal signal ``~child:<child id>`` in its parent's inbox in the same
transaction (``wal_task_ended`` in ``schema.sql``), waking the parent if it waits for it.
``handle.result()`` reads the child's status first: an ended child's outcome is recorded
at once (the value ``child:<child id>``), otherwise the parent waits durably for that
signal (WAITING, lease dropped) and reads it again when woken. The outcome is a recorded
value, so a re-run gets the same answer without asking the database.

Budgets propagate by policy (``budget_policy``). ``share`` (the default): the child's
steps, tokens, cost and tool-call limits are capped at spawn by what its parent has left
of each, and when the parent records the child's outcome the value carries the child's
spend (``charge``, folded from the child's log, its own ``share`` children included),
which the parent's fold adds to ``children_spend``: its budget counts it from then on, the
same on every replay, once. ``own``: the child's budget is only its own ``budget=`` and
the parent is charged nothing.

Checks happen before anything is journaled or written: an unknown agent, a bad input, an
explicit id that is the task itself or one of its ancestors (a cycle), an id taken by
another task, too many children. A task of another tenant is invisible to row security:
asking for a handle of one is :class:`~wal_engine.errors.UnknownTask`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec

from replay.state import CHILD_VALUE_PREFIX, CallKind, total_spend
from wal_engine import events as ev
from wal_engine import failpoints
from wal_engine.budgets import BudgetTrip, validate_budget
from wal_engine.errors import (
    CapExceeded,
    ChildTaskFailed,
    InvalidInput,
    NotAChild,
    TaskAlreadyExists,
    TaskCycle,
    UnknownAgent,
    UnknownTask,
)
from wal_engine.ids import validate_task_id
from wal_engine.runtime.control import CHILD_SIGNAL_PREFIX
from wal_engine.runtime.steps import take_signal, wait_signal
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.store import queries

if TYPE_CHECKING:
    from wal_engine.runtime.ports import Run

ParentEndPolicy = Literal["cancel", "abandon"]
SPAWN_VALUE_PREFIX: Final = "spawn:"
"""The journal name of a spawn (then the child's agent); its value names the child."""
BudgetPolicy = Literal["share", "own"]
BUDGET_POLICIES: Final = ("share", "own")
SHARED_LIMITS: Final = ("max_steps", "max_tokens", "max_cost_usd", "max_tool_calls")
"""The limits a ``share`` child is capped by and charges its parent for (its runtime
overlaps its parent's, which the parent's own clock counts; attempts are its own)."""
children_max: Final = 500
"""Children one task may spawn: each child's ending is a signal in its parent's inbox,
which holds at most 1000 (schema.sql, signals_per_task)."""
ancestors_max: Final = 64
"""Depth of the parent chain walked to refuse a cycle."""
task_id_length_max: Final = 128


class ChildHandle:
    """A child task spawned by this task (``ctx.spawn``), or found by ``ctx.child``."""

    def __init__(self, run: Run, task_id: str, result: Any) -> None:
        self._run = run
        self._task_id = task_id
        self._result = result

    @property
    def task_id(self) -> str:
        """The child's task id."""
        return self._task_id

    async def result(self) -> Any:
        """Wait durably until the child ends; return its output.

        Raises:
            ChildTaskFailed: the child ended FAILED or was cancelled.
        """
        return await self._result(self._task_id)

    def __repr__(self) -> str:
        return f"ChildHandle({self._task_id!r})"


def child_task_id(parent_task_id: str, call_id: str) -> str:
    """The id of the child a spawn names: ``<parent>:child:<call id>``, or, when that would
    pass the id's length bound, the parent's part as a digest (the same on every run)."""
    derived = f"{parent_task_id}:child:{call_id}"
    if len(derived) <= task_id_length_max:
        return derived
    digest = hashlib.sha256(parent_task_id.encode()).hexdigest()[:40]
    return f"child-{digest}:{call_id}"


def plain_child_input(run: Run, agent: str, input: Any) -> tuple[Any, str | None]:
    """``input`` checked against the registered ``agent``'s input type, as plain JSON, and
    the agent's version.

    Raises:
        UnknownAgent: this engine has no agent of that name.
        InvalidInput: the input does not convert to the agent's input type.
    """
    definition = run.services.agents.get(agent) if isinstance(agent, str) else None
    if definition is None:
        raise UnknownAgent(str(agent))
    input_type = definition.input_type
    if input_type is None:
        return input, definition.version
    try:
        typed = msgspec.convert(input, input_type)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"input for agent {agent!r} is invalid: {error}") from error
    return msgspec.to_builtins(typed), definition.version


async def read_task(run: Run, task_id: str) -> Any:
    """The row of ``task_id`` in this tenant (another tenant's is invisible), or None."""
    return await run.services.database.fetchrow(queries.READ_CHILD, task_id, task_id=task_id)


async def check_not_ancestor(run: Run, awaited: str) -> None:
    """Refuse ``awaited`` if it is this task or one of its ancestors (a wait for ever).

    Raises:
        TaskCycle: it is.
    """
    current: str | None = run.task_id
    for _ in range(ancestors_max):
        if current is None:
            return
        if current == awaited:
            raise TaskCycle(run.task_id, awaited)
        row = await read_task(run, current)
        if row is None or row["parent_seq"] is not None:
            return  # A fork's parent is not waited for.
        current = row["parent_task_id"]


def spawned_count(run: Run) -> int:
    """Children this task has spawned so far (its recorded spawns)."""
    return sum(1 for call in run.view.calls.values()
               if call.kind is CallKind.VALUE and call.name.startswith(SPAWN_VALUE_PREFIX))


async def check_replayed_spawn(run: Run, agent: str, input: Any, task_id: str | None,
                               budget: ev.Budget | None, on_parent_end: str,
                               budget_policy: str) -> tuple[Any, str | None]:
    """The checks of a spawn that give the same answer on every run of the task's code
    (its policies, budget, agent, input and id, and the ancestry, which never changes): a re-run
    makes them again before the journal answers, so a spawn refused on the first run is
    refused again at the same point, not matched against the next recorded call.

    Raises:
        UnknownAgent, InvalidInput, TaskCycle.
    """
    if on_parent_end not in ("cancel", "abandon"):
        raise InvalidInput(f"on_parent_end must be 'cancel' or 'abandon', not {on_parent_end!r}")
    if budget_policy not in BUDGET_POLICIES:
        raise InvalidInput(f"budget_policy must be 'share' or 'own', not {budget_policy!r}")
    if budget is not None:
        if not isinstance(budget, ev.Budget):
            raise InvalidInput(f"budget must be a Budget, not {type(budget).__name__}")
        validate_budget(budget)
    plain, version = plain_child_input(run, agent, input)
    if task_id is not None:
        validate_task_id(task_id)
        await check_not_ancestor(run, task_id)
    return plain, version


async def check_spawn(run: Run, agent: str, input: Any, task_id: str | None,
                      budget: ev.Budget | None, on_parent_end: str,
                      budget_policy: str) -> tuple[Any, str | None]:
    """Every check of a new spawn, before anything is journaled: its plain input and the
    agent's version.

    Raises:
        UnknownAgent, InvalidInput, TaskCycle, TaskAlreadyExists, CapExceeded.
    """
    plain, version = await check_replayed_spawn(run, agent, input, task_id, budget,
                                                on_parent_end, budget_policy)
    if spawned_count(run) >= children_max:
        raise CapExceeded("children_per_task", f"a task spawns at most {children_max} children")
    if task_id is not None:
        row = await read_task(run, task_id)
        if row is not None and not _child_of(row, run.task_id):
            raise TaskAlreadyExists(task_id)
    return plain, version


def shared_budget(run: Run, budget: ev.Budget | None) -> ev.Budget | BudgetTrip | None:
    """The budget of a ``share`` child: each limit of :data:`SHARED_LIMITS` the parent sets
    is capped by what the parent has left of it now (its own spend and its ``share``
    children's charged so far, all from its log: a re-run of the spawn computes the same);
    the child's other limits are its own. A limit the parent has used up is the trip the
    spawn fails the parent with, as a call would."""
    parent = run.view.budget
    used = run.usage()
    limits: dict[str, Any] = {} if budget is None else {
        name: getattr(budget, name) for name in budget.__struct_fields__}
    for name in SHARED_LIMITS:
        limit = getattr(parent, name)
        if limit is None:
            continue
        spent = getattr(used, name.removeprefix("max_"))
        left = limit - spent
        if left <= 0:
            return BudgetTrip(budget=name, limit=float(limit), used=float(spent))
        own = limits.get(name)
        limits[name] = left if own is None else min(own, left)
    capped = ev.Budget(**limits)
    return budget if capped == (budget or ev.Budget()) else capped


def spawn_policy(run: Run, child: str) -> str:
    """The budget policy the spawn of ``child`` recorded (``own`` for a spawn recorded
    without one, as every spawn was before policies existed)."""
    for call in run.view.calls.values():
        if call.kind is CallKind.VALUE and call.name.startswith(SPAWN_VALUE_PREFIX) \
                and isinstance(call.result, dict) and call.result.get("task_id") == child:
            return str(call.result.get("budget_policy", "own"))
    return "own"


def charged_already(run: Run, child: str) -> bool:
    """Whether an outcome of ``child`` recorded earlier (a second ``result()``) charged
    its spend: a child is charged once."""
    name = f"{CHILD_VALUE_PREFIX}{child}"
    return any(call.kind is CallKind.VALUE and call.name == name
               and isinstance(call.result, dict) and "charge" in call.result
               for call in run.view.calls.values())


async def start_child(run: Run, call_id: str, agent: str, input: Any, *,
                      task_id: str | None, budget: ev.Budget | None, version: str | None,
                      on_parent_end: str, budget_policy: str) -> str:
    """Create the child (idempotently), then record the spawn and its budget policy (a
    spawn recorded without one is ``own``); the child's id."""
    child = task_id or child_task_id(run.task_id, call_id)
    await run.services.store.create_child_task(
        child, agent, parent_task_id=run.task_id, input=input, budget=budget,
        agent_version=version, on_parent_end=on_parent_end)
    failpoints.hit("after_child_submit")
    value: dict[str, Any] = {"task_id": child}
    if budget_policy != "own":
        value["budget_policy"] = budget_policy
    await run.append([ev.ValueRecorded(call_id=call_id, kind=f"{SPAWN_VALUE_PREFIX}{agent}",
                                       value=value)])
    run.log.info("child_spawned", child_task_id=child, agent=agent, budget_policy=budget_policy)
    return child


async def handle_of(run: Run, task_id: str) -> str:
    """Check that ``task_id`` is a child of this task (for ``ctx.child``).

    Raises:
        UnknownTask: no such task in this tenant.
        TaskCycle: it is this task or an ancestor of it.
        NotAChild: it is another task.
    """
    validate_task_id(task_id)
    await check_not_ancestor(run, task_id)
    row = await read_task(run, task_id)
    if row is None:
        raise UnknownTask(task_id)
    if not _child_of(row, run.task_id):
        raise NotAChild(run.task_id, task_id)
    return task_id


async def child_outcome(run: Run, child: str, *, charge: bool) -> dict[str, Any]:
    """The child's outcome once it has ended, as the parent records it; waits durably
    (raises ``Suspended``) while it runs. With ``charge``, the outcome holds the child's
    spend (``charge``: its own and its ``share`` children's, folded from its log, which
    no longer changes), which the parent's fold adds to its budget's usage."""
    signal = f"{CHILD_SIGNAL_PREFIX}{child}"
    row = await read_task(run, child)
    if row is None:
        raise UnknownTask(child)
    if Status(row["status"]) not in TERMINAL:
        # Delivered at once if the child ended since the read; otherwise the task waits
        # (its lease dropped) until the child's ending signals it.
        await wait_signal(run, signal, None)
        row = await read_task(run, child)
        if row is None or Status(row["status"]) not in TERMINAL:
            raise UnknownTask(child)  # A signal of a child not ended: cannot happen.
    else:
        # Consume the ending's wake-up, so that no wait later on finds it in the inbox.
        await take_signal(run, signal)
    from wal_engine.runtime.resume import resume

    state = await resume(run.services.store, child)
    extra: dict[str, Any] = {}
    if charge:
        extra["charge"] = msgspec.to_builtins(total_spend(state))
    if state.status is Status.COMPLETED:
        return {"task_id": child, "status": "COMPLETED", "output": state.output, **extra}
    failure = state.failure
    return {"task_id": child, "status": "FAILED",
            "reason": "failed" if failure is None else failure.reason,
            "error": None if failure is None else failure.error,
            "cancelled": False if failure is None else failure.cancelled, **extra}


def outcome_value(value: Any) -> Any:
    """What ``handle.result()`` gives for a recorded outcome: the output, or the failure
    raised as :class:`ChildTaskFailed`."""
    if value.get("status") == "COMPLETED":
        return value.get("output")
    raise ChildTaskFailed(str(value.get("task_id")), str(value.get("reason")),
                          value.get("error"), cancelled=bool(value.get("cancelled")))


async def gather(handles: Iterable[ChildHandle], *, return_exceptions: bool = False
                 ) -> list[Any]:
    """The results of ``handles`` in order (fan-in). The task waits for each in turn: the
    children run meanwhile all the same, and a child that ended while the task waited for
    another is read without a wait."""
    results: list[Any] = []
    for handle in handles:
        try:
            results.append(await handle.result())
        except ChildTaskFailed as failed:
            if not return_exceptions:
                raise
            results.append(failed)
    return results


def _child_of(row: Any, parent: str) -> bool:
    return bool(row["parent_task_id"] == parent and row["parent_seq"] is None)
