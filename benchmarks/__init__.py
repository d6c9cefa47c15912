"""Runnable benchmarks: wal-engine against raw asyncpg on the same PostgreSQL, same run.

Each script (``python -m benchmarks.<name>``) builds its workloads on :mod:`benchmarks.harness`,
which resolves the DSN, describes the machine, runs contenders interleaved in rounds, and
prints a Markdown table with ratios to the raw-asyncpg reference (and writes it as JSON to
``benchmarks/results/<name>.json``).

``python -m benchmarks [--quick] [--dsn DSN]`` runs the whole suite side by side: raw asyncpg,
wal-engine, LangGraph's ``AsyncPostgresSaver`` and DBOS Transact on one agent workload (see
:mod:`benchmarks.suite`), writing ``benchmarks/results/latest.json``.
"""
