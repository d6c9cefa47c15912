"""``wal-engine gateway``: an HTTP idempotency gateway in front of upstream APIs.

Needs the ``gateway`` extra (``pip install 'wal-engine[gateway]'``, plus ``[redis]`` for a
Redis store). See :mod:`wal_engine.gateway.app` for the semantics and
:mod:`wal_engine.gateway.config` for the configuration file.
"""

from __future__ import annotations
