"""Public helpers to test agents built on wal-engine against a real PostgreSQL.

``wal_engine.testing.postgres`` starts (or borrows) a server and hands out a fresh database
per test, created from a template that already holds the schema.
"""

from wal_engine.testing.postgres import DatabaseFactory, TestServer, start_test_server

__all__ = ["DatabaseFactory", "TestServer", "start_test_server"]
