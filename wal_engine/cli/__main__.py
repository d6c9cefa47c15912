"""``python -m wal_engine.cli``: the same as the ``wal-engine`` command."""

from wal_engine.cli import main

main()
