"""The public API is pinned: removing or renaming an export, or changing a signature, is a
visible, deliberate change. Update a table below only for a change you mean to publish.

``AgentContext`` (``ctx``) is pinned by the signatures of its implementations; the typed
overloads of ``ctx.tool`` and ``ctx.llm`` (``result_type=``, the tool's return type) are
checked by mypy in ``tests/integration/test_runtime_typing.py``."""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any

import msgspec

import replay
import wal_engine
import wal_engine.testing
from wal_engine.engine import EngineOptions, WorkerOptions

EXPECTED = {
    "AgentContext", "Budget", "Database", "Engine", "EngineConfig", "EventRecord",
    "LlmResponse", "PermanentError", "PlanNode", "RetryPolicy", "SignalTimeout", "Store",
    "TaskHead", "ToolError", "TransientError", "WalError", "Worker", "WorkerConfig",
    "__version__", "code_version", "connect", "secret_ref", "DidNotAct", "LeaseExpired",
    "current_call", "ensure_lease", "lease_valid",
}

PUBLIC_FUNCTIONS = ("code_version", "connect", "current_call", "ensure_lease", "lease_valid",
                    "secret_ref")
PUBLIC_CLASSES = ("Budget", "EngineConfig", "LlmResponse", "PlanNode", "RetryPolicy",
                  "WorkerConfig")
CLASSES_WITH_METHODS = ("AgentContext", "Engine", "Worker")


def _text(value: Any) -> str:
    """A signature or default as text, without the memory addresses of object reprs."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def _struct_signature(cls: type[msgspec.Struct]) -> str:
    """A Struct's constructor with its annotations as written in its class (msgspec's own
    ``__signature__`` spells evaluated types, which change with every move of a type)."""
    annotations: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        annotations.update(vars(base).get("__annotations__", {}))
    parameters = [parameter.replace(annotation=annotations[parameter.name])
                  for parameter in inspect.signature(cls).parameters.values()]
    return _text(inspect.Signature(parameters))


def _signature(value: Any) -> str:
    if isinstance(value, type) and issubclass(value, BaseException):
        return f"exception({', '.join(base.__name__ for base in value.__bases__)})"
    if isinstance(value, type) and issubclass(value, msgspec.Struct):
        return _struct_signature(value)
    return _text(inspect.signature(value))


def _methods(cls: type) -> dict[str, str]:
    """Every public method (and ``async with``) of ``cls``, by ``Class.method``."""
    found = {}
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_") and name not in ("__aenter__", "__aexit__"):
            continue
        if inspect.isfunction(member):
            found[f"{cls.__name__}.{name}"] = _signature(member)
    return found


def current_signatures() -> dict[str, dict[str, str]]:
    """Today's signatures, by table name (the tables below were printed from it)."""
    engine: dict[str, str] = {}
    for name in PUBLIC_FUNCTIONS + PUBLIC_CLASSES:
        engine[name] = _signature(getattr(wal_engine, name))
    for name in CLASSES_WITH_METHODS:
        engine.update(_methods(getattr(wal_engine, name)))
    testing = {name: _signature(getattr(wal_engine.testing, name))
               for name in wal_engine.testing.__all__}
    return {"SIGNATURES": engine, "TESTING_SIGNATURES": testing}


def test_exports_are_pinned() -> None:
    """wal_engine.__all__ is exactly the documented surface, and every name resolves."""
    assert set(wal_engine.__all__) == EXPECTED
    for name in wal_engine.__all__:
        assert getattr(wal_engine, name) is not None


def test_engine_methods_are_pinned() -> None:
    """The Engine keeps the methods the design names."""
    for method in ("agent", "submit", "signal", "cancel", "approve", "reconcile", "fork",
                   "state", "history", "wait", "worker", "close"):
        assert callable(getattr(wal_engine.Engine, method))


def test_signatures_are_pinned() -> None:
    """Each public callable, class constructor and Engine/Worker method has the pinned
    signature (parameters, defaults, annotations as written)."""
    current = current_signatures()
    assert current["SIGNATURES"] == SIGNATURES
    assert current["TESTING_SIGNATURES"] == TESTING_SIGNATURES


def _type_checking_names(module: Any) -> set[str]:
    """The names a module imports under ``if TYPE_CHECKING:`` (what type checkers see)."""
    import ast

    tree = ast.parse(inspect.getsource(module))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom), ast.dump(statement)
                module_name = statement.module
                for alias in statement.names:
                    names.add(alias.asname or alias.name)
                    assert module.__dict__["_lazy"][alias.asname or alias.name] == module_name
    return names


def test_type_checkers_see_what_getattr_serves() -> None:
    """In both lazy packages, ``__all__``, the ``TYPE_CHECKING`` imports and the PEP 562 map
    name the same set, each name imported from the module the map loads it from."""
    for module, extra in ((wal_engine, {"__version__"}), (wal_engine.testing, set())):
        lazy = set(module.__dict__["_lazy"])
        assert set(module.__all__) == lazy | extra, module.__name__
        assert _type_checking_names(module) == lazy, module.__name__
        assert len(module.__all__) == len(set(module.__all__))


def test_replay_exports_are_real_imports() -> None:
    """``replay`` imports its names outright (it is pure, nothing to defer)."""
    assert "__getattr__" not in vars(replay)
    for name in replay.__all__:
        assert name in vars(replay), name


def test_keyword_shortcuts_match_their_configs() -> None:
    """``connect(**options)`` and ``engine.worker(**options)`` take exactly the fields of
    EngineConfig and WorkerConfig, with the same annotations."""
    for options, config in ((EngineOptions, wal_engine.EngineConfig),
                            (WorkerOptions, wal_engine.WorkerConfig)):
        assert set(options.__annotations__) == set(config.__struct_fields__)
        written = {name: getattr(hint, "__forward_arg__", hint)
                   for name, hint in options.__annotations__.items()}
        assert written == {name: config.__annotations__[name]
                           for name in config.__struct_fields__}
        assert not typing.cast(Any, options).__total__


SIGNATURES = {
    'Budget': (
        "(*, max_steps: 'int | None' = None, max_tokens: 'int | None' = None, max_runtime_s: "
        "'float | None' = None, max_cost_usd: 'float | None' = None, max_tool_calls: 'int | "
        "None' = None, max_attempts: 'int | None' = None)"
    ),
    'Engine.__aenter__': "(self) -> 'Engine'",
    'Engine.__aexit__': "(self, *_: 'object') -> 'None'",
    'Engine.agent': (
        "(self, name: 'str', *, input_type: 'Any' = None, version: 'str' = '1', compatible: "
        "'tuple[str, ...]' = (), hooks: 'AgentHooks | None' = None) -> 'Callable[[F], F]'"
    ),
    'Engine.approve': (
        "(self, task_id: 'str', call_id: 'str', *, approver: 'str', approved: 'bool' = True, "
        "args_hash: 'str | None' = None, comment: 'str | None' = None) -> 'int'"
    ),
    'Engine.cancel': (
        "(self, task_id: 'str', *, reason: 'str' = 'cancelled', requested_by: 'str | None' = "
        "None) -> 'bool'"
    ),
    'Engine.close': "(self) -> 'None'",
    'Engine.fork': "(self, task_id: 'str', at_seq: 'int') -> 'TaskId'",
    'Engine.head': "(self, task_id: 'str') -> 'TaskHead'",
    'Engine.history': "(self, task_id: 'str') -> 'list[EventRecord]'",
    'Engine.reconcile': (
        "(self, task_id: 'str', call_id: 'str', *, result: 'Any' = None, error: 'str | None' "
        "= None, force: 'bool' = False) -> 'int'"
    ),
    'Engine.register': (
        "(self, name: 'str', function: 'AgentFunction', *, input_type: 'Any' = None, version:"
        " 'str' = '1', compatible: 'tuple[str, ...]' = (), hooks: 'AgentHooks | None' = None)"
        " -> 'None'"
    ),
    'Engine.queue_changes': (
        "(self, queue: 'str | None' = None, *, limit: 'int' = 100) -> 'list[QueueChange]'"
    ),
    'Engine.queues': "(self) -> 'list[QueueStats]'",
    'Engine.runnable_versions': "(self) -> 'tuple[list[str], list[str]]'",
    'Engine.set_queue': (
        "(self, queue: 'str', *, concurrency_max: 'int | Unchanged | None' = "
        "<Unchanged.UNCHANGED: 'unchanged'>, worker_concurrency_max: 'int | Unchanged | None'"
        " = <Unchanged.UNCHANGED: 'unchanged'>, requested_by: 'str | None' = None) -> "
        "'QueueSettings'"
    ),
    'Engine.schedule': (
        "(self, name: 'str', agent: 'str', *, cron: 'str | None' = None, every_s: 'int | "
        "None' = None, input: 'Any' = None, tz: 'str | None' = None, catch_up: 'CatchUp' = "
        "'one', catch_up_max: 'int' = 100, replace: 'bool' = False) -> 'ScheduleInfo'"),
    'Engine.schedule_info': "(self, name: 'str') -> 'ScheduleInfo'",
    'Engine.schedules': "(self) -> 'list[ScheduleInfo]'",
    'Engine.pause_schedule': "(self, name: 'str') -> 'ScheduleInfo'",
    'Engine.resume_schedule': "(self, name: 'str') -> 'ScheduleInfo'",
    'Engine.delete_schedule': "(self, name: 'str') -> 'None'",
    'Engine.limiter': (
        "(self, name: 'str', *, requests_per_period: 'int | None' = None, tokens_per_period: "
        "'int | None' = None, period_s: 'float' = 60.0, tokens: 'TokenKind' = 'both') -> "
        "'LimiterInfo'"
    ),
    'Engine.limiters': "(self) -> 'list[LimiterInfo]'",
    'Engine.limiter_info': "(self, name: 'str') -> 'LimiterInfo'",
    'Engine.delete_limiter': "(self, name: 'str') -> 'None'",
    'Engine.signal': (
        "(self, task_id: 'str', name: 'str', payload: 'Any' = None, *, dedup_key: 'str | "
        "None' = None) -> 'int'"
    ),
    'Engine.state': "(self, task_id: 'str') -> 'AgentState'",
    'Engine.submit': (
        "(self, agent: 'str', input: 'Any' = None, *, budget: 'Budget | None' = None, "
        "task_id: 'str | None' = None, queue: 'str' = 'default', priority: 'int' = 0, "
        "partition_key: 'str | None' = None, dedup_id: 'str | None' = None) -> 'TaskId'"
    ),
    'Engine.wait': (
        "(self, task_id: 'str', *, timeout_s: 'float | None' = None, poll_s: 'float' = 0.05) "
        "-> 'AgentState'"
    ),
    'Engine.worker': (
        "(self, config: 'WorkerConfig | None' = None, *, worker_id: 'str | None' = None, "
        "**options: 'Unpack[WorkerOptions]') -> 'Worker'"
    ),
    'EngineConfig': (
        "(*, payload_bytes_max: 'int' = 67108864, pool_size_max: 'int' = 20, migrate: 'bool' ="
        " True, require_synchronous_commit: 'bool' = True, snapshot_policy: 'SnapshotPolicy |"
        " None' = None, redactor: 'Redactor | None' = "
        "<wal_engine.security.redaction.DefaultRedactor object>, secrets: 'SecretResolver | "
        "None' = None, development: 'bool | None' = None, tenant: 'str | None' = None, "
        "tasks_max: 'int | None' = None, events_per_task_max: 'int' = 10000000, "
        "llm_spend_max_usd: 'float | None' = None, statement_timeout_ms: 'int' = 30000, "
        "recovery_attempts_max: 'int' = 20, unavailable_retry_s: 'float' = 30.0, "
        "connect_wait_s: 'float' = 0.0, pooler: 'str | None' = None, listen_dsn: "
        "'str | None' = None)"
    ),
    'LlmResponse': (
        "(*, content: 'Any' = None, input_tokens: 'int' = 0, output_tokens: 'int' = 0, "
        "cost_usd: 'float' = 0.0)"
    ),
    'PlanNode': "(*, node_id: 'str', action: 'Any' = None, depends_on: 'list[str]' = <factory>)",
    'RetryPolicy': (
        "(*, max_attempts: 'int' = 3, initial_delay_s: 'float' = 0.5, multiplier: 'float' = "
        "2.0, max_delay_s: 'float' = 60.0, durable_after_s: 'float' = 5.0, retry_on: "
        "'tuple[str, ...]' = (), did_not_act_on: 'tuple[str, ...]' = ())"
    ),
    'Worker.lease_valid': "(self, task_id: 'str', epoch: 'int') -> 'bool'",
    'Worker.run': (
        "(self, *, install_signal_handlers: 'bool' = False, until_idle: 'bool' = False) -> "
        "'None'"
    ),
    'Worker.stop': "(self) -> 'None'",
    'Worker.sync_calls_running': "(self) -> 'int'",
    'WorkerConfig': (
        "(*, concurrency: 'int' = 8, lease_ttl_ms: 'int' = 45000, heartbeat_ms: 'int' = "
        "15000, poll_ms: 'int' = 1000, sweep_ms: 'int' = 5000, drain_timeout_s: 'float' = "
        "30.0, sync_threads: 'int' = 0, stall_warn_ms: 'int' = 1000, stall_abandon_ms: 'int' "
        '= 600000)'
    ),
    'code_version': "(*sources: 'object', salt: 'str' = '') -> 'str'",
    'connect': (
        "(dsn: 'str | None' = None, *, config: 'EngineConfig | None' = None, **options: "
        "'Unpack[EngineOptions]') -> 'Engine'"
    ),
    'current_call': "() -> 'Claim | None'",
    'ensure_lease': "() -> 'None'",
    'lease_valid': "() -> 'bool'",
    'secret_ref': "(name: 'str') -> 'dict[str, str]'",
    'AgentContext.approval': "(self, name: 'str', args: 'Any' = None) -> 'ApprovalDecision'",
    'AgentContext.checkpoint': "(self, next_action: 'Any' = None) -> 'None'",
    'AgentContext.complete_node': "(self, node_id: 'str') -> 'None'",
    'AgentContext.deprecate_patch': "(self, change_id: 'str') -> 'None'",
    'AgentContext.ensure_lease': "(self) -> 'None'",
    'AgentContext.finish_commands': "(self) -> 'None'",
    'AgentContext.lease_valid': "(self) -> 'bool'",
    'AgentContext.llm': (
        "(self, model: 'str', function: 'Callable[..., Any]', request: 'Any' = None, *, "
        "result_type: 'Any' = None, retry: 'RetryPolicy' = RetryPolicy(max_attempts=3, "
        'initial_delay_s=0.5, multiplier=2.0, max_delay_s=60.0, durable_after_s=5.0, '
        "retry_on=(), did_not_act_on=()), timeout_s: 'float | None' = None, limiter: "
        "'str | None' = None, estimate_tokens: 'int | None' = None) -> 'Any'"
    ),
    'AgentContext.message': (
        "(self, role: 'str', content: 'Any', *, name: 'str | None' = None) -> 'None'"
    ),
    'AgentContext.now': "(self) -> 'float'",
    'AgentContext.patched': "(self, change_id: 'str') -> 'bool'",
    'AgentContext.plan': "(self, nodes: 'list[ev.PlanNode]') -> 'None'",
    'AgentContext.random': "(self) -> 'float'",
    'AgentContext.set_env': "(self, **values: 'str | None') -> 'None'",
    'AgentContext.sleep': "(self, seconds: 'float') -> 'None'",
    'AgentContext.child': "(self, task_id: 'str') -> 'ChildHandle'",
    'AgentContext.gather': "(self, *handles: 'ChildHandle', return_exceptions: 'bool' = False)"
                           " -> 'list[Any]'",
    'AgentContext.spawn': "(self, agent: 'str', input: 'Any' = None, *, task_id: 'str | None'"
                          " = None, budget: 'ev.Budget | None' = None, on_parent_end:"
                          " 'ParentEndPolicy' = 'cancel', budget_policy: 'BudgetPolicy' ="
                          " 'share') -> 'ChildHandle'",
    'AgentContext.tool': (
        "(self, name: 'str', function: 'Callable[..., Any]', args: 'Any' = None, *, "
        "result_type: 'Any' = None, idempotent: 'bool' = True, retry: 'RetryPolicy' = "
        'RetryPolicy(max_attempts=3, initial_delay_s=0.5, multiplier=2.0, max_delay_s=60.0, '
        "durable_after_s=5.0, retry_on=(), did_not_act_on=()), timeout_s: 'float | None' = "
        "None, approval: 'bool' = False, on_uncertain: 'UncertainPolicy' = 'fail', lookup: "
        "'Callable[[str], Awaitable[Any]] | None' = None, limiter: 'str | None' = None, "
        "limiter_tokens: 'int' = 0) -> 'Any'"
    ),
    'AgentContext.transaction': (
        "(self, name: 'str', function: 'Callable[[Any, Any], Awaitable[Any]]', args: 'Any' = "
        "None, *, retry: 'RetryPolicy' = RetryPolicy(max_attempts=3, initial_delay_s=0.5, "
        'multiplier=2.0, max_delay_s=60.0, durable_after_s=5.0, retry_on=(), '
        "did_not_act_on=())) -> 'Any'"
    ),
    'AgentContext.wait_for_signal': (
        "(self, name: 'str', *, timeout_s: 'float | None' = None) -> 'Any'"
    ),
    'Engine.run_services': "(self) -> 'RunServices'",
}

TESTING_SIGNATURES = {
    'AckRecorder': "() -> 'None'",
    'AgentUnderTest': (
        "(register: 'Callable[[Engine], Any]', submissions: 'st.SearchStrategy[Submission]', "
        "signals: 'dict[str, Any]' = <factory>, project: 'Callable[[AgentState], Any]' = "
        "<function outcome>, degraded: 'Callable[[AgentState, list[EventRecord]], bool]' = "
        "<function allow_escalated>, effects_query: 'str | None' = None, tasks_max: 'int' = "
        "3, faults_max: 'int' = 40, timings: 'dict[str, Any]' = <factory>, responder: "
        "'Callable[[Engine, dict[str, Any]], Responder] | None' = None, finish: "
        "'Callable[[Engine, list[tuple[str, Submission]]], Awaitable[list[Violation]]] | "
        "None' = None, observe: 'Callable[[Worker], None] | None' = None) -> None"
    ),
    'Behaviour': "(*, outcome: 'Outcome' = 'return', sleep_s: 'float' = 0.0)",
    'DatabaseFactory': "(server: 'TestServer') -> 'None'",
    'EffectLedger': "(database: 'Database', *, reject_stale: 'bool' = True) -> 'None'",
    'EffectStats': (
        "(machine: 'MachineStats' = <factory>, programs: 'int' = 0, tasks: 'int' = 0, calls: "
        "'int' = 0, calls_made: 'int' = 0, calls_by_kind: 'dict[str, int]' = <factory>, "
        "calls_by_outcome: 'dict[str, int]' = <factory>, calls_by_result: 'dict[str, int]' = "
        "<factory>, sync_calls: 'int' = 0, attempts: 'int' = 0, deliveries: 'int' = 0, "
        "escalations: 'dict[str, int]' = <factory>, reconcile_refused: 'int' = 0, "
        "reconciled_forced: 'int' = 0, reconciled: 'int' = 0, workers: 'int' = 0, "
        "loop_stalls: 'int' = 0, worst_stall_ms: 'float' = 0.0, violations: 'int' = 0) -> "
        'None'
    ),
    'FaultProxy': "(target_host: 'str', target_port: 'int') -> 'None'",
    'MachineStats': (
        "(programs: 'int' = 0, rules: 'int' = 0, tasks: 'int' = 0, crash_points_tried: 'int' "
        "= 0, crash_points_fired: 'int' = 0, fired_by_point: 'dict[str, int]' = <factory>, "
        "kills: 'int' = 0, leases_broken: 'int' = 0, timers_advanced: 'int' = 0, "
        "signals_sent: 'int' = 0, effect_keys: 'int' = 0, deliveries: 'int' = 0, applied: "
        "'int' = 0, stale_rejected: 'int' = 0, acknowledged_appends: 'int' = 0, degraded: "
        "'int' = 0, violations: 'int' = 0) -> None"
    ),
    'ReplayMismatch': 'exception(AssertionError)',
    'StaleDelivery': 'exception(PermanentError)',
    'Submission': "(agent: 'str', input: 'Any' = None) -> None",
    'TestServer': (
        "(admin_dsn: 'str', embedded: 'EmbeddedPostgres | None', data_dir: 'Path | None') -> "
        "'None'"
    ),
    'WorkerPool': "(dsn: 'str', register: 'str', log_dir: 'Path', **defaults: 'Any') -> 'None'",
    'WorkerProcess': (
        "(dsn: 'str', worker_id: 'str', register: 'str', *, log_dir: 'Path', failpoint: 'str "
        "| None' = None, concurrency: 'int' = 4, lease_ttl_ms: 'int' = 1000, heartbeat_ms: "
        "'int' = 250, poll_ms: 'int' = 100, env: 'Mapping[str, str] | None' = None, wrapper: "
        "'list[str] | None' = None, cwd: 'Path | None' = None, drain_timeout_s: 'float | "
        "None' = None) -> 'None'"
    ),
    'advance_timers': "(engine: 'Engine', *, signal_timeouts: 'bool' = False) -> 'int'",
    'assert_no_violations': "(violations: 'Sequence[Violation]', context: 'str' = '') -> 'None'",
    'assert_replay_equivalent': (
        "(engine: 'Engine', agent: 'str', task_input: 'Any' = None, *, responder: 'Any' = "
        "None, count_effects: 'Callable[[], Awaitable[int]] | None' = None) -> 'ReplayReport'"
    ),
    'assert_replays': (
        "(agents: 'Mapping[str, Any] | AgentFunction', records: 'Sequence[EventRecord]') -> "
        "'ReplayReport'"
    ),
    'check_effects': (
        "(database: 'Database', rows: 'Sequence[EffectRow] | None' = None, *, "
        "completed_tools: 'dict[str, str] | None' = None) -> 'list[Violation]'"
    ),
    'check_log': (
        "(database: 'Database', task_ids: 'Sequence[str] | None' = None) -> 'list[Violation]'"
    ),
    'crash_at': "(point: 'str', nth: 'int' = 1) -> 'Iterator[CrashReport]'",
    'crash_machine': (
        "(config: 'AgentUnderTest', factory: 'DatabaseFactory', stats: 'MachineStats | None' "
        "= None) -> 'type[RuleBasedStateMachine]'"
    ),
    'deliver_signals': (
        "(engine: 'Engine', responder: 'Responder', task_ids: 'Sequence[str] | None' = None) "
        "-> 'int'"
    ),
    'drive_to_quiescence': (
        "(engine: 'Engine', task_ids: 'Sequence[str] | None' = None, *, responder: 'Responder"
        " | None' = None, rounds_max: 'int' = 50, deadline_s: 'float' = 60.0, worker_id: "
        "'str' = 'finisher', **timings: 'Any') -> 'list[str]'"
    ),
    'dump_history': "(records: 'Iterable[EventRecord]', path: 'Path') -> 'None'",
    'expire_leases': "(engine: 'Engine', task_ids: 'Sequence[str] | None' = None) -> 'int'",
    'load_history': "(path: 'Path') -> 'list[EventRecord]'",
    'outcome': "(state: 'AgentState') -> 'dict[str, Any]'",
    'replay_events': (
        "(events: 'Iterable[FoldItem]', agents: 'Mapping[str, Any] | AgentFunction', *, "
        "task_id: 'str' = '', timeout_s: 'float' = 60.0) -> 'ReplayReport'"
    ),
    'run_crash_free': (
        "(engine: 'Engine', agent: 'str', task_input: 'Any', *, responder: 'Responder | None'"
        " = None, task_id: 'str | None' = None, deadline_s: 'float' = 60.0, **timings: 'Any')"
        " -> 'AgentState'"
    ),
    'run_crash_free_many': (
        "(engine: 'Engine', runs: 'Sequence[tuple[str, Any, str | None]]', *, responder: "
        "'Responder | None' = None, deadline_s: 'float' = 60.0, **timings: 'Any') -> "
        "'list[AgentState]'"
    ),
    'run_crash_machine': (
        "(config: 'AgentUnderTest', factory: 'DatabaseFactory', *, profile: 'str | None' = "
        "None, settings_: 'settings | None' = None) -> 'MachineStats'"
    ),
    'run_effect_model': (
        "(factory: 'DatabaseFactory', *, profile: 'str | None' = None, settings_: 'settings |"
        " None' = None) -> 'EffectStats'"
    ),
    'run_worker_until_idle': (
        "(engine: 'Engine', *, worker_id: 'str | None' = None, concurrency: 'int' = 4, "
        "timeout_s: 'float' = 30.0, **timings: 'Any') -> 'Worker'"
    ),
    'start_test_server': "() -> 'TestServer'",
    'ManualClock': "(start_s: 'float' = 1800000000.0) -> 'None'",
    'check_history': (
        "(source: 'ReplaySource | Store', task_id: 'str', agents: 'Mapping[str, Any] | None' "
        "= None, *, timeout_s: 'float' = 60.0, on_progress: 'ProgressCallback | None' = "
        "None) -> 'ReplayReport'"
    ),
}

