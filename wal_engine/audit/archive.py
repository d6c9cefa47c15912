"""Retention archives: the verifiable file a batch of finished tasks leaves the database in
(decision 69 of docs/architecture.md; written by :mod:`wal_engine.audit.retention`).

An archive is JSON lines, one object per line, each with a ``kind``:

* ``archive`` (first line): format, version, tenant, database, created_at, tasks;
* ``task``: one per task, before its other lines: id, agent, status, ending event type,
  head seq and hash, the idempotency keys its tombstone keeps;
* ``blob``: a chunk of one of the task's large values as stored in ``wal_blobs`` (digest,
  ordinal, value_bytes, the zstd frame in base64);
* ``event``: one row of ``wal_events`` as stored: seq, type, version, epoch, chain
  version, recorded_at (ISO 8601, microseconds), idempotency key (the event's own, also
  where its row derives it), hash (hex; archives written before schema version 5 also
  hold each row's prev_hash, which nothing reads: the previous line's hash is) and the
  payload: the row's exact bytes (a compressed row's content, decision 71) as UTF-8 text
  (``payload``), or base64 (``payload_b64``) for bytes that are not UTF-8;
* ``anchor`` (last line): an anchor (:mod:`wal_engine.audit.anchor`) over the archived
  tasks' heads, signed when the run had a key.

:func:`verify_archive` needs no database: it recomputes every chain (the semantic checks
of ``verify`` included, large values reassembled and checked against their digests),
compares each chain's end with its task line and with the anchor, and checks the anchor's
root and signature. An edited payload, a dropped or added line, a task left out and an
anchor that was changed or re-signed by another key all fail, each with its own finding.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import msgspec
import orjson

from wal_engine import blobs
from wal_engine.audit.anchor import (
    Anchor,
    AnchoredHead,
    check_signature,
    leaf_hash,
    merkle_root,
)
from wal_engine.errors import AnchorInvalid
from wal_engine.state_machine import TERMINAL, Status
from wal_engine.store.records import EventRecord
from wal_engine.verification import HistoryVerifier

ARCHIVE_FORMAT: Final = "wal-engine-archive"
ARCHIVE_VERSION: Final = 1
archive_line_bytes_max: Final = 128 * 1024 * 1024
"""Longest line read back (a 16 MiB row whose every byte is escaped stays below it)."""
_ENDED: Final = frozenset(status.value for status in TERMINAL)
archive_findings_max: Final = 1000
"""Findings reported at most (an archive edited everywhere stops being listed)."""


class ArchiveFinding(msgspec.Struct, frozen=True, kw_only=True):
    """One thing wrong with an archive."""

    task_id: str | None
    seq: int | None
    kind: str
    """``format``, ``chain`` (with the chain's own kind in the detail), ``head``,
    ``status``, ``anchor`` or ``signature``."""
    detail: str


class ArchiveReport(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of verifying one archive file."""

    path: str
    tenant: str | None
    tasks: int
    events: int
    signed: bool
    findings: list[ArchiveFinding]

    @property
    def ok(self) -> bool:
        """Whether every chain, the task lines and the anchor hold."""
        return not self.findings


# ------------------------------------------------------------------------------ writing


def header_line(*, tenant: str, database: str, created_at: dt.datetime, tasks: int) -> bytes:
    """The first line."""
    return _line({"kind": "archive", "format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION,
                  "tenant": tenant, "database": database,
                  "created_at": created_at.astimezone(dt.UTC).isoformat(), "tasks": tasks})


def task_line(row: Any, keys: list[str]) -> bytes:
    """The line opening one task (``row``: the retention candidate row)."""
    return _line({"kind": "task", "task_id": row["task_id"], "agent": row["agent"],
                  "status": row["status"], "ending": row["ending"],
                  "head_seq": int(row["head_seq"]), "head_hash": bytes(row["head_hash"]).hex(),
                  "finished_at": row["finished_at"].astimezone(dt.UTC).isoformat(),
                  "idempotency_keys": keys})


def blob_line(task_id: str, row: Any) -> bytes:
    """One stored chunk of a large value."""
    return _line({"kind": "blob", "task_id": task_id, "digest": bytes(row["digest"]).hex(),
                  "ordinal": int(row["ordinal"]), "value_bytes": int(row["value_bytes"]),
                  "data": base64.b64encode(bytes(row["data"])).decode()})


def event_line(record: EventRecord) -> bytes:
    """One stored event row, its payload exactly as stored."""
    stored = record.stored_payload
    fields: dict[str, Any] = {
        "kind": "event", "task_id": record.task_id, "seq": record.seq, "type": record.type,
        "version": record.version, "epoch": record.epoch,
        "chain_version": record.chain_version,
        "recorded_at": None if record.recorded_at is None else
        record.recorded_at.astimezone(dt.UTC).isoformat(),
        "idempotency_key": record.idempotency_key, "hash": record.hash.hex()}
    try:
        fields["payload"] = stored.decode("utf-8")
    except UnicodeDecodeError:
        fields["payload_b64"] = base64.b64encode(stored).decode()
    return _line(fields)


def anchor_line(anchor: Anchor) -> bytes:
    """The last line."""
    return _line({"kind": "anchor", "anchor": msgspec.to_builtins(anchor)})


def _line(fields: dict[str, Any]) -> bytes:
    return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS) + b"\n"


# ------------------------------------------------------------------------------ verification


class _Task:
    """One task's part of the archive as it is read."""

    def __init__(self, line: dict[str, Any], lease_epoch: int | None = None) -> None:
        self.line = line
        self.task_id: str = line["task_id"]
        self.verifier = HistoryVerifier(self.task_id, lease_epoch=lease_epoch)
        self.chunks: dict[bytes, list[tuple[int, bytes]]] = {}
        self.values: dict[bytes, bytes] = {}
        self.failed = False


class _Reader:
    """Reads an archive line by line and collects findings (see :func:`verify_archive`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.findings: list[ArchiveFinding] = []
        self.header: dict[str, Any] | None = None
        self.anchor: Anchor | None = None
        self.heads: dict[str, AnchoredHead] = {}
        self.failed: set[str] = set()
        """Tasks with a finding already (their anchored head is not compared again)."""
        self.events = 0
        self.task: _Task | None = None

    def find(self, task_id: str | None, seq: int | None, kind: str, detail: str) -> None:
        if len(self.findings) < archive_findings_max:
            self.findings.append(ArchiveFinding(task_id=task_id, seq=seq, kind=kind,
                                                detail=detail))

    def read(self) -> None:
        for number, fields in self._lines():
            if fields is None:
                self.find(None, None, "format", f"line {number} is not a JSON object")
                continue
            if self.anchor is not None:
                self.find(None, None, "format", f"line {number} follows the anchor line")
                continue
            try:
                self._take(number, fields)
            except (KeyError, TypeError, ValueError, msgspec.ValidationError) as error:
                self.find(fields.get("task_id") if isinstance(fields.get("task_id"), str)
                          else None, None, "format", f"line {number} ({fields.get('kind')}) "
                          f"is malformed: {error}")
        self._end_task()

    def _lines(self) -> Iterator[tuple[int, dict[str, Any] | None]]:
        with self.path.open("rb") as file:
            for number, raw in enumerate(file, start=1):
                if len(raw) > archive_line_bytes_max:
                    yield number, None
                    continue
                try:
                    fields = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    yield number, None
                    continue
                yield number, fields if isinstance(fields, dict) else None

    def _take(self, number: int, fields: dict[str, Any]) -> None:
        kind = fields.get("kind")
        if self.header is None:
            if kind != "archive" or fields.get("format") != ARCHIVE_FORMAT or \
                    fields.get("version") != ARCHIVE_VERSION:
                raise ValueError(f"not a {ARCHIVE_FORMAT} of version {ARCHIVE_VERSION}")
            self.header = fields
        elif kind == "task":
            self._end_task()
            if not isinstance(fields["task_id"], str) or fields["task_id"] in self.heads:
                raise ValueError(f"task {fields['task_id']!r} is archived twice, or no id")
            if not isinstance(fields["head_seq"], int) or not isinstance(
                    fields["head_hash"], str) or fields["status"] not in _ENDED:
                raise ValueError("the task line's head or status is malformed")
            self.task = _Task(fields)
        elif kind in ("blob", "event"):
            if self.task is None or fields["task_id"] != self.task.task_id:
                raise ValueError(f"a {kind} line outside its task's part")
            if kind == "blob":
                self._blob(fields)
            else:
                self._event(fields)
        elif kind == "anchor":
            self._end_task()
            self.anchor = msgspec.convert(fields["anchor"], type=Anchor)
        else:
            raise ValueError(f"unknown kind {kind!r} at line {number}")

    def _blob(self, fields: dict[str, Any]) -> None:
        assert self.task is not None
        digest = bytes.fromhex(fields["digest"])
        self.task.chunks.setdefault(digest, []).append(
            (int(fields["ordinal"]), base64.b64decode(fields["data"], validate=True)))

    def _event(self, fields: dict[str, Any]) -> None:
        task = self.task
        assert task is not None
        self.events += 1
        if task.failed:
            return
        record = _record(fields)
        if record.payload.startswith(blobs.ROW_PREFIX):
            try:
                record = self._expanded(task, record)
            except blobs.BlobError as error:
                task.failed = True
                self.find(task.task_id, record.seq, "chain", f"blob: {error}")
                return
        if not task.verifier.feed(record):
            task.failed = True
            violation = task.verifier.violation
            assert violation is not None
            self.find(task.task_id, violation.seq, "chain",
                      f"{violation.kind}: {violation.detail}")

    def _expanded(self, task: _Task, record: EventRecord) -> EventRecord:
        wanted = [ref for ref in blobs.references(record.payload)
                  if ref.digest not in task.values]
        if wanted:
            assembler = blobs.Assembler(wanted)
            for ref in wanted:
                for ordinal, data in sorted(task.chunks.get(ref.digest, [])):
                    assembler.add(ref.digest, ordinal, data)
            task.values.update(assembler.finish())
        full = blobs.expand(record.payload, task.values)
        return msgspec.structs.replace(record, payload=full, row_payload=record.payload)

    def _end_task(self) -> None:
        task, self.task = self.task, None
        if task is None:
            return
        line = task.line
        report = task.verifier.report()
        self.heads[task.task_id] = AnchoredHead(task.task_id, report.head_seq,
                                                report.head_hash.hex())
        if task.failed:
            self.failed.add(task.task_id)
            return
        if (report.head_seq, report.head_hash.hex()) != (line["head_seq"], line["head_hash"]):
            self.find(task.task_id, report.head_seq + 1, "head",
                      f"the chain ends at seq {report.head_seq}; the task line says "
                      f"{line['head_seq']} (lines dropped or added)")
        elif task.verifier.status not in TERMINAL or \
                task.verifier.status != Status(line["status"]):
            self.find(task.task_id, report.head_seq, "status",
                      f"the chain ends {task.verifier.status}; the task line says "
                      f"{line['status']}")

    def check_anchor(self, public_key: bytes | None) -> bool:
        """Compare the anchor with the chains read; whether it is signed (and holds)."""
        anchor = self.anchor
        if anchor is None:
            self.find(None, None, "anchor", "the archive has no anchor line (cut short?)")
            return False
        try:
            signed = check_signature(anchor, public_key)
        except AnchorInvalid as error:
            self.find(None, None, "signature", str(error))
            return False
        except ValueError as error:  # A key or signature that is not hex.
            self.find(None, None, "signature", f"the anchor's signature is malformed: {error}")
            return False
        try:
            self._compare_anchor(anchor)
        except ValueError as error:  # A head hash that is not hex.
            self.find(None, None, "anchor", f"the anchor is malformed: {error}")
        return signed

    def _compare_anchor(self, anchor: Anchor) -> None:
        header = self.header or {}
        if anchor.tenant != header.get("tenant"):
            self.find(None, None, "anchor", f"the anchor is of tenant {anchor.tenant!r}, the "
                                            f"archive of {header.get('tenant')!r}")
        root = merkle_root([leaf_hash(h.task_id, h.seq, bytes.fromhex(h.hash))
                            for h in anchor.heads])
        if root.hex() != anchor.root:
            self.find(None, None, "anchor", "the anchor's heads do not match its root")
        anchored = {head.task_id: head for head in anchor.heads}
        for task_id in sorted(anchored.keys() - self.heads.keys()):
            self.find(task_id, anchored[task_id].seq, "anchor",
                      "anchored, but missing from the archive")
        for task_id in sorted(self.heads.keys() - anchored.keys()):
            self.find(task_id, None, "anchor", "in the archive, but not anchored")
        for task_id in sorted(self.heads.keys() & anchored.keys() - self.failed):
            if self.heads[task_id] != anchored[task_id]:
                self.find(task_id, anchored[task_id].seq, "anchor",
                          f"the chain ends at seq {self.heads[task_id].seq} with another head "
                          f"than the anchored one")
        if header.get("tasks") != len(self.heads):
            self.find(None, None, "format", f"the header counts {header.get('tasks')} task(s), "
                                            f"the archive holds {len(self.heads)}")


def _record(fields: dict[str, Any]) -> EventRecord:
    payload = fields["payload"].encode("utf-8") if "payload" in fields else \
        base64.b64decode(fields["payload_b64"], validate=True)
    stamp = fields["recorded_at"]
    return EventRecord(
        task_id=fields["task_id"], seq=int(fields["seq"]), type=fields["type"],
        version=int(fields["version"]), epoch=int(fields["epoch"]), payload=payload,
        idempotency_key=fields["idempotency_key"], hash=bytes.fromhex(fields["hash"]),
        recorded_at=None if stamp is None else dt.datetime.fromisoformat(stamp),
        chain_version=int(fields["chain_version"]))


def verify_archive(path: str | Path, public_key: bytes | None = None) -> ArchiveReport:
    """``wal-engine verify --archive FILE``: verify an archive offline (no database).

    With ``public_key`` (raw Ed25519, 32 bytes) the anchor must be signed by that key.
    Raises :class:`OSError` only when the file cannot be opened; everything wrong inside
    it is a finding.
    """
    reader = _Reader(Path(path))
    reader.read()
    signed = False
    if reader.header is not None:
        signed = reader.check_anchor(public_key)
    elif not reader.findings:
        reader.find(None, None, "format", "the archive is empty")
    header = reader.header or {}
    return ArchiveReport(path=str(path), tenant=header.get("tenant"), tasks=len(reader.heads),
                         events=reader.events, signed=signed, findings=reader.findings)
