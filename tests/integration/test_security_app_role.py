"""The store, runtime, resume/fork and idempotency suites again, connected as a tenant's
login role, a member of the application role of security.sql (issue 9: "the whole
existing test suite still passes when the engine connects as the application role";
issue 16: each tenant logs in as a role of its own).

The test functions are those of the suites themselves; only the ``database_dsn`` fixture
differs: the fresh database gets security.sql, and the DSN logs in as the role of tenant
"default". Tests
that need privileges the runtime never has (they create tables or rewrite the log on
purpose) are left out, each with its reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import pytest_asyncio

from tests.integration import test_idempotency, test_resume_fork, test_runtime, test_store
from tests.integration.tenant_roles import TenantRoles, secure
from wal_engine.testing.postgres import DatabaseFactory

NEEDS_PRIVILEGES: dict[str, str] = {
    "test_events_table_is_append_only": "expects the trigger's WE002; the app role gets 42501 "
                                        "first (test_security_roles S1/S2)",
    "test_schema_is_idempotent_and_versioned": "drops a table: migrations run as the owner",
    "test_transactional_effect_is_exactly_once_under_concurrency": "creates a table",
    "test_missing_or_altered_segment_makes_resume_raise": "deletes snapshot segments "
    "directly: runtime roles hold no DELETE (LOCK TABLE in any mode, issue 16)",
    "test_worker_drops_a_corrupt_snapshot_and_folds_the_log": "deletes snapshot segments "
    "directly, likewise",
    "test_a_checkpoint_does_not_wait_for_its_snapshot": "holds wal_snapshots with LOCK TABLE "
    "to stall the background write: runtime roles may not lock tables",
}


def _suite(module: ModuleType) -> dict[str, Any]:
    tests = {}
    for name, value in vars(module).items():
        # Left out, not marked: a mark would stick to the suite's own function as well.
        if name.startswith("test_") and callable(value) and name not in NEEDS_PRIVILEGES:
            tests[name] = value
    return tests


for _module in (test_store, test_runtime, test_resume_fork, test_idempotency):
    _clashes = set(_suite(_module)) & {k for k in globals() if k.startswith("test_")}
    assert not _clashes, _clashes
    globals().update(_suite(_module))


@pytest_asyncio.fixture
async def database_dsn(database_factory: DatabaseFactory) -> AsyncIterator[str]:
    """A fresh database with security.sql applied; the DSN logs in as tenant "default"'s
    role."""
    dsn = await database_factory.create()
    await secure(dsn)
    roles = TenantRoles(dsn)
    yield await roles.dsn("default")
    await roles.close()
    await database_factory.drop(dsn)
