"""The agent context (``ctx``): every command agent code may issue, written ahead.

External calls (tools, LLM calls, clock and random values, durable sleeps, signal waits) are
matched against the journal: a recorded outcome is returned without calling anything; an
in-doubt call is retried with its recorded idempotency key when the tool is idempotent, and
escalated otherwise; a new call records its intent, commits, and only then acts. Messages,
checkpoints, environment and plan changes are matched by their ordinal among commands of
their kind, so a re-run never writes them twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar, overload

import msgspec

from replay.divergence import CallSignature, NonDeterminismError
from replay.journal import Fresh, InDoubt, Outcome, Recorded
from replay.state import CHILD_VALUE_PREFIX, AgentState, CallKind, args_hash
from wal_engine import events as ev
from wal_engine import failpoints
from wal_engine.budgets import BudgetTrip
from wal_engine.clock import now_ms
from wal_engine.effects.gateway import Claim
from wal_engine.errors import CallTimedOut as CallTimedOut
from wal_engine.errors import InvalidInput, WalError
from wal_engine.errors import SignalTimeout as SignalTimeout
from wal_engine.errors import ToolError as ToolError
from wal_engine.retries import DEFAULT_POLICY, LeaseExpired, RetryPolicy
from wal_engine.runtime.calls import CallDriver, LlmSpec, ToolSpec, decide_approval
from wal_engine.runtime.children import (
    SPAWN_VALUE_PREFIX,
    BudgetPolicy,
    ChildHandle,
    ParentEndPolicy,
    charged_already,
    check_replayed_spawn,
    check_spawn,
    child_outcome,
    gather,
    handle_of,
    outcome_value,
    shared_budget,
    spawn_policy,
    start_child,
)
from wal_engine.runtime.control import (
    INTERNAL_PREFIX,
    Suspended,
    current_call_claim,
    lease_check,
)
from wal_engine.runtime.limiters import CallLimit, checked_tokens
from wal_engine.runtime.limiters import checked_name as checked_limiter
from wal_engine.runtime.steps import LlmResponse as LlmResponse
from wal_engine.runtime.steps import recorded_value, wait_signal

if TYPE_CHECKING:
    from wal_engine.runtime.ports import Run

UncertainPolicy = Literal["fail", "wait"]
T = TypeVar("T")
R = TypeVar("R")
error_text_max: Final = 2000
approval_value_prefix: Final = "approval:"
"""The journal name of a decision asked for with :meth:`AgentContext.approval` (then the
name of what was to be approved)."""


class ApprovalDecision(msgspec.Struct, frozen=True, kw_only=True):
    """A human's answer to :meth:`AgentContext.approval`."""

    approved: bool
    approver: str
    comment: str | None = None
    args_hash: str
    """The hash of the arguments the decision is about."""



def current_call() -> Claim | None:
    """The call in flight in this coroutine or thread (its idempotency key and fencing
    epoch)."""
    return current_call_claim.get()


def lease_valid() -> bool:
    """Inside a tool: whether the worker can still trust its lease of the task, by its own
    clock and without a round trip (True outside a call)."""
    check = lease_check.get()
    return True if check is None else check()


def ensure_lease() -> None:
    """Inside a tool, right before its irreversible part: raise :class:`LeaseExpired` (a
    "did not act" error: the task's next owner makes the call, under the same key) if the
    worker can no longer trust its lease. A worker that was stopped (SIGSTOP, a VM pause)
    and continued finds its lease expired here. Only the callee refusing stale epochs
    (``ctx.epoch``) closes the gap of a worker stopped after this check."""
    if not lease_valid():
        claim = current_call_claim.get()
        key = "?" if claim is None else claim.key
        raise LeaseExpired(f"the lease of the call {key} can no longer be trusted")


class AgentContext:
    """What an agent function receives as ``ctx``."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._ordinals: dict[str, int] = {}
        self._patches: dict[str, bool] = {}

    # ------------------------------------------------------------------ inspection

    @property
    def task_id(self) -> str:
        """The task's id."""
        return self._run.task_id

    @property
    def state(self) -> AgentState:
        """The task's folded state as recorded so far (for inspection; branch on results)."""
        return self._run.state

    @property
    def env(self) -> dict[str, str]:
        """The task's own environment variables (set with :meth:`set_env`)."""
        return dict(self._run.view.env)

    @property
    def epoch(self) -> int:
        """The lease epoch of this run (the fencing token handed to tools)."""
        return self._run.epoch

    @property
    def worker_id(self) -> str:
        """The worker running this task."""
        return self._run.worker_id

    @property
    def idempotency_key(self) -> str | None:
        """The key of the call in flight, for the callee to deduplicate on."""
        claim = current_call_claim.get()
        return None if claim is None else claim.key

    @property
    def call_claim(self) -> Claim | None:
        """The call in flight as a gateway claim (key, owner, epoch)."""
        return current_call_claim.get()

    def lease_valid(self) -> bool:
        """Whether this worker can still trust its lease, by its own clock (no round trip)."""
        return self._run.lease_trusted()

    def ensure_lease(self) -> None:
        """Raise :class:`~wal_engine.retries.LeaseExpired` unless :meth:`lease_valid`: call
        it in a tool right before the part that must not happen twice."""
        if not self._run.lease_trusted():
            raise LeaseExpired(f"the lease of task {self._run.task_id} can no longer be trusted")

    # ------------------------------------------------------------------ external calls

    @overload
    async def tool(
        self, name: str, function: Callable[..., Any], args: Any = ..., *,
        result_type: type[R],
        idempotent: bool = ...,
        retry: RetryPolicy = ...,
        timeout_s: float | None = ...,
        approval: bool = ...,
        on_uncertain: UncertainPolicy = ...,
        lookup: Callable[[str], Awaitable[Any]] | None = ...,
        limiter: str | None = ...,
        limiter_tokens: int = ...,
    ) -> R: ...

    @overload
    async def tool(
        # An async function's result is what it returns once awaited: this overload must
        # come before the next, which would say the awaitable.
        self, name: str, function: Callable[..., Awaitable[T]], args: Any = ..., *,
        result_type: None = ...,
        idempotent: bool = ...,
        retry: RetryPolicy = ...,
        timeout_s: float | None = ...,
        approval: bool = ...,
        on_uncertain: UncertainPolicy = ...,
        lookup: Callable[[str], Awaitable[Any]] | None = ...,
        limiter: str | None = ...,
        limiter_tokens: int = ...,
    ) -> T: ...

    @overload
    async def tool(
        self, name: str, function: Callable[..., T], args: Any = ..., *,
        result_type: None = ...,
        idempotent: bool = ...,
        retry: RetryPolicy = ...,
        timeout_s: float | None = ...,
        approval: bool = ...,
        on_uncertain: UncertainPolicy = ...,
        lookup: Callable[[str], Awaitable[Any]] | None = ...,
        limiter: str | None = ...,
        limiter_tokens: int = ...,
    ) -> T: ...

    async def tool(
        self,
        name: str,
        function: Callable[..., Any],
        args: Any = None,
        *,
        result_type: Any = None,
        idempotent: bool = True,
        retry: RetryPolicy = DEFAULT_POLICY,
        timeout_s: float | None = None,
        approval: bool = False,
        on_uncertain: UncertainPolicy = "fail",
        lookup: Callable[[str], Awaitable[Any]] | None = None,
        limiter: str | None = None,
        limiter_tokens: int = 0,
    ) -> Any:
        """Call a tool, written ahead: intent committed, then ``function(args)``, then result.

        Args:
            name: The tool's stable name (matched on replay).
            function: Sync or async callable taking ``args``; inside it
                ``ctx.idempotency_key`` is the key to hand to the callee. A plain ``def``
                runs on the worker's thread pool, never on its event loop.
            args: Plain JSON arguments (matched on replay by a hash of their encoding).
            idempotent: Whether a retry with the same key is safe. A non-idempotent call is
                retried only after an error that says it did not act
                (:class:`~wal_engine.retries.DidNotAct`); any other failure, a timeout
                included, leaves it in doubt: its ``lookup`` is asked, else it is
                escalated per ``on_uncertain``, never re-run.
            retry: Attempts, backoff and which errors are transient.
            timeout_s: Per-attempt timeout, for sync functions too (their thread may still
                act after it: a timeout is transient only for an idempotent tool).
            approval: Wait for a human approval of this exact call before acting.
            on_uncertain: ``"fail"`` the task, or ``"wait"`` for a reconciliation signal.
            lookup: For an in-doubt call: ``await lookup(key)`` returns the callee's recorded
                result, or None if it never acted (then the call is made again).
            result_type: A type msgspec converts the result to (a Struct, a dataclass,
                ``list[int]``...), from the result as recorded, live and on replay alike.
            limiter: The name of a limiter (``engine.limiter``) every attempt takes a grant
                of before it acts, waiting for one if the limit is reached (see
                :meth:`llm`); raise :class:`~wal_engine.errors.RateLimited` from the
                function on a 429 to block the limiter until its Retry-After.
            limiter_tokens: The tokens each attempt counts under a limiter with a token
                limit (0: requests only).

        Returns:
            The tool's result (from the log on replay), of ``result_type`` if given.

        Raises:
            ToolError: the call failed for good.
            ResultTypeError: the result does not convert to ``result_type`` (recorded as
                the call's failure, not retried).
        """
        # The log records the redacted arguments and name, and replay matches on the hash
        # of the one and the redacted form of the other; the function gets the arguments as
        # given, with secret references resolved.
        limit = None if limiter is None else CallLimit(
            name=checked_limiter(limiter),
            tokens=checked_tokens(limiter, "limiter_tokens", limiter_tokens))
        stored_args = self._run.redact(args)
        hashed = args_hash(stored_args)
        outcome = await self._next(CallKind.TOOL, name, hashed)
        if isinstance(outcome, Recorded):
            return recorded_value(outcome, result_type)
        spec = ToolSpec(name=self._run.redact_name(name), function=function, args=args,
                        stored_args=stored_args, args_hash=hashed, idempotent=idempotent,
                        retry=retry, timeout_s=timeout_s, on_uncertain=on_uncertain, lookup=lookup,
                        result_type=result_type, limit=limit)

        return await CallDriver(self._run, spec).drive(outcome, approval=approval)

    @overload
    async def llm(
        self, model: str, function: Callable[..., Any], request: Any = ..., *,
        result_type: type[R], retry: RetryPolicy = ..., timeout_s: float | None = ...,
        limiter: str | None = ..., estimate_tokens: int | None = ...,
    ) -> R: ...

    @overload
    async def llm(
        self, model: str, function: Callable[..., Any], request: Any = ..., *,
        result_type: None = ..., retry: RetryPolicy = ..., timeout_s: float | None = ...,
        limiter: str | None = ..., estimate_tokens: int | None = ...,
    ) -> Any: ...

    async def llm(
        self,
        model: str,
        function: Callable[..., Any],
        request: Any = None,
        *,
        result_type: Any = None,
        retry: RetryPolicy = DEFAULT_POLICY,
        timeout_s: float | None = None,
        limiter: str | None = None,
        estimate_tokens: int | None = None,
    ) -> Any:
        """Call an LLM, journaled: its response and token usage are recorded, so a replay
        never pays for the same tokens twice. ``function(request)`` returns an
        :class:`LlmResponse` (or a dict with its fields, or a bare response). With
        ``result_type``, the response's content is converted to it by msgspec, as for
        :meth:`tool` (a mismatch raises :class:`~wal_engine.errors.ResultTypeError`).

        With ``limiter`` (a name defined by ``engine.limiter``, shared by every worker of
        the tenant), each attempt first takes a grant of one request and
        ``estimate_tokens`` tokens (default: a quarter of the request's encoded bytes),
        before its intent is written; once the response is recorded the estimate is
        replaced by the usage it reports. A call that would exceed the limit waits: in
        process when the wait is short, else on a durable timer (``retry.durable_after_s``).
        A :class:`~wal_engine.errors.RateLimited` raised by ``function`` (a 429) blocks the
        limiter until its Retry-After and the attempt is retried. A recorded call takes no
        grant.

        Raises:
            UnknownLimiter: no limiter of that name (nothing of the call is written).
            InvalidLimiter: a bad name or estimate, or an estimate above the token limit.
        """
        redacted = self._run.redact(request)
        limit = None
        if limiter is not None:
            estimate = (len(msgspec.json.encode(redacted)) // 4 if estimate_tokens is None
                        else estimate_tokens)
            limit = CallLimit(name=checked_limiter(limiter),
                              tokens=checked_tokens(limiter, "estimate_tokens", estimate))
        hashed = args_hash(redacted)
        outcome = await self._next(CallKind.LLM, model, hashed)
        if isinstance(outcome, Recorded):
            return recorded_value(outcome, result_type)
        spec = LlmSpec(name=self._run.redact_name(model), function=function, args=request,
                       args_hash=hashed, retry=retry, timeout_s=timeout_s, result_type=result_type,
                       limit=limit)
        return await CallDriver(self._run, spec).drive(outcome)

    async def approval(self, name: str, args: Any = None) -> ApprovalDecision:
        """Ask a human to decide on a planned action, wait durably, and return the decision
        without acting: the code branches on it (an agent framework's own approval step,
        a refusal the model is told about). ``engine.approve`` (or ``wal-engine approve``)
        answers it, as for ``ctx.tool(..., approval=True)``, whose refusal instead fails
        the task. The decision is journaled: a re-run gets it back without asking again.

        Args:
            name: What is to be approved, as the approver sees it (a tool's name).
            args: Plain JSON arguments of the planned action; the answer must carry the
                hash of exactly these (``engine.approve`` fills it in).

        Returns:
            The decision: approved or not, by whom, with the approver's comment.
        """
        redacted = self._run.redact(args)
        hashed = args_hash(redacted)
        # A value's journal entry has no args hash: the decision carries the hash it
        # answered, checked here on a re-run. Its name is recorded redacted (the journal
        # compares the redacted form of the one given here).
        value_kind = f"{approval_value_prefix}{name}"
        name = self._run.redact_name(name)
        outcome = await self._next(CallKind.VALUE, value_kind, "")
        if isinstance(outcome, Recorded):
            decision = msgspec.convert(outcome.result, ApprovalDecision)
            if decision.args_hash != hashed:
                raise NonDeterminismError(
                    seq=outcome.seq, task_id=self.task_id, fork_point=outcome.seq - 1,
                    call_index=0,
                    recorded=CallSignature(kind="approval", name=name,
                                           args_hash=decision.args_hash),
                    requested=CallSignature(kind="approval", name=name, args_hash=hashed))
            return decision
        assert isinstance(outcome, Fresh)
        decided = await decide_approval(self._run, outcome.call_id, name, hashed, redacted)
        decision = ApprovalDecision(approved=decided.approved, approver=decided.approver,
                                    comment=decided.comment, args_hash=hashed)
        # The decision is the value's record, so a re-run branches the same way.
        await self._run.append([ev.ValueRecorded(
            call_id=outcome.call_id, kind=value_kind, value=msgspec.to_builtins(decision))])
        return decision

    async def now(self) -> float:
        """Seconds since the epoch, journaled: a replay sees the same value."""
        return float(await self._value("now"))

    async def random(self) -> float:
        """A number in [0, 1), journaled: a replay sees the same value."""
        return float(await self._value("random"))

    async def _value(self, kind: str) -> Any:
        outcome = await self._next(CallKind.VALUE, kind, "")
        if isinstance(outcome, Recorded):
            return outcome.result
        assert isinstance(outcome, Fresh)
        services = self._run.services  # Only now: a replay has none and never gets here.
        value = services.clock.time_s() if kind == "now" else services.random.random()
        await self._run.append([ev.ValueRecorded(call_id=outcome.call_id, kind=kind,
                                                 value=value)])
        return value

    async def sleep(self, seconds: float) -> None:
        """Sleep durably: the task releases its lease and any worker wakes it when due."""
        duration_ms = max(0, round(seconds * 1000))
        outcome = await self._next(CallKind.TIMER, "sleep", args_hash(duration_ms))
        if isinstance(outcome, Recorded):
            return
        if isinstance(outcome, InDoubt):
            # Started and now running again: only the timer coming due wakes a sleep.
            await self._run.append([ev.TimerFired(timer_id=outcome.call_id)])
            return
        assert isinstance(outcome, Fresh)
        await self._run.append([ev.TimerStarted(
            timer_id=outcome.call_id, wake_at_ms=now_ms(self._run.services.clock) + duration_ms,
            duration_ms=duration_ms)])
        raise Suspended

    async def wait_for_signal(self, name: str, *, timeout_s: float | None = None) -> Any:
        """Wait durably for the signal ``name`` (sent with ``engine.signal``); return its
        payload. A signal sent before the wait is delivered. Raises SignalTimeout."""
        if name.startswith(INTERNAL_PREFIX):
            raise WalError(f"signal names starting with {INTERNAL_PREFIX!r} are reserved")
        outcome = await self._next(CallKind.SIGNAL, name, "")
        if isinstance(outcome, Recorded):
            if outcome.error is not None:
                raise SignalTimeout(outcome.error.error)
            return outcome.result
        timeout_ms = None if timeout_s is None else max(0, round(timeout_s * 1000))
        # As the sender stores it (engine.signal redacts names too), so that they meet.
        return await wait_signal(self._run, self._run.redact_name(name), timeout_ms)

    # ------------------------------------------------------------------ child tasks

    async def spawn(self, agent: str, input: Any = None, *, task_id: str | None = None,
                    budget: ev.Budget | None = None,
                    on_parent_end: ParentEndPolicy = "cancel",
                    budget_policy: BudgetPolicy = "share") -> ChildHandle:
        """Start a child task of agent ``agent`` and return its handle (journaled: a re-run
        gets the same child back, and no re-run or crash creates a second one).

        Args:
            agent: A registered agent's name.
            input: Its input, validated against the agent's input type.
            task_id: The child's id; by default ``<this task>:child:<call id>``.
            budget: The child's own budget.
            on_parent_end: What happens to the child, still running, when this task ends
                (completed, failed or cancelled): ``"cancel"`` it, or ``"abandon"`` it
                (it runs on, awaited by nobody).
            budget_policy: ``"share"``: the child's step, token, cost and tool-call limits
                are capped by what this task has left of its own (``budget`` may only
                lower them), and the child's spend is charged to this task's budget when
                its outcome is recorded (``handle.result()``); a limit this task has used
                up fails it (``budget_exceeded``) at the spawn. ``"own"``: the child has
                ``budget`` alone and this task is charged nothing.

        Raises:
            UnknownAgent: no agent of that name is registered.
            InvalidInput: a bad input, budget or policy (nothing is written).
            TaskCycle: ``task_id`` is this task or one of its ancestors.
            TaskAlreadyExists: ``task_id`` is another task's.
        """
        run = self._run
        assert run.journal is not None
        name = f"{SPAWN_VALUE_PREFIX}{agent}"
        if run.journal.remaining or run.journal.closed:
            # A recorded spawn (a value is recorded whole, or not at all): answered from
            # the log, nothing created. The checks that answer the same on every run are
            # made again first: a spawn the first run refused (the journal did not move)
            # is refused again here, not matched against the next recorded call. A
            # finished history records nothing more: the journal says so.
            await check_replayed_spawn(run, agent, input, task_id, budget, on_parent_end,
                                       budget_policy)
            outcome = await self._next(CallKind.VALUE, name, "")
            assert isinstance(outcome, Recorded)
            return self._handle(str(outcome.result["task_id"]))
        # Checked before the journal moves: a refused spawn leaves no trace, in the log or
        # in the order of the calls that follow.
        plain, version = await check_spawn(run, agent, input, task_id, budget, on_parent_end,
                                           budget_policy)
        if budget_policy == "share":
            capped = shared_budget(run, budget)
            if isinstance(capped, BudgetTrip):
                await run.fail_budget(capped)
            else:
                budget = capped
        outcome = await self._next(CallKind.VALUE, name, "")
        assert isinstance(outcome, Fresh)
        child = await start_child(run, outcome.call_id, agent, plain, task_id=task_id,
                                  budget=budget, version=version, on_parent_end=on_parent_end,
                                  budget_policy=budget_policy)
        return self._handle(child)

    async def child(self, task_id: str) -> ChildHandle:
        """The handle of a child this task spawned earlier, by its id.

        Raises:
            UnknownTask: no such task in this tenant (another tenant's is invisible).
            TaskCycle: ``task_id`` is this task or one of its ancestors.
            NotAChild: ``task_id`` is not a child of this task.
        """
        return self._handle(await handle_of(self._run, task_id))

    async def gather(self, *handles: ChildHandle, return_exceptions: bool = False) -> list[Any]:
        """The results of the children ``handles``, in order (fan-out/fan-in). The task
        waits durably while any runs. A failed child raises :class:`ChildTaskFailed`, or,
        with ``return_exceptions``, takes its place in the list."""
        return await gather(handles, return_exceptions=return_exceptions)

    def _handle(self, task_id: str) -> ChildHandle:
        return ChildHandle(self._run, task_id, self._child_result)

    async def _child_result(self, child: str) -> Any:
        outcome = await self._next(CallKind.VALUE, f"{CHILD_VALUE_PREFIX}{child}", "")
        if isinstance(outcome, Recorded):
            return outcome_value(outcome.result)
        assert isinstance(outcome, Fresh)
        run = self._run
        charge = spawn_policy(run, child) == "share" and not charged_already(run, child)
        value = await child_outcome(run, child, charge=charge)
        await run.append([ev.ValueRecorded(
            call_id=outcome.call_id, kind=f"{CHILD_VALUE_PREFIX}{child}", value=value)])
        recorded = run.last_appended[-1]
        assert isinstance(recorded, ev.ValueRecorded)
        failpoints.hit("after_child_outcome")
        if charge:
            # The child's spend now counts: a budget it used up fails this task here, as
            # its own spend would at its next call (after a crash right here, the claim's
            # budget check does).
            trip = run.check_budget()
            if trip is not None:
                await run.fail_budget(trip)
        return outcome_value(recorded.value)

    # ------------------------------------------------------------------ versions

    @property
    def task_version(self) -> str | None:
        """The version of the agent code that started this task."""
        version: str | None = self._run.view.agent_version
        return version

    async def patched(self, change_id: str) -> bool:
        """Whether this task runs the code changed under ``change_id`` (Temporal's
        ``patched``): True for tasks that reach this point on code that has the change
        (the first time, a ``patch_marked`` event records it), False while the code
        re-runs a history written before the change, so that its old branch runs exactly
        as it did. The answer is kept for the rest of the run. Write the change as::

            if await ctx.patched("send-summary"):
                await ctx.tool("summarise", ...)   # new code
            else:
                ...                                # what the old code did

        Raises:
            InvalidInput: ``change_id`` is empty or too long.
        """
        _check_change_id(change_id)
        answer = self._patches.get(change_id)
        if answer is not None:
            return answer
        run = self._run
        if change_id in run.view.patches:
            answer = True
        elif self._replaying():
            answer = False
        else:
            run.check_live()
            await run.release_if_requested()
            await run.append([ev.PatchMarked(change_id=change_id)])
            answer = True
        self._patches[change_id] = answer
        return answer

    def deprecate_patch(self, change_id: str) -> None:
        """Mark in the code that the old branch of ``change_id`` is gone (no task that
        predates the change remains): histories with or without the marker both replay,
        and nothing is written. Remove the call once no history has the marker either."""
        _check_change_id(change_id)

    def _replaying(self) -> bool:
        """Whether the code is still inside the recorded history (recorded calls or
        commands it has not reached yet): a change made since must not apply here."""
        run = self._run
        assert run.journal is not None
        # A finished history (the deploy gate replays them) ended where the old code
        # returned: a patch reached after its last record is a change it never ran.
        if run.journal.remaining or run.journal.closed:
            return True
        return any(self._ordinals.get(kind, 0) < count
                   for kind, count in run.view.commands.items())

    # ------------------------------------------------------------------ other commands

    async def message(self, role: str, content: Any, *, name: str | None = None) -> None:
        """Add a message to the task's conversation history (once, even across re-runs)."""
        index = self._ordinal("message_appended") - 1
        content = self._run.redact(content)  # As recorded, so that a re-run compares equal.
        name = None if name is None else self._run.redact_name(name)
        recorded = self._run.view.messages
        if index < len(recorded):
            prior = recorded[index]
            if (prior.role, prior.content, prior.name) != (role, content, name):
                raise _divergence(self._run, "message", f"{role}", prior.role)
            return
        self._run.check_live()
        await self._run.append([ev.MessageAppended(role=role, content=content, name=name)])

    async def checkpoint(self, next_action: Any = None) -> None:
        """A step boundary: status CHECKPOINTED, snapshot per policy; the next command opens
        the next step. If the worker is shutting down, the task is handed back here."""
        ordinal = self._ordinal("step_checkpointed")
        if ordinal <= self._run.view.commands.get("step_checkpointed", 0):
            return
        self._run.check_live()
        trip = self._run.check_budget(starting_step=True)
        if trip is not None:
            await self._run.fail_budget(trip)
        await self._run.append([ev.StepCheckpointed(step=ordinal, next_action=next_action)])
        failpoints.hit("at_checkpoint")
        await self._run.maybe_snapshot()
        await self._run.run_hook("on_checkpoint", "checkpoint", {"step": ordinal})
        await self._run.release_if_requested()

    async def set_env(self, **values: str | None) -> None:
        """Set (or, with None, unset) the task's own environment variables."""
        if self._ordinal("environment_set") <= self._run.view.commands.get("environment_set", 0):
            return
        await self._run.append([ev.EnvironmentSet(values=values)])

    async def plan(self, nodes: list[ev.PlanNode]) -> None:
        """Record (or rewrite) the task's plan as a DAG of nodes."""
        if self._ordinal("plan_updated") <= self._run.view.commands.get("plan_updated", 0):
            return
        await self._run.append([ev.PlanUpdated(nodes=nodes)])

    async def complete_node(self, node_id: str) -> None:
        """Mark a node of the plan done (its dependencies must be done)."""
        ordinal = self._ordinal("plan_node_completed")
        if ordinal <= self._run.view.commands.get("plan_node_completed", 0):
            return
        await self._run.append([ev.PlanNodeCompleted(node_id=node_id)])

    async def transaction(self, name: str, function: Callable[[Any, Any], Awaitable[Any]],
                          args: Any = None, *, retry: RetryPolicy = DEFAULT_POLICY) -> Any:
        """Exactly once for effects on this database: ``await function(connection, args)``,
        its dedup row and the result event commit in one transaction. A failed attempt
        rolled back, so it did not act: transient failures are retried per ``retry``,
        others raise ``ToolError``."""
        hashed = args_hash(self._run.redact(args))
        outcome = await self._next(CallKind.TOOL, name, hashed)
        if isinstance(outcome, Recorded):
            return recorded_value(outcome)
        from wal_engine.runtime.transaction import run_transaction

        return await run_transaction(self._run, outcome, self._run.redact_name(name), function,
                                     args, hashed, retry)

    # ------------------------------------------------------------------ plumbing

    async def _next(self, kind: CallKind, name: str, hashed: str) -> Outcome:
        run = self._run
        run.check_live()
        await run.release_if_requested()
        assert run.journal is not None
        return run.journal.next_call(kind, name, hashed)

    def _ordinal(self, kind: str) -> int:
        self._ordinals[kind] = self._ordinals.get(kind, 0) + 1
        return self._ordinals[kind]

    def finish_commands(self) -> None:
        """When the agent returns: it must have issued every recorded command."""
        recorded = self._run.view.commands
        for kind, count in recorded.items():
            if self._ordinals.get(kind, 0) < count:
                raise _divergence(self._run, kind, None, f"{count} recorded")


change_id_length_max: Final = 200


def _check_change_id(change_id: str) -> None:
    if not isinstance(change_id, str) or not 1 <= len(change_id) <= change_id_length_max:
        raise InvalidInput(f"a patch's change id must be 1..{change_id_length_max} characters")


def _divergence(run: Run, kind: str, requested: str | None,
                recorded: str | None) -> NonDeterminismError:
    seq = run.view.last_seq
    return NonDeterminismError(
        seq=seq,
        recorded=None if recorded is None else CallSignature(kind=kind, name=recorded),
        requested=None if requested is None else CallSignature(kind=kind, name=requested),
        fork_point=seq - 1, call_index=0, task_id=run.task_id,
    )


