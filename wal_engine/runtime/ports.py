"""What a task run is given, and what agent code's ``ctx`` and the call driver use of a run.

The running side is built from the bottom: the composition root (``engine.py``) builds one
:class:`RunServices` per worker; the worker builds a task run from those services, the
agent's registration (an :class:`AgentSpec`) and the claimed row, and lends it the narrow
:class:`RunHost` (its id, its thread pool, its lease keeper). No run knows the engine or
its worker. The context (``ctx``) and the call driver see a run only through :class:`Run`,
which the worker's :class:`~wal_engine.runtime.run.TaskRun` and the replay checker's run
(:mod:`wal_engine.runtime.replayer`) both implement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from replay.journal import Journal
    from replay.state import AgentState
    from wal_engine import events as ev
    from wal_engine.budgets import BudgetTrip, Usage
    from wal_engine.clock import Clock, RandomSource
    from wal_engine.effects.gateway import IdempotencyGateway
    from wal_engine.runtime.hooks import AgentHooks
    from wal_engine.runtime.resume import SnapshotPolicy
    from wal_engine.security.redaction import Redactor, SecretResolver
    from wal_engine.state_machine import Status
    from wal_engine.store import Database, Store
    from wal_engine.store.group_commit import GroupCommitter


@dataclass(frozen=True, slots=True, kw_only=True)
class RunServices:
    """Everything task runs (and their worker) use from the engine that built them."""

    database: Database
    store: Store
    committer: GroupCommitter
    """Group commit: every append of a run goes through it (one round trip, one commit)."""
    gateway: IdempotencyGateway
    redactor: Redactor
    secrets: SecretResolver | None
    snapshot_policy: SnapshotPolicy
    recovery_attempts_max: int
    """Claims of a task before it is dead-lettered, when its budget sets no max_attempts."""
    llm_spend_max_usd: float | None
    """The engine's cap on its tenant's LLM spend (None: none)."""
    wake_token: str
    """The NOTIFY payload of this tenant's wake-ups."""
    clock: Clock
    random: RandomSource
    agents: Mapping[str, Any] = field(default_factory=dict)
    """The engine's registered agents by name (``AgentDefinition``: input type, version):
    ``ctx.spawn`` validates a child's agent and input against them."""


class AgentSpec(Protocol):
    """What a run reads of a registered agent
    (:class:`~wal_engine.engine.AgentDefinition` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def function(self) -> Any: ...

    @property
    def version(self) -> str: ...

    @property
    def hooks(self) -> AgentHooks: ...

    @property
    def runs(self) -> tuple[str, ...]: ...


AgentRegistry = Mapping[str, AgentSpec]
"""Agent name to registration, as a worker claims and runs them."""


class RunHost(Protocol):
    """What a task run needs from the worker running it."""

    @property
    def worker_id(self) -> str: ...

    @property
    def executor(self) -> Executor | None: ...

    @property
    def lease_ttl_ms(self) -> int: ...

    def lease_valid(self, task_id: str, epoch: int) -> bool:
        """Whether the worker may still trust this lease (its own clock, no round trip;
        thread-safe)."""
        ...


class Run(Protocol):
    """What ``ctx`` and the call driver use of the run they belong to."""

    @property
    def services(self) -> RunServices: ...

    @property
    def task_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def worker_id(self) -> str: ...

    @property
    def head_seq(self) -> int: ...

    @property
    def head_hash(self) -> bytes: ...

    @property
    def journal(self) -> Journal | None: ...

    @property
    def state(self) -> AgentState: ...

    @property
    def view(self) -> Any: ...

    @property
    def status(self) -> Status | None: ...

    @property
    def last_appended(self) -> list[ev.Event]: ...

    @property
    def redactor(self) -> Redactor: ...

    @property
    def executor(self) -> Executor | None: ...

    @property
    def lease_ttl_ms(self) -> int: ...

    @property
    def log(self) -> Any: ...

    @property
    def stop_forced(self) -> bool: ...

    def fence(self, reason: str) -> None: ...

    def check_live(self) -> None: ...

    def lease_trusted(self) -> bool: ...

    def redact(self, value: Any) -> Any: ...

    def redact_text(self, text: str) -> str: ...

    def redact_name(self, name: str) -> str: ...

    async def append(self, events: Sequence[ev.Event], *, redacted: bool = False) -> None: ...

    async def store_result_or_failure(self, success: ev.Event,
                                      failure: ev.Event) -> ev.Event | None: ...

    def adopt_append(self, event: ev.Event, result: Any) -> None: ...

    def usage(self) -> Usage: ...

    def check_budget(self, *, at_claim: bool = False, planned_tool_calls: int = 0,
                     starting_step: bool = False) -> BudgetTrip | None: ...

    async def check_tenant_spend(self) -> BudgetTrip | None: ...

    async def add_tenant_spend(self, cost_usd: float) -> None: ...

    async def fail_budget(self, trip: BudgetTrip) -> None: ...

    async def fail(self, reason: str, error: BaseException | None,
                   diagnostic_extra: dict[str, Any] | None = None) -> None: ...

    async def release_if_requested(self) -> None: ...

    async def maybe_snapshot(self) -> None: ...

    async def run_hook(self, hook: str, reason: str, detail: Any = None) -> None: ...
