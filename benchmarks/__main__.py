"""``python -m benchmarks``: the whole suite (see :mod:`benchmarks.suite`)."""

from benchmarks.suite import entry

entry()
