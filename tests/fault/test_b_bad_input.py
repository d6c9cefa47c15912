"""Bad and hostile input B1-B9 (RELIABILITY.md) at every public entry point of the Python
API (submit, signal, approve, reconcile, cancel, fork, reads) and in the "a tool returns it"
form: a clear error, nothing written, nothing half-written, no retry loop after an effect.
(The CLI's entry points are covered by the CLI's own tests.)"""

from __future__ import annotations

import math
import resource
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fault import ledger_agents
from tests.fault.support import DEEP, check_everything, ledgered_engine, report
from tests.helpers import log_snapshot
from wal_engine import limits
from wal_engine.chain import event_hash
from wal_engine.engine import Engine
from wal_engine.errors import (
    CorruptionError,
    InvalidInput,
    UnknownTask,
    WalError,
)
from wal_engine.payloads import encode_payload
from wal_engine.runtime.context import AgentContext
from wal_engine.testing.crash import drive_to_quiescence, run_worker_until_idle
from wal_engine.testing.invariants import Violation
from wal_engine.testing.ledger import EffectLedger

ENTRY = "typed"
RETURNS = "returns"


class Order(msgspec.Struct, frozen=True, kw_only=True):
    """A typed agent input."""

    item: str
    quantity: int
    note: str | None = None


def _register(engine: Engine) -> None:
    ledger_agents.register(engine)
    ledger = EffectLedger.for_engine(engine)

    @engine.agent(ENTRY, input_type=Order)
    async def typed(ctx: AgentContext, task_input: Any) -> Any:
        return task_input

    values: dict[str, Any] = {}
    engine._b_values = values  # type: ignore[attr-defined]
    service = ledger.service("hostile", kind="idem", result=lambda a: {"acted": a["case"]})

    async def hostile(args: Any) -> Any:
        await service(args)  # The effect happens (counted once)...
        return values[args["case"]]  # ...then the answer is something no log can store.

    @engine.agent(RETURNS)
    async def returns(ctx: AgentContext, task_input: Any) -> Any:
        return await ctx.tool("hostile", hostile, {"case": task_input["case"]})


@pytest.fixture
async def engine(database_dsn: str) -> Any:
    made = await ledgered_engine(database_dsn)
    _register(made)
    try:
        yield made
    finally:
        await made.close()


async def _schema(engine: Engine) -> list[Any]:
    rows = await engine.database.fetch(
        "SELECT table_name, column_name, data_type FROM information_schema.columns "
        "WHERE table_schema = 'public' ORDER BY 1, 2")
    return [tuple(r) for r in rows]


# ----------------------------------------------------------------------------- B1


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
order_like = st.fixed_dictionaries(
    {}, optional={"item": json_like, "quantity": json_like, "note": json_like,
                  "extra": json_like})


@settings(max_examples=1000, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(candidate=st.one_of(order_like, json_like))
async def test_b1_malformed_inputs_are_refused_before_the_log(engine: Engine,
                                                              candidate: Any) -> None:
    """1,000 malformed or wrong-schema inputs: each is accepted whole or refused with
    InvalidInput, and a refused one writes nothing."""
    before = await engine.database.fetch("SELECT count(*) AS n FROM wal_events")
    try:
        await engine.submit(ENTRY, candidate)
    except InvalidInput:
        after = await engine.database.fetch("SELECT count(*) AS n FROM wal_events")
        assert after[0]["n"] == before[0]["n"]
        return
    msgspec.convert(candidate, Order)  # What was accepted was valid.


@pytest.mark.timeout(120)
async def test_b1_hand_corpus_at_every_entry_point(engine: Engine) -> None:
    """Missing fields, wrong types, extra fields and non-JSON values, at submit, signal,
    approve, reconcile, cancel, fork and the reads: clear errors, the log unchanged."""
    task_id = await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": True},
                                  task_id="b1")
    await run_worker_until_idle(engine)
    before = await log_snapshot(engine.database)
    bad_calls = [
        lambda: engine.submit(ENTRY, {"item": "x"}),
        lambda: engine.submit(ENTRY, {"item": 3, "quantity": "many"}),
        lambda: engine.submit(ENTRY, "not an object"),
        lambda: engine.submit(ENTRY, {"item": "x", "quantity": 1, "note": b"bytes"}),
        lambda: engine.submit(ledger_agents.AGENT, {"n": {1, 2}}),
        lambda: engine.submit(ledger_agents.AGENT, object()),
        lambda: engine.submit("", {}),
        lambda: engine.signal(task_id, "go", {1: "int key"}),
        lambda: engine.signal(task_id, "", {}),
        lambda: engine.signal(task_id, "x" * 10_000, {}),
        lambda: engine.signal("no-such-task", "go", {}),
        lambda: engine.approve(task_id, "no-such-call", approver="me"),
        lambda: engine.reconcile(task_id, "c", result=float("nan")),
        lambda: engine.cancel("bad id!"),
        lambda: engine.fork(task_id, 0),
        lambda: engine.fork(task_id, 10**6),
        lambda: engine.fork(task_id, 2**70),
        lambda: engine.state("no-such-task"),
        lambda: engine.head("../etc/passwd"),
        lambda: engine.history("x'); drop table wal_events; --"),
    ]
    violations: list[Violation] = []
    for number, call in enumerate(bad_calls):
        try:
            await call()
            violations.append(Violation(invariant="B1", detail=f"call {number} accepted"))
        except WalError:
            pass
        except Exception as error:
            violations.append(Violation(invariant="B1", detail=f"call {number} raised "
                                                               f"{type(error).__name__}: {error}"))
    if await log_snapshot(engine.database) != before:
        violations.append(Violation(invariant="B1", detail="the log changed"))
    report("B1", violations, tasks=1, calls_refused=len(bad_calls) - len(violations))


# ----------------------------------------------------------------------------- B2, B5, B6


HOSTILE_VALUES: dict[str, Any] = {
    "nan": float("nan"), "infinity": float("inf"), "minus_infinity": float("-inf"),
    "nul": "a\x00b", "surrogate": "\ud800", "bytes": b"\xff\xfe", "set": {1, 2},
    "deep": None, "huge_int": 2**64, "over_cap": "x" * (limits.payload_bytes_max + 1),
    "key_not_str": {1: "x"},
}


def _deep(levels: int) -> Any:
    value: Any = []
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.timeout(300)
async def test_b2_b5_b6_hostile_values_at_submit_signal_and_from_a_tool(engine: Engine) -> None:
    """NaN, infinities, NUL, lone surrogates, raw bytes, 20,000-deep nesting, huge integers
    and over-cap sizes: refused at submit and signal (nothing written); returned by a tool
    after it acted, recorded as a typed failure once, never retried into a loop."""
    values = dict(HOSTILE_VALUES, deep=_deep(20_000))
    engine._b_values.update(values)  # type: ignore[attr-defined]
    holder = await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": True},
                                 task_id="b5-holder")
    await run_worker_until_idle(engine)
    violations: list[Violation] = []
    refused = 0
    for case, value in values.items():
        before = await log_snapshot(engine.database)
        for attempt in (lambda v=value: engine.submit(ledger_agents.AGENT, {"v": v}),
                        lambda v=value: engine.signal(holder, "other", {"v": v})):
            try:
                await attempt()
                violations.append(Violation(invariant="B5", detail=f"{case} accepted"))
            except InvalidInput:
                refused += 1
            except Exception as error:
                violations.append(Violation(invariant="B5", detail=f"{case}: "
                                            f"{type(error).__name__}: {error}"[:300]))
        if await log_snapshot(engine.database) != before:
            violations.append(Violation(invariant="B5", detail=f"{case}: the log changed"))
    for case in values:
        await engine.submit(RETURNS, {"case": case}, task_id=f"b5-{case}")
    await drive_to_quiescence(engine, [f"b5-{case}" for case in values])
    for case in values:
        state = await engine.state(f"b5-{case}")
        failure = None if state.failure is None else state.failure.error or ""
        if state.status is None or str(state.status) != "FAILED" \
                or "UnstorableResult" not in (failure or ""):
            violations.append(Violation(invariant="B5", task_id=f"b5-{case}",
                                        detail=f"{state.status}: {failure}"[:300]))
    rows = await EffectLedger.for_engine(engine).effects()
    acted = {r.key: r for r in rows if r.tool == "hostile"}
    violations += [Violation(invariant="B5", detail=f"{key} delivered {r.deliveries} times")
                   for key, r in acted.items() if r.deliveries != 1 or r.applied != 1]
    more, effects = await check_everything(engine)
    report("B2/B5/B6", violations + more, tasks=len(values) + 1, effects=effects,
           hostile_values=len(values), refused_at_the_boundary=refused,
           recorded_as_failure_once=len(acted))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size_mb", [pytest.param(64, id="64MiB"),
                                     pytest.param(300, id="300MiB", marks=pytest.mark.deep)])
async def test_b2_oversized_payloads_are_refused_without_reaching_postgres(
        engine: Engine, size_mb: int) -> None:
    """An input of 64 MiB (300 MiB deep: past jsonb's container limit) is refused by the
    size cap before anything is sent; the process stays within a memory budget."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    huge = "x" * (size_mb * 1024 * 1024)
    before = await log_snapshot(engine.database)
    started = time.monotonic()
    with pytest.raises(InvalidInput):
        await engine.submit(ledger_agents.AGENT, {"blob": huge})
    elapsed = time.monotonic() - started
    del huge
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    violations = []
    if await log_snapshot(engine.database) != before:
        violations.append(Violation(invariant="B2", detail="the log changed"))
    if rss_growth_mb > 4 * size_mb + 100:
        violations.append(Violation(invariant="B2", detail=f"RSS grew {rss_growth_mb:.0f} MB"))
    report(f"B2 {size_mb}MiB", violations, tasks=0, refused_in_s=round(elapsed, 2),
           rss_growth_mb=round(rss_growth_mb))


# ----------------------------------------------------------------------------- B3


async def _plant(engine: Engine, task_id: str, event_type: str, version: int,
                 payload: bytes) -> None:
    """Append a row by hand (as an admin would), chained correctly so that only its type
    or version is wrong."""
    head = await engine.head(task_id)
    last = await engine.database.fetch(
        "SELECT epoch FROM wal_events WHERE task_id = $1 AND seq = $2", task_id, head.head_seq)
    epoch = int(last[0]["epoch"])
    digest = event_hash(head.head_hash, task_id, head.head_seq + 1, event_type, version, epoch,
                        payload)
    await engine.database.fetch(
        "INSERT INTO wal_events (task_id, seq, type, version, epoch, payload, hash)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7)",
        task_id, head.head_seq + 1, event_type, version, epoch, payload, digest)


@pytest.mark.timeout(120)
async def test_b3_unknown_types_and_future_versions_fail_closed(engine: Engine) -> None:
    """Rows of an unknown type or a future version, planted by hand: reads fail closed
    (CorruptionError), and a worker quarantines the task (FAILED, unreadable_log) without
    skipping the row or acting."""
    cases = {"x_unknown": ("x_unknown", 1), "future": ("message_appended", 99)}
    violations: list[Violation] = []
    for name, (event_type, version) in cases.items():
        task_id = await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0,
                                                            "wait": True}, task_id=f"b3-{name}")
        await run_worker_until_idle(engine)
        await _plant(engine, task_id, event_type, version, b'{"role":"x","content":"y"}')
        try:
            await engine.state(task_id)
            violations.append(Violation(invariant="B3", task_id=task_id,
                                        detail="the unreadable log folded"))
        except CorruptionError:
            pass
        deliveries = (await EffectLedger.for_engine(engine).totals()).deliveries
        await engine.signal(task_id, "go", {"ok": True})
        await drive_to_quiescence(engine, [task_id], rounds_max=3, deadline_s=10)
        head = await engine.head(task_id)
        last = (await engine.history(task_id))[-1]
        if str(head.status) != "FAILED" or b"unreadable_log" not in last.payload:
            violations.append(Violation(invariant="B3", task_id=task_id,
                                        detail=f"{head.status}, last {last.type}"))
        if (await EffectLedger.for_engine(engine).totals()).deliveries != deliveries:
            violations.append(Violation(invariant="B3", task_id=task_id,
                                        detail="acted on an unreadable log"))
    report("B3", violations, tasks=len(cases), planted_rows=len(cases))


# ----------------------------------------------------------------------------- B4


INJECTION_CORPUS = [
    "x'); drop table wal_events; --", "$1", "%s", "\\", ";", "'", '"', "\u2019",
    "\n\x1b[31mFAKE LOG LINE", "a" * 10_000, "../../etc/passwd", "task\x00id", "",
    "Robert'); DROP TABLE Students;--", "1 OR 1=1", "${jndi:ldap://x}",
]


@settings(max_examples=500, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(candidate=st.one_of(st.sampled_from(INJECTION_CORPUS), st.text(max_size=200)))
async def test_b4_injection_shaped_ids_and_names(engine: Engine, candidate: str) -> None:
    """500 SQL- and log-injection-shaped task ids and signal names: refused by the
    allow-list or stored verbatim through parameters; the schema never changes."""
    schema = await _schema(engine)
    try:
        task_id = await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0,
                                                            "wait": True}, task_id=candidate)
        assert task_id == candidate
        assert (await engine.head(candidate)).task_id == candidate
    except InvalidInput:
        pass
    holder = "b4-holder"
    await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": True},
                        task_id=holder)
    try:
        signal_id = await engine.signal(holder, candidate, {"note": candidate})
        rows = await engine.database.fetch(
            "SELECT name FROM wal_signals WHERE signal_id = $1", signal_id)
        assert rows[0]["name"] == candidate
    except InvalidInput:
        pass
    assert await _schema(engine) == schema


# ----------------------------------------------------------------------------- B8


@pytest.mark.timeout(120)
async def test_b8_out_of_range_values_planted_by_an_admin(engine: Engine) -> None:
    """Timestamps at infinity or in the year 20000 and seqs out of range: appends refuse
    them, and readers of a planted row answer or fail with a clear error, never crash."""
    violations: list[Violation] = []
    task_id = await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": True},
                                  task_id="b8")
    await run_worker_until_idle(engine)
    head = await engine.head(task_id)
    for seq in (-5, 0, 2**63 - 1, 2**63):
        try:
            await engine.store.append_events(
                task_id, [__import__("wal_engine.events", fromlist=["x"]).MessageAppended(
                    role="x", content="y")], epoch=head.lease_epoch, expected_seq=seq,
                prev_hash=head.head_hash)
            violations.append(Violation(invariant="B8", detail=f"append at seq {seq} accepted"))
        except WalError:
            pass
        except Exception as error:
            violations.append(Violation(invariant="B8", detail=f"seq {seq}: "
                                        f"{type(error).__name__}: {error}"[:200]))
    planted = 0
    for column, value in (("wake_at", "infinity"), ("wake_at", "20000-01-01"),
                          ("lease_expires_at", "-infinity"), ("updated_at", "20000-01-01")):
        await engine.database.fetch(
            f"UPDATE wal_tasks SET {column} = $2::text::timestamptz WHERE task_id = $1",
            task_id, value)
        planted += 1
        for name, read in (("head", lambda: engine.head(task_id)),
                           ("list", lambda: engine.store.list_tasks()),
                           ("state", lambda: engine.state(task_id)),
                           ("claim", lambda: run_worker_until_idle(engine, timeout_s=10))):
            try:
                await read()
            except WalError:
                pass
            except Exception as error:
                violations.append(Violation(invariant="B8", task_id=task_id,
                                            detail=f"{name} with {column}={value}: "
                                                   f"{type(error).__name__}: {error}"[:200]))
    report("B8", violations, tasks=1, rows_planted=planted, seqs_tried=4)


# ----------------------------------------------------------------------------- B9


@pytest.mark.timeout(120)
async def test_b9_canonical_json_hashes_are_stable(engine: Engine) -> None:
    """Key order, duplicate keys, whitespace, -0.0, 1e400 and big numbers: equal values
    encode to equal bytes, the log stores those bytes, and every chain verifies after the
    round trip through PostgreSQL."""
    import orjson

    violations: list[Violation] = []
    pairs = [({"b": 1, "a": 2}, {"a": 2, "b": 1}),
             (orjson.loads('{"a": 1, "a": 3}'), {"a": 3}),
             (orjson.loads('{ "x" :\n [1 ,2] }'), {"x": [1, 2]}),
             ({"n": -0.0}, {"n": -0.0}),
             ({"n": 2**63 - 1}, {"n": 9223372036854775807})]
    for left, right in pairs:
        if encode_payload(left) != encode_payload(right):
            violations.append(Violation(invariant="B9", detail=f"{left!r} != {right!r}"))
    try:
        encode_payload({"n": float("1e400")})
        violations.append(Violation(invariant="B9", detail="1e400 (infinity) was accepted"))
    except InvalidInput:
        pass
    for number, (left, right) in enumerate(pairs):
        first = await engine.submit(ledger_agents.AGENT, {"n": 1, "v": left, "sleep_ms": 0,
                                                          "wait": False}, task_id=f"b9-{number}")
        again = await engine.submit(ledger_agents.AGENT, {"n": 1, "v": right, "sleep_ms": 0,
                                                          "wait": False}, task_id=f"b9-{number}")
        if first != again:
            violations.append(Violation(invariant="B9", detail="resubmission not idempotent"))
    await drive_to_quiescence(engine)
    for number in range(len(pairs)):
        report_ = await engine.store.verify_task(f"b9-{number}")
        if not report_.ok:
            violations.append(Violation(invariant="I13", task_id=f"b9-{number}",
                                        detail=str(report_.violation)))
    more, effects = await check_everything(engine)
    report("B9", violations + more, tasks=len(pairs), effects=effects, value_pairs=len(pairs))


# ----------------------------------------------------------------------------- B7 (deep)


@pytest.mark.deep
@pytest.mark.timeout(900)
async def test_b7_huge_history_replays_within_budget(engine: Engine) -> None:
    """10^4 (deep: 10^5) events in one task: the state folds from a snapshot plus tail
    within 2 s, and memory stays within budget."""
    from wal_engine import events as ev

    count = 100_000 if DEEP else 10_000
    task_id = await engine.submit(ledger_agents.AGENT, {"n": 1, "sleep_ms": 0, "wait": True},
                                  task_id="b7")
    # Claimed (RUNNING) but not run: the test writes the history itself.
    await engine.database.fetch("SELECT * FROM wal_claim_tasks('b7-writer', 1, 600000)")
    head = await engine.head(task_id)
    last = await engine.database.fetch(
        "SELECT epoch FROM wal_events WHERE task_id = $1 AND seq = $2", task_id, head.head_seq)
    epoch, seq, digest = int(last[0]["epoch"]), head.head_seq, head.head_hash
    batch = [ev.MessageAppended(role="tool", content="x" * 100)] * 1000
    for _ in range(count // 1000):
        result = await engine.store.append_events(task_id, batch, epoch=epoch,
                                                  expected_seq=seq, prev_hash=digest)
        seq, digest = result.head_seq, result.head_hash
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    state = await engine.state(task_id)
    elapsed = time.monotonic() - started
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    violations = []
    if state.last_seq != seq:
        violations.append(Violation(invariant="B7", detail="the fold stopped early"))
    if elapsed > 2.0 * (count / 10_000):
        violations.append(Violation(invariant="B7", detail=f"fold took {elapsed:.2f} s"))
    report("B7", violations, tasks=1, events=seq, fold_s=round(elapsed, 2),
           rss_growth_mb=round(rss_growth_mb), finite=math.isfinite(elapsed))


__all__ = ["UnknownTask"]
