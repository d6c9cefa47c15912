"""What keying row security on the login role costs on the hot path (issue 16).

Two scratch databases on one server, each with ``security.sql`` applied and a tenant's
login role: in ``wal_bench_tenancy_setting`` the policies are the former ones, keyed on the
session's ``wal.tenant`` (the shared-role design any session could SET); in
``wal_bench_tenancy_role`` they are the current ones, keyed on ``session_user`` through
``wal_tenant_roles`` (decision 35 of ``docs/architecture.md``). The same operations run
interleaved, in the same run, as the tenant's role on both, and as a superuser (row
security bypassed) for scale:

* ``append``: one 500-byte event per fenced append (``Store.append_events``), one commit;
* ``claim``: claim one queued task (``wal_claim_tasks``, SECURITY DEFINER: the policies
  run as the owner) and complete it (a status move), two statements.
* ``policy``: 1,000 primary-key probes of ``wal_tasks`` and ``wal_events`` in one ``DO``
  block: the per-statement cost of the policies alone, without round trips or client
  scheduling (the figure that stays readable on a loaded machine; events/s counts probes).

The reference is the former policy ("before"); the ratio of the current one is the cost.

Usage: ``python -m benchmarks.tenancy [--dsn DSN] [--quick] [--rounds N] [--ops N]``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import Final

import asyncpg

from benchmarks import append, harness
from wal_engine import events as vocabulary
from wal_engine.security.tenants import TenantExists, create_tenant, rotate_tenant
from wal_engine.store import Database, PendingAppend, Store
from wal_engine.store.connection import DSN_ENV, ensure_database, resolve_dsn, with_database
from wal_engine.store.setup import apply_security

NAME: Final = "tenancy"
SETTING_DATABASE: Final = "wal_bench_tenancy_setting"
ROLE_DATABASE: Final = "wal_bench_tenancy_role"
TENANT: Final = "bench-tenant"
POLICY_TABLES: Final = ("wal_tasks", "wal_events", "wal_snapshots", "wal_snapshot_segments",
                        "wal_idempotency", "wal_signals", "wal_tenants")

# The policy every tenant table had before issue 16 (a benchmark-only copy).
SETTING_POLICY: Final = """
DROP POLICY IF EXISTS wal_tenant_isolation ON {table};
CREATE POLICY wal_tenant_isolation ON {table}
    USING (tenant = current_setting('wal.tenant', true))
    WITH CHECK (tenant = current_setting('wal.tenant', true))
"""


async def _prepare(server_dsn: str, database: str, *, setting_policy: bool) -> tuple[str, str]:
    """The scratch database secured, its policies chosen; (superuser DSN, tenant DSN)."""
    await ensure_database(server_dsn, database)
    dsn = with_database(server_dsn, database)
    admin = await asyncpg.connect(dsn)
    try:
        await apply_security(admin)
        if setting_policy:
            for table in POLICY_TABLES:
                await admin.execute(SETTING_POLICY.format(table=table))
        try:
            credentials = await create_tenant(admin, TENANT, dsn=dsn)
        except TenantExists:
            credentials = await rotate_tenant(admin, TENANT, dsn=dsn)
    finally:
        await admin.close()
    return dsn, credentials.dsn


# One operation of the ``policy`` workload: each PERFORM is a statement the policies of
# both tables apply to (the DO block runs with the caller's rights).
POLICY_PROBES: Final = """
DO $probes$
BEGIN
    FOR i IN 1..{probes} LOOP
        PERFORM 1 FROM wal_tasks
         WHERE tenant = current_setting('wal.tenant', true) AND task_id = 'probe-' || i;
        PERFORM 1 FROM wal_events
         WHERE tenant = current_setting('wal.tenant', true) AND task_id = 'probe-' || i
           AND seq = 1;
    END LOOP;
END
$probes$
"""
probes_per_op: Final = 500


class Side:
    """One contender's database connection, tasks and queue of claimable tasks."""

    def __init__(self, database: Database, run_id: str, name: str) -> None:
        self.store = Store(database)
        self.bench = append.Bench(self.store, database.pool, run_id=run_id)
        self.name = name
        self.counter = 0

    async def append_operation(self) -> Callable[[], Awaitable[None]]:
        """One fenced single-event append on a claimed task of this side."""
        (head,) = await self.bench.create_heads([self.bench.task_id("wal", self.name)])
        return self.bench.append_events(head, 1)

    async def queue(self, count: int) -> None:
        """Untimed: ``count`` tasks to claim."""
        for _ in range(count):
            self.counter += 1
            await self.store.create_task(
                self.bench.task_id("claim", f"{self.name}-{self.counter}"), harness.BENCH_AGENT)

    def probe_operation(self) -> Callable[[], Awaitable[None]]:
        """One DO block of primary-key probes under the policies."""
        pool = self.store.database.pool
        statement = POLICY_PROBES.format(probes=probes_per_op)

        async def operation() -> None:
            async with pool.acquire() as connection:
                await connection.execute(statement)

        return operation

    def claim_operation(self) -> Callable[[], Awaitable[None]]:
        """Claim one queued task and complete it."""
        store = self.store

        async def operation() -> None:
            rows = await store.database.fetch(harness.CLAIM_TASKS, "bench-claim", 1,
                                              harness.LEASE_TTL_MS)
            if len(rows) != 1:
                raise RuntimeError(f"{self.name}: claimed {len(rows)} tasks, expected 1")
            row = rows[0]
            outcome = await store.append_many([PendingAppend(
                task_id=row["task_id"], epoch=row["lease_epoch"], expected_seq=row["head_seq"],
                prev_hash=row["head_hash"], events=[vocabulary.TaskCompleted()])])
            if isinstance(outcome[row["task_id"]], Exception):
                raise outcome[row["task_id"]]

        return operation


async def main() -> int:
    parser = harness.argument_parser(NAME, __doc__, rounds=20, ops=50)
    args = parser.parse_args()
    settings = harness.RunSettings.from_args(args, quick_rounds=3, quick_ops=8)
    server_dsn = args.dsn or os.environ.get(DSN_ENV) or await resolve_dsn()
    run_id = f"{time.strftime('%m%d%H%M%S')}-{os.getpid()}"
    _, setting_tenant = await _prepare(server_dsn, SETTING_DATABASE,
                                                   setting_policy=True)
    role_admin, role_tenant = await _prepare(server_dsn, ROLE_DATABASE, setting_policy=False)
    opened: list[Database] = []
    sides: dict[str, Side] = {}
    for label, dsn, development in (
            ("before: policy on wal.tenant", setting_tenant, False),
            ("after: policy on the login role", role_tenant, False),
            ("superuser (row security bypassed)", role_admin, True)):
        database = await Database.open(dsn, migrate=False, development=development,
                                       tenant=TENANT, application_name="bench:tenancy")
        opened.append(database)
        sides[label] = Side(database, run_id, f"s{len(sides)}")
    try:
        machine = await harness.describe_machine(role_admin)
        per_round = settings.ops + 2  # the harness's warm-up operations
        appends = [harness.Contender(label, await side.append_operation(),
                                     reference=label.startswith("before"))
                   for label, side in sides.items()]
        claims = [harness.Contender(label, side.claim_operation(),
                                    reference=label.startswith("before"),
                                    before_round=_queuer(side, per_round))
                  for label, side in sides.items()]
        probes = [harness.Contender(label, side.probe_operation(),
                                    events_per_op=2 * probes_per_op,
                                    reference=label.startswith("before"))
                   for label, side in sides.items()]
        results = [
            await harness.run_workload(harness.Workload(
                name="append", description="one 500-byte event per fenced append, one commit",
                contenders=appends, ops_per_round=settings.ops), rounds=settings.rounds),
            await harness.run_workload(harness.Workload(
                name="claim", description="claim one task and complete it (two statements)",
                contenders=claims, ops_per_round=settings.ops), rounds=settings.rounds),
            await harness.run_workload(harness.Workload(
                name="policy", description=f"{2 * probes_per_op} primary-key probes in one"
                " DO block", contenders=probes, ops_per_round=max(3, settings.ops // 5)),
                rounds=settings.rounds),
        ]
        for side in sides.values():
            await side.bench.complete_all()
    finally:
        for database in opened:
            await database.close()
    print(harness.format_report(NAME, machine, results, settings))
    if not args.no_json:
        path = harness.write_json(NAME, machine, results, settings, path=args.json_path)
        print(f"Results written to {path}")
    return 0


def _queuer(side: Side, count: int) -> Callable[[int], Awaitable[None]]:
    async def before_round(_round: int) -> None:
        await side.queue(count)

    return before_round


if __name__ == "__main__":
    harness.run_main(main)
