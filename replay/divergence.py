"""Non-determinism: today's agent code asks for other external calls than the log recorded.

Re-running agent code against its history is only sound if the code makes the same calls in
the same order. When it does not, the journal cursor raises :class:`NonDeterminismError`
with the seq where the histories part, both sides, and the fork point: the last seq before
the divergence. Forking the task there (``wal_engine.runtime.resume.fork``) keeps everything up to
the divergence and lets today's code continue from it.
"""

from __future__ import annotations

from wal_engine.errors import CallSignature as CallSignature
from wal_engine.errors import NonDeterminismError as NonDeterminismError

