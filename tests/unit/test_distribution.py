"""The single-shard property a Citus distribution needs (docs/scaling.md, "More than one
PostgreSQL"), proven on the statements' text since Citus cannot be installed here: every hot
statement filters each per-task table it reads or writes on the distribution column (the
task id, by parameter equality) and on the tenant; the statements that deliberately reach
many tasks are listed by name with a reason; every statement of the store is in one list
or the other, so a new statement must be classified (and, if hot, filtered) to pass."""

from __future__ import annotations

import re
from typing import Final

from tests.helpers import REPOSITORY
from wal_engine.runtime import resume
from wal_engine.store import queries

SCHEMA: Final = (REPOSITORY / "schema.sql").read_text()

TASK_TABLES: Final = frozenset({
    "wal_tasks", "wal_events", "wal_snapshots", "wal_snapshot_segments", "wal_blobs",
    "wal_signals", "wal_archived_tasks"})
"""Distributed by task id, colocated: one task's rows of every table on one shard."""

HOT: Final = frozenset({
    "CREATE_TASK", "CREATE_TASK_BLOBS", "PREVIOUS_OK", "PREVIOUS_OK_LEASED", "OBSERVE_ONE",
    "OBSERVE_ONE_BLOBS", "OBSERVE_MANY", "OBSERVE_MANY_BLOBS", "TRANSITION",
    "TRANSITION_BLOBS", "READ_TOMBSTONE", "READ_HEAD", "READ_LAST_EVENT",
    "READ_RECORDED_HEAD", "READ_SEQ_BELOW_ONE", "READ_EVENTS", "READ_EVENT_HASHES",
    "SEND_SIGNAL", "CANCEL_TASK", "READ_SIGNALS", "READ_BLOB_CHUNKS", "SET_ON_PARENT_END",
    "READ_CHILD",
    # wal_engine.runtime.resume
    "RESUME_HEAD", "READ_TAIL", "SAVE_SNAPSHOT", "DELETE_SNAPSHOTS", "LATEST_SNAPSHOT_SEQ",
})
"""The statements of one task's life: submission, appends, reads, resume, verification,
snapshots, signals, cancellation. Each must stay on the task's shard."""

MULTI: Final = {
    "APPEND_MANY": "group commit: the pending appends of many tasks in one statement and "
                   "one commit (on Citus a multi-shard transaction; per shard it could be "
                   "split into one such statement per shard)",
    "LIST_TASKS": "listing: a page of the tenant's tasks in id order",
    "RENEW_LEASES": "heartbeat: every lease one worker holds, many tasks",
    "CLAIM_TASKS": "claim across tasks: the due tasks of the tenant, by priority",
    "CLAIM_TASKS_BY_QUEUE": "claim across tasks, within queues' limits",
    "BREAK_LEASES": "sweep: the tenant's expired leases",
    "NEXT_WAKE": "the earliest timer among the tenant's waiting tasks",
    "REPLAY_CANDIDATES": "the deploy gate: live and recently finished tasks",
    "TASKS_BY_VERSION": "counts by agent, version and status",
    "ORPHAN_EVENT_TASKS": "verify --all: events whose task has no row, a full scan",
    "DEDUP_HOLDER": "the live task of a queue holding a dedup id: any task of the queue",
    "QUEUE_STATS": "each queue's depth and running count: an aggregate over live tasks",
    "LOCK_ENGINE_TABLES": "migration (the owner's): locks every shard",
    "FORK_TASK": "a fork copies its parent's history into a new task: two task ids",
}
"""Statements that reach many tasks on purpose, each with the reason."""

HOT_FUNCTIONS: Final = {
    "wal_emit": "p_task_id", "wal_emit_event": "p_task_id",
    "wal_send_signal": "p_task_id", "wal_cancel_task": "p_task_id",
    "wal_count_signal": "p_task_id", "wal_save_snapshot": "p_task_id",
    "wal_delete_snapshots": "p_task_id",
}
"""Functions of schema.sql the hot statements call (directly or through wal_emit), with the
variable that names their task."""

_REFERENCE: Final = re.compile(
    r"(?:\bFROM|\bJOIN|\bUPDATE|\bINTO|\bLOCK\s+TABLE|,)\s+(wal_[a-z_]+)\b"
    r"(?:\s+(?:AS\s+)?(?!WHERE\b|SET\b|ON\b|USING\b|JOIN\b|CROSS\b|LEFT\b|ORDER\b|GROUP\b|"
    r"LIMIT\b|VALUES\b|SELECT\b|RETURNING\b|IN\b|FOR\b|WITH\b)([a-z]\w*)\b)?",
    re.IGNORECASE)
_TENANT: Final = r"(?:current_setting\('wal\.tenant', true\)|my_tenant|v_tenant)"


def _statements() -> dict[str, str]:
    """Every SQL constant of the store's modules, by name (a dict of variants counts as one
    statement of the first variant's text plus the others)."""
    found: dict[str, str] = {}
    for module in (queries, resume):
        for name, value in vars(module).items():
            if not name.isupper() or name.startswith("_"):
                continue
            if isinstance(value, dict):
                value = "\n".join(str(item) for item in value.values())
            if isinstance(value, str) and re.search(r"\b(SELECT|INSERT|UPDATE|DELETE|LOCK)\b",
                                                    value):
                found[name] = value
    return found


def _function_body(name: str) -> str:
    start = SCHEMA.index(f"FUNCTION {name}(")
    body = SCHEMA[SCHEMA.index("$$", start) + 2:]
    return body[:body.index("$$")]


def _task_tables(statement: str) -> list[tuple[str, str | None]]:
    """The per-task tables a statement names, each with its alias (None: none)."""
    return [(m.group(1), m.group(2)) for m in _REFERENCE.finditer(statement)
            if m.group(1) in TASK_TABLES]


def _unfiltered(statement: str, task_variable: str = r"\$1") -> list[str]:
    """The per-task tables of ``statement`` not pinned to one task and one tenant: each
    reference needs its own ``alias.task_id = <task>`` and ``alias.tenant = <tenant>``
    (unaliased: the bare columns); an INSERT's rows need the task as their first value, or a
    row of a CTE that is itself pinned (its RETURNING task_id)."""
    task = rf"(?:\$\d+|{task_variable})"
    missing: list[str] = []
    counted: dict[str, int] = {}
    for table, alias in _task_tables(statement):
        key = alias or ""
        insert = re.search(rf"INSERT\s+INTO\s+{table}\b(?:\s+AS\s+\w+)?\s*\(\s*task_id\b[^)]*\)"
                           rf"\s*(?:VALUES\s*\(|SELECT\s+)\s*([\w.$]+)", statement)
        if insert is not None and (alias is None or alias.upper() == "AS"):
            first = insert.group(1)
            if re.fullmatch(task, first) or _pinned_cte(statement, first.split(".")[0],
                                                        task):
                continue
            missing.append(f"INSERT INTO {table} from {first}")
            continue
        counted[key] = counted.get(key, 0) + 1
        prefix = rf"{re.escape(alias)}\." if alias else r"(?<![\w.])"
        pins = len(re.findall(rf"{prefix}task_id\s*=\s*{task}\b", statement))
        tenants = len(re.findall(rf"{prefix}tenant\s*=\s*{_TENANT}", statement))
        if pins < counted[key] or tenants < counted[key]:
            missing.append(f"{table} {alias or ''}".strip())
    return missing


def _pinned_cte(statement: str, name: str, task: str) -> bool:
    """Whether CTE ``name`` of the statement yields one task's rows (pinned to it)."""
    start = re.search(rf"\b{re.escape(name)}\s+AS\s+\(", statement)
    if start is None:
        return False
    depth, index = 1, start.end()
    while depth and index < len(statement):
        depth += {"(": 1, ")": -1}.get(statement[index], 0)
        index += 1
    body = statement[start.end():index - 1]
    return bool(re.search(rf"task_id\s*=\s*{task}\b", body)
                or re.search(rf"(?:SELECT|VALUES\s*\()\s*{task}\s*,", body))


def test_every_statement_is_classified() -> None:
    """Each SQL constant of the store that names a per-task table is either hot (must stay
    on one shard) or listed as deliberately multi-shard with a reason: a new statement
    fails this test until it is classified."""
    statements = _statements()
    touching = {name for name, text in statements.items() if _task_tables(text)}
    assert touching - HOT - set(MULTI) == set(), "classify these statements"
    assert HOT <= set(statements) and set(MULTI) <= set(statements)
    assert not HOT & set(MULTI)
    assert all(len(reason) > 20 for reason in MULTI.values())


def test_hot_statements_filter_on_the_distribution_column() -> None:
    """Every hot statement pins each per-task table it names to one task (task_id equal to
    a parameter) and one tenant: on Citus, distributed by task id, it routes to one shard."""
    statements = _statements()
    failures = {name: _unfiltered(statements[name]) for name in sorted(HOT)}
    assert {name: found for name, found in failures.items() if found} == {}


def test_hot_functions_filter_on_the_distribution_column() -> None:
    """The schema's functions on the hot path pin every per-task table of every statement
    to their task's variable and the session's tenant; the hot statements call only them."""
    for name, variable in HOT_FUNCTIONS.items():
        body = _function_body(name)
        assert _task_tables(body), name
        assert _unfiltered(body, variable) == [], name
    called = set(re.findall(r"\b(wal_\w+)\(", "\n".join(_statements()[n] for n in HOT)))
    called -= {"wal_wake_token", "wal_queues"}
    assert called <= set(HOT_FUNCTIONS), called - set(HOT_FUNCTIONS)


def test_the_check_catches_a_statement_without_the_filter() -> None:
    """The checker itself fails a statement that reads a task's events by another column,
    or without the tenant, or inserts rows whose task comes from an unpinned source."""
    assert _unfiltered("SELECT seq FROM wal_events WHERE tenant = "
                       "current_setting('wal.tenant', true) AND seq = $1") == ["wal_events"]
    assert _unfiltered("SELECT seq FROM wal_events e WHERE e.task_id = $1") == ["wal_events e"]
    assert _unfiltered("SELECT e.seq FROM wal_tasks t JOIN wal_events e ON e.task_id = t.task_id"
                       " WHERE t.tenant = current_setting('wal.tenant', true)"
                       " AND t.task_id = $1") == ["wal_events e"]
    assert _unfiltered("WITH x AS (SELECT task_id FROM wal_tasks WHERE status = $1)"
                       " INSERT INTO wal_events (task_id, seq) SELECT x.task_id, 1 FROM x") \
        == ["wal_tasks", "INSERT INTO wal_events from x.task_id"]
    assert _unfiltered(queries.READ_EVENTS) == []
