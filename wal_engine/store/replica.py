"""Reading the log from a streaming standby: is it one, and how far behind is it.

Audits (``history``, ``verify``, ``timeline``, ``tasks``, ``show``) can read a hot standby
instead of the primary (the CLI's ``--replica``). What they print is the log as the standby
has replayed it, so they say how far behind that is:

* on the standby alone: the WAL received and replayed (``pg_last_wal_receive_lsn``,
  ``pg_last_wal_replay_lsn``), whether replay is paused, and the age of the last replayed
  commit (``clock_timestamp() - pg_last_xact_replay_timestamp()``; it grows while the
  primary is idle too, so it is an upper bound of the lag, not the lag);
* with the primary reachable as well: the bytes of WAL the standby has still to replay
  (``pg_current_wal_lsn()`` on the primary less the standby's replay position; the standby
  is read first, so the figure is never smaller than the lag was when the audit began).

Nothing here writes; the statements are plain reads of server functions.
"""

from __future__ import annotations

import datetime as dt
from typing import Final

import asyncpg
import msgspec

from wal_engine.errors import DatabaseUnavailable, NotAStandby
from wal_engine.store.connection import CONNECTION_ERRORS, Database, connect_once, redact_dsn

STANDBY_STATUS: Final = """
SELECT pg_is_in_recovery() AS in_recovery,
       pg_last_wal_receive_lsn()::text AS receive_lsn,
       pg_last_wal_replay_lsn()::text AS replay_lsn,
       pg_last_xact_replay_timestamp() AS replay_timestamp,
       extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8
           AS replay_age_s,
       CASE WHEN pg_is_in_recovery() THEN pg_is_wal_replay_paused() ELSE false END AS paused
"""
PRIMARY_POSITION: Final = """
SELECT pg_is_in_recovery() AS in_recovery,
       CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_lsn()::text END AS lsn
"""


def lsn_bytes(lsn: str) -> int:
    """A ``pg_lsn`` text (``16/B374D848``) as a byte position."""
    high, _, low = lsn.partition("/")
    return (int(high, 16) << 32) + int(low, 16)


class ReplicaStatus(msgspec.Struct, frozen=True, kw_only=True):
    """How far behind a standby is, as read at the start of an audit."""

    replica: str
    """The standby's DSN, without its password."""
    receive_lsn: str | None
    replay_lsn: str | None
    replay_paused: bool
    last_replayed_commit_at: dt.datetime | None
    """Commit time (on the primary) of the last transaction replayed; None before any."""
    last_replayed_commit_age_s: float | None
    """Seconds since that commit, by the standby's clock (an upper bound of the lag)."""
    primary_lsn: str | None = None
    """The primary's current WAL position, when the primary was read."""
    bytes_behind: int | None = None
    """WAL bytes the standby has still to replay, when the primary was read."""
    primary_note: str | None = None
    """Why the primary was not compared (not given, unreachable, itself a standby)."""

    def summary(self) -> str:
        """One line for people."""
        parts = [f"reading standby {self.replica}"]
        if self.replay_paused:
            parts.append("replay PAUSED")
        if self.bytes_behind is not None:
            parts.append("caught up with the primary" if self.bytes_behind == 0 else
                         f"{self.bytes_behind} bytes of WAL behind the primary "
                         f"(primary at {self.primary_lsn}, replayed {self.replay_lsn})")
        else:
            parts.append(f"replayed up to {self.replay_lsn}; not compared with the primary "
                         f"({self.primary_note})")
        if self.last_replayed_commit_age_s is None:
            parts.append("no commit replayed since it started")
        else:
            parts.append(f"last replayed commit {self.last_replayed_commit_age_s:.3f} s ago")
        return "; ".join(parts)

    def as_json(self) -> dict[str, object]:
        """The status as JSON values (timestamps as ISO 8601 text)."""
        stamp = self.last_replayed_commit_at
        return {"replica": self.replica, "receive_lsn": self.receive_lsn,
                "replay_lsn": self.replay_lsn, "replay_paused": self.replay_paused,
                "last_replayed_commit_at": None if stamp is None else stamp.isoformat(),
                "last_replayed_commit_age_s": self.last_replayed_commit_age_s,
                "primary_lsn": self.primary_lsn, "bytes_behind": self.bytes_behind,
                "primary_note": self.primary_note}


async def replica_status(replica: Database, replica_dsn: str,
                         primary_dsn: str | None) -> ReplicaStatus:
    """Read how far ``replica`` is behind, comparing with ``primary_dsn`` when given.

    Raises:
        NotAStandby: ``replica`` is not in recovery.
    """
    row = await replica.fetchrow(STANDBY_STATUS)
    if not row["in_recovery"]:
        raise NotAStandby(redact_dsn(replica_dsn))
    status = ReplicaStatus(
        replica=redact_dsn(replica_dsn), receive_lsn=row["receive_lsn"],
        replay_lsn=row["replay_lsn"], replay_paused=bool(row["paused"]),
        last_replayed_commit_at=row["replay_timestamp"],
        last_replayed_commit_age_s=row["replay_age_s"])
    if primary_dsn is None:
        return msgspec.structs.replace(status, primary_note="no primary DSN given")
    try:
        connection = await connect_once(primary_dsn)
    except DatabaseUnavailable as error:
        return msgspec.structs.replace(
            status, primary_note=f"primary unreachable at {redact_dsn(primary_dsn)}: "
                                 f"{error.reason}")
    try:
        primary = await connection.fetchrow(PRIMARY_POSITION)
    except (*CONNECTION_ERRORS, asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as error:
        return msgspec.structs.replace(
            status, primary_note=f"primary {redact_dsn(primary_dsn)} could not be read: "
                                 f"{type(error).__name__}")
    finally:
        await connection.close()
    if primary["in_recovery"] or primary["lsn"] is None:
        return msgspec.structs.replace(
            status, primary_note=f"{redact_dsn(primary_dsn)} is itself a standby")
    replayed = status.replay_lsn
    behind = None if replayed is None else max(0, lsn_bytes(primary["lsn"])
                                               - lsn_bytes(replayed))
    return msgspec.structs.replace(status, primary_lsn=primary["lsn"], bytes_behind=behind)
