"""Integrations of wal-engine with agent frameworks, each behind an optional extra.

Nothing here is imported by the core library: ``import wal_engine`` never loads a
framework. Each integration lives in its own subpackage and imports its framework on use,
for example :mod:`wal_engine.integrations.langgraph` (extra ``[langgraph]``).
"""
