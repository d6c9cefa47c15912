"""Hypothesis strategies for replay: valid task histories, and small agent programs.

``histories()`` walks the task state machine with a small model of its own (independent of
``replay.fold``) and draws, at each point, one of the events that may legally come next:
status moves, tool and LLM calls with results, failures, retries and escalations, messages,
journaled values, timers, signals, approvals, environment changes, plan updates, budget
trips and forks. Every history it draws folds without error.

``programs()`` draws agent programs for the journal tests: lists of operations whose
arguments may depend on the results of earlier calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from hypothesis import strategies as st

from replay.state import args_hash
from wal_engine import events as ev
from wal_engine.chain import GENESIS_HASH, event_hash
from wal_engine.state_machine import Status

Draw = Callable[[st.SearchStrategy[Any]], Any]

words: Final = st.sampled_from(["alpha", "beta", "gamma", "delta", "é", "日本", ""])
small_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000)
    | st.floats(allow_nan=False, allow_infinity=False, width=64) | words,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(words, children, max_size=3),
    max_leaves=6,
)
tools: Final = ("search", "fetch", "write_file")
models: Final = ("small", "large")
signals: Final = ("approve", "go")


class _Call:
    """A call the model has intended, as the generator remembers it."""

    def __init__(self, kind: str, call_id: str, name: str, hashed: str, idempotent: bool) -> None:
        self.kind = kind
        self.call_id = call_id
        self.name = name
        self.hashed = hashed
        self.idempotent = idempotent
        self.attempt = 1
        self.state = "pending"  # pending | uncertain | retrying | done


class _Model:
    """What the generator needs to know to draw a legal next event."""

    def __init__(self) -> None:
        self.status: Status = Status.QUEUED
        self.attempts = 0
        self.step = 0
        self.counter = 0
        self.calls: dict[str, _Call] = {}
        self.timers: list[str] = []
        self.waiting: tuple[str, str] | None = None  # ("timer", id) or ("signal", name)
        self.signal_ids = 0
        self.approvals: dict[str, tuple[str, str, bool | None]] = {}
        self.plan: dict[str, list[str]] = {}
        self.completed: list[str] = []

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter}"

    def open_calls(self, *states: str) -> list[_Call]:
        return [call for call in self.calls.values() if call.state in states]

    def ready_nodes(self) -> list[str]:
        return [node for node, deps in self.plan.items()
                if node not in self.completed and all(dep in self.completed for dep in deps)]

    def options(self, ending: bool) -> list[str]:
        """The moves legal now, repeated by weight; only terminal ones if ``ending``."""
        if ending:
            done = ["complete"] * 4 if self.status in (Status.RUNNING, Status.CHECKPOINTED) else []
            return [*done, "fail", "cancel"]
        common = ["budget", "forked", "graph"]
        if self.status is Status.QUEUED:
            return ["claim"] * 6 + common
        if self.status is Status.RESUMING:
            return ["resume"] * 6 + common
        if self.status is Status.WAITING:
            return ["wake"] * 6 + common
        leaving = ["timer", "await", "orphan", "release", *common]
        if self.status is Status.CHECKPOINTED:
            return ["step"] * 8 + leaving
        return self._running_options() + ["checkpoint"] * 3 + leaving

    def _running_options(self) -> list[str]:
        moves = ["message"] * 5 + ["tool"] * 4 + ["llm"] * 3 + ["value", "env", "plan",
                                                                 "signal", "ask"]
        if self.open_calls("pending", "uncertain"):
            moves += ["result"] * 8 + ["failure"] * 2
        if any(not c.idempotent and c.kind == "tool" for c in self.open_calls("pending")):
            moves.append("uncertain")
        if self.open_calls("retrying"):
            moves += ["retry"] * 3
        if self.timers:
            moves += ["fire"] * 2
        if any(d is None for _, _, d in self.approvals.values()):
            moves += ["decide"] * 2
        if any(d is True and c not in self.calls for c, (_, _, d) in self.approvals.items()):
            moves += ["approved_tool"] * 2
        if self.ready_nodes():
            moves += ["node"] * 2
        return moves


def _claim(m: _Model, draw: Draw) -> ev.Event:
    m.attempts += 1
    if m.status is Status.QUEUED:
        return ev.TaskClaimed(worker_id="w1", attempt=m.attempts)
    return ev.TaskResumed(worker_id=draw(st.sampled_from(["w1", "w2"])), attempt=m.attempts)


def _wake(m: _Model, draw: Draw) -> ev.Event:
    reason = "timer"
    if m.waiting is not None and m.waiting[0] == "signal":
        reason = draw(st.sampled_from(["signal", "timeout"]))
        if reason == "timeout":
            m.waiting = None
    return ev.TaskWoken(reason=reason)


def _tool(m: _Model, draw: Draw, call_id: str | None = None) -> ev.Event:
    if call_id is None:
        args = draw(small_values)
        tool, hashed = draw(st.sampled_from(tools)), args_hash(args)
        call_id = m.fresh("tool")
    else:
        tool, hashed, _ = m.approvals[call_id]
        args = None  # The approved hash is what counts; the args travel beside it.
    idempotent = draw(st.booleans()) if tool == "write_file" else True
    m.calls[call_id] = _Call("tool", call_id, tool, hashed, idempotent)
    return ev.ToolCallIntended(call_id=call_id, tool=tool, args=args, args_hash=hashed,
                               idempotency_key=f"idem:{call_id}", idempotent=idempotent)


def _llm(m: _Model, draw: Draw) -> ev.Event:
    request = {"prompt": draw(words), "n": draw(st.integers(0, 3))}
    call_id = m.fresh("llm")
    m.calls[call_id] = _Call("llm", call_id, draw(st.sampled_from(models)), args_hash(request),
                             True)
    return ev.LlmCallIntended(call_id=call_id, model=m.calls[call_id].name, request=request,
                              request_hash=args_hash(request), idempotency_key=f"idem:{call_id}")


def _result(m: _Model, draw: Draw) -> ev.Event:
    call = draw(st.sampled_from(m.open_calls("pending", "uncertain")))
    call.state = "done"
    if call.kind == "tool":
        return ev.ToolCallCompleted(call_id=call.call_id, result=draw(small_values))
    return ev.LlmCallCompleted(
        call_id=call.call_id, response={"text": draw(words)},
        input_tokens=draw(st.integers(0, 500)), output_tokens=draw(st.integers(0, 500)),
        cost_usd=draw(st.sampled_from([0.0, 0.001, 0.25])),
    )


def _failure(m: _Model, draw: Draw) -> ev.Event:
    call = draw(st.sampled_from(m.open_calls("pending", "uncertain")))
    retry = draw(st.booleans())
    call.state = "retrying" if retry else "done"
    cls = ev.ToolCallFailed if call.kind == "tool" else ev.LlmCallFailed
    return cls(call_id=call.call_id, attempt=call.attempt, error="boom", error_type="Boom",
               retryable=retry, retry_at_ms=1_000 * call.attempt if retry else None)


def _retry(m: _Model, draw: Draw) -> ev.Event:
    call = draw(st.sampled_from(m.open_calls("retrying")))
    call.state, call.attempt = "pending", call.attempt + 1
    if call.kind == "tool":
        return ev.ToolCallIntended(call_id=call.call_id, tool=call.name, args_hash=call.hashed,
                                   idempotency_key=f"idem:{call.call_id}",
                                   idempotent=call.idempotent, attempt=call.attempt)
    return ev.LlmCallIntended(call_id=call.call_id, model=call.name, request_hash=call.hashed,
                              idempotency_key=f"idem:{call.call_id}", attempt=call.attempt)


def _uncertain(m: _Model, draw: Draw) -> ev.Event:
    candidates = [c for c in m.open_calls("pending") if c.kind == "tool" and not c.idempotent]
    call = draw(st.sampled_from(candidates))
    call.state = "uncertain"
    return ev.ToolCallUncertain(call_id=call.call_id, policy="escalate")


def _timer(m: _Model, draw: Draw) -> ev.Event:
    timer_id = m.fresh("timer")
    m.timers.append(timer_id)
    m.waiting = ("timer", timer_id)
    duration = draw(st.integers(0, 10_000))
    return ev.TimerStarted(timer_id=timer_id, wake_at_ms=1_700_000_000_000 + duration,
                           duration_ms=duration)


def _fire(m: _Model, draw: Draw) -> ev.Event:
    timer_id = draw(st.sampled_from(m.timers))
    m.timers.remove(timer_id)
    return ev.TimerFired(timer_id=timer_id)


def _await(m: _Model, draw: Draw) -> ev.Event:
    name = draw(st.sampled_from(signals))
    m.waiting = ("signal", name)
    return ev.SignalAwaited(name=name, timeout_ms=draw(st.none() | st.integers(1, 5000)))


def _signal(m: _Model, draw: Draw) -> ev.Event:
    m.signal_ids += 1
    name = draw(st.sampled_from(signals))
    if m.waiting == ("signal", name):
        m.waiting = None
    return ev.SignalReceived(name=name, payload=draw(small_values), signal_id=m.signal_ids)


def _ask(m: _Model, draw: Draw) -> ev.Event:
    call_id = m.fresh("tool")
    tool, hashed = draw(st.sampled_from(tools)), args_hash(draw(small_values))
    m.approvals[call_id] = (tool, hashed, None)
    return ev.ApprovalRequested(call_id=call_id, tool=tool, args_hash=hashed,
                                signal_name="approve")


def _decide(m: _Model, draw: Draw) -> ev.Event:
    undecided = [c for c, (_, _, d) in m.approvals.items() if d is None]
    call_id = draw(st.sampled_from(undecided))
    tool, hashed, _ = m.approvals[call_id]
    approved = draw(st.booleans())
    m.approvals[call_id] = (tool, hashed, approved)
    return ev.ApprovalDecided(call_id=call_id, approved=approved, approver="ops",
                              args_hash=hashed)


def _approved_tool(m: _Model, draw: Draw) -> ev.Event:
    approved = [c for c, (_, _, d) in m.approvals.items() if d is True and c not in m.calls]
    return _tool(m, draw, draw(st.sampled_from(approved)))


def _plan(m: _Model, draw: Draw) -> ev.Event:
    nodes: list[ev.PlanNode] = []
    known = list(m.completed)
    for _ in range(draw(st.integers(0, 4))):
        node_id = m.fresh("node")
        deps = draw(st.lists(st.sampled_from(known), max_size=2, unique=True)) if known else []
        nodes.append(ev.PlanNode(node_id=node_id, action={"do": node_id}, depends_on=deps))
        known.append(node_id)
    m.plan = {node.node_id: list(node.depends_on) for node in nodes}
    return ev.PlanUpdated(nodes=nodes)


def _node(m: _Model, draw: Draw) -> ev.Event:
    node_id = draw(st.sampled_from(m.ready_nodes()))
    m.completed.append(node_id)
    return ev.PlanNodeCompleted(node_id=node_id)


def _status_move(m: _Model, draw: Draw, name: str) -> ev.Event:
    moves: dict[str, Callable[[], ev.Event]] = {
        "checkpoint": lambda: ev.StepCheckpointed(step=m.step, next_action={"after": m.step}),
        "step": lambda: ev.StepStarted(step=m.step + 1),
        "orphan": lambda: ev.TaskOrphaned(previous_owner="w1", previous_epoch=m.attempts),
        "release": lambda: ev.TaskReleased(worker_id="w1"),
        "complete": lambda: ev.TaskCompleted(output=draw(small_values)),
        "fail": lambda: ev.TaskFailed(reason="gave up", error="E", diagnostic={"n": 1}),
        "cancel": lambda: ev.TaskCancelled(requested_by="ops"),
    }
    event = moves[name]()
    if name == "step":
        m.step += 1
    return event


_moves: Final[dict[str, Callable[[_Model, Draw], ev.Event]]] = {
    "claim": _claim, "resume": _claim, "wake": _wake, "tool": _tool, "llm": _llm,
    "result": _result, "failure": _failure, "retry": _retry, "uncertain": _uncertain,
    "timer": _timer, "fire": _fire, "await": _await, "signal": _signal, "ask": _ask,
    "decide": _decide, "approved_tool": _approved_tool, "plan": _plan, "node": _node,
    "message": lambda m, draw: ev.MessageAppended(role=draw(st.sampled_from(["user", "ai"])),
                                                  content=draw(small_values)),
    "value": lambda m, draw: ev.ValueRecorded(call_id=m.fresh("value"),
                                              kind=draw(st.sampled_from(["now", "random"])),
                                              value=draw(st.integers(0, 10**12))),
    "env": lambda m, draw: ev.EnvironmentSet(
        values=draw(st.dictionaries(st.sampled_from(["A", "B", "C"]), st.none() | words,
                                    max_size=2))),
    "budget": lambda m, draw: ev.BudgetExceeded(budget="max_steps", limit=10.0, used=11.0),
    "forked": lambda m, draw: ev.TaskForked(parent_task_id="parent", parent_seq=3),
    "graph": lambda m, draw: ev.GraphCheckpointSaved(checkpoint_id=m.fresh("ckpt"),
                                                     checkpoint={"v": 1}),
}


@st.composite
def histories(draw: Draw, max_events: int = 60) -> list[tuple[int, ev.Event]]:
    """A valid history: ``(seq, event)`` pairs from seq 1, possibly ending terminal."""
    model = _Model()
    events: list[ev.Event] = [ev.TaskSubmitted(
        agent="agent", input=draw(small_values),
        budget=ev.Budget(max_steps=draw(st.none() | st.integers(1, 100))),
    )]
    length = draw(st.integers(0, max_events))
    for index in range(length + 1):
        ending = index == length
        if ending and not draw(st.booleans()):
            break
        name = draw(st.sampled_from(model.options(ending)))
        move = _moves.get(name)
        event = move(model, draw) if move else _status_move(model, draw, name)
        target = type(event).TARGET_STATUS
        if target is not None:
            model.status = target
        events.append(event)
    return list(enumerate(events, start=1))


def chained(task_id: str, history: list[tuple[int, ev.Event]]) -> list[tuple[int, ev.Event, bytes]]:
    """The same history with the chain hashes a store would compute (epoch 0)."""
    out: list[tuple[int, ev.Event, bytes]] = []
    previous = GENESIS_HASH
    for seq, event in history:
        kind, version, payload = ev.encode_event(event)
        previous = event_hash(previous, task_id, seq, kind, version, 0, payload)
        out.append((seq, event, previous))
    return out


# ----------------------------------------------------------------------------- programs

Operation = tuple[str, str, Any]
"""``(kind, name, argument)``: kind is tool, llm, value, message or checkpoint."""

operations: st.SearchStrategy[Operation] = st.one_of(
    st.tuples(st.just("tool"), st.sampled_from(tools), small_values),
    st.tuples(st.just("llm"), st.sampled_from(models), words),
    st.tuples(st.just("value"), st.sampled_from(["now", "random"]), st.none()),
    st.tuples(st.just("message"), st.just("assistant"), words),
    st.tuples(st.just("checkpoint"), st.just(""), st.none()),
)


def programs(max_operations: int = 12) -> st.SearchStrategy[list[Operation]]:
    """Agent programs: lists of operations run in order by a test runtime."""
    return st.lists(operations, min_size=1, max_size=max_operations)
