"""Anchored tamper evidence: export the log's heads to a file, verify a database against it.

A per-task hash chain proves a log consistent with itself, not with the past: whoever can
write the table (a superuser, a restored backup) can cut a tail off or rewrite a whole
chain and its hashes with it (RELIABILITY.md, Security). An **anchor** taken out of the
database closes that gap. It records, for every task, the head as it was, ``(task_id, seq,
hash)``, and the Merkle root over those heads (RFC 6962 tree hashing), optionally signed
with an Ed25519 key. Kept elsewhere (another account, a WORM bucket, a ticket), it lets
:func:`verify_anchor` detect:

* a **truncated tail**: the log of a task ends before the anchored seq, or the task is gone;
* a **rewritten chain**: the event at the anchored seq no longer has the anchored hash, even
  when every hash of the chain was recomputed so that the chain alone verifies;

and, with ``check_chains``, names the first bad seq of each anchored task's chain (a flipped
byte, two events swapped), as ``wal-engine verify`` does.

``mode="root"`` writes the task ids and seqs without their hashes, plus the root: smaller to
publish, the same detection, but a rewrite is then reported for the whole anchor, not per
task. Appends after the anchor was taken are fine: only the anchored prefix is compared.

Signing needs the optional ``cryptography`` package (``pip install 'wal-engine[security]'``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
import orjson

from wal_engine import limits
from wal_engine.chain import VerifyReport
from wal_engine.errors import AnchorInvalid as AnchorInvalid
from wal_engine.errors import ConfigurationError, WalError
from wal_engine.store import Database, Store

ANCHOR_FORMAT: Final = "wal-engine-anchor"
ANCHOR_VERSION: Final = 1
anchor_page_tasks: Final = 1000
"""Tasks read per statement when heads are collected or compared."""
anchor_tasks_max: Final = 10_000_000
"""Most tasks one anchor may hold (a bound on the export loop)."""

AnchorMode = Literal["heads", "root"]

ANCHOR_HEADS: Final = """
SELECT t.task_id, last.seq, last.hash
  FROM wal_tasks t
  CROSS JOIN LATERAL (SELECT e.seq, e.hash FROM wal_events e
                      WHERE e.tenant = t.tenant AND e.task_id = t.task_id
                      ORDER BY e.seq DESC LIMIT 1) AS last
 WHERE t.tenant = current_setting('wal.tenant', true) AND t.task_id > $1
 ORDER BY t.task_id
 LIMIT $2
"""

# For each anchored (task, seq): the stored hash at that seq (NULL if gone), the seq the
# task's log now ends at (NULL if it has no events at all), and, for a task archived by
# retention since (schema.sql, section "retention"), its tombstone's head.
ANCHORED_EVENTS: Final = """
SELECT a.task_id, a.seq, e.hash,
       (SELECT x.seq FROM wal_events x
         WHERE x.tenant = current_setting('wal.tenant', true) AND x.task_id = a.task_id
         ORDER BY x.seq DESC LIMIT 1) AS last_seq,
       r.head_seq AS archived_seq, r.head_hash AS archived_hash
  FROM unnest($1::text[], $2::int8[]) AS a(task_id, seq)
  LEFT JOIN wal_events e ON e.tenant = current_setting('wal.tenant', true) AND e.task_id = a.task_id
   AND e.seq = a.seq
  LEFT JOIN wal_archived_tasks r ON r.tenant = current_setting('wal.tenant', true)
   AND r.task_id = a.task_id
"""

DATABASE_IDENTITY: Final = "SELECT current_database() AS name, now() AS now"


_HEX: Final = re.compile(r"[0-9a-f]*")

class AnchoredHead(msgspec.Struct, frozen=True, array_like=True):
    """One task's head when the anchor was taken; ``hash`` is hex, empty in root mode."""

    task_id: str
    seq: int
    hash: str = ""


class AnchorSignature(msgspec.Struct, frozen=True, kw_only=True):
    """An Ed25519 signature over the anchor's canonical body."""

    algorithm: str = "ed25519"
    public_key: str
    """Raw 32-byte public key, hex."""
    value: str
    """Signature, hex."""


class Anchor(msgspec.Struct, frozen=True, kw_only=True):
    """The content of an anchor file."""

    format: str = ANCHOR_FORMAT
    version: int = ANCHOR_VERSION
    created_at: str
    """Database clock, ISO 8601."""
    database: str
    mode: str = "heads"
    tasks: int
    root: str
    """Merkle root (hex) over every head's leaf, tasks in id order."""
    heads: list[AnchoredHead]
    signature: AnchorSignature | None = None
    tenant: str | None = None
    """The tenant whose tasks the anchor holds (an anchor is per tenant, like an engine);
    covered by the signature. None in anchors made before tenants."""

    def body(self) -> bytes:
        """The canonical bytes a signature covers (everything but the signature; no
        ``tenant`` key when it is None, so older anchors keep their bytes)."""
        plain = msgspec.to_builtins(msgspec.structs.replace(self, signature=None))
        plain.pop("signature", None)
        if plain.get("tenant") is None:
            plain.pop("tenant", None)
        return orjson.dumps(plain, option=orjson.OPT_SORT_KEYS)


class AnchorFinding(msgspec.Struct, frozen=True, kw_only=True):
    """One way the database disagrees with the anchor."""

    task_id: str | None
    seq: int | None
    kind: str
    """``missing_task``, ``truncated``, ``rewritten``, ``root`` or ``chain``."""
    detail: str


class AnchorReport(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of verifying a database against an anchor."""

    anchored_tasks: int
    signed: bool
    findings: list[AnchorFinding]
    chains: list[VerifyReport] = []
    """Chain verification of the anchored tasks that failed (with ``check_chains``)."""
    archived: int = 0
    """Anchored tasks since archived by retention (their tombstone reaches the anchored
    seq): not findings; their archive (``verify --archive``) holds what the anchor saw."""

    @property
    def ok(self) -> bool:
        """Whether the database still holds everything the anchor saw, unchanged."""
        return not self.findings


# ------------------------------------------------------------------------------ Merkle tree


def leaf_hash(task_id: str, seq: int, head_hash: bytes) -> bytes:
    """The Merkle leaf of one head: ``sha256(0x00 || "task_id\\nseq\\n" || hash)``."""
    return hashlib.sha256(b"\x00" + f"{task_id}\n{seq}\n".encode() + head_hash).digest()


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """RFC 6962 Merkle tree hash over already-hashed leaves (``sha256(b"")`` when empty)."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    level = list(leaves)
    # Iterative form of RFC 6962's split at the largest power of two below n: pairing
    # left to right and promoting an odd last node gives the same tree.
    while len(level) > 1:
        paired = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest()
                  for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


# ------------------------------------------------------------------------------ export


async def collect_heads(database: Database) -> list[AnchoredHead]:
    """Every task's head ``(task_id, seq, hash)``, in task id order (paged)."""
    heads: list[AnchoredHead] = []
    after = ""
    while len(heads) < anchor_tasks_max:
        rows = await database.fetch(ANCHOR_HEADS, after, anchor_page_tasks)
        heads.extend(AnchoredHead(r["task_id"], int(r["seq"]), bytes(r["hash"]).hex())
                     for r in rows)
        if len(rows) < anchor_page_tasks:
            break
        after = rows[-1]["task_id"]
    return heads


async def create_anchor(database: Database, *, mode: AnchorMode = "heads",
                        signing_key: Any = None) -> Anchor:
    """Take an anchor of the database now; sign it when ``signing_key`` is given (an
    Ed25519 private key object, or its PEM bytes)."""
    if mode not in ("heads", "root"):
        raise ValueError(f"unknown anchor mode {mode!r}")
    identity = await database.fetchrow(DATABASE_IDENTITY)
    heads = await collect_heads(database)
    root = merkle_root([leaf_hash(h.task_id, h.seq, bytes.fromhex(h.hash)) for h in heads])
    if mode == "root":
        heads = [AnchoredHead(h.task_id, h.seq) for h in heads]
    now: dt.datetime = identity["now"]
    anchor = Anchor(created_at=now.astimezone(dt.UTC).isoformat(), database=identity["name"],
                    mode=mode, tasks=len(heads), root=root.hex(), heads=heads,
                    tenant=database.tenant)
    return anchor if signing_key is None else sign_anchor(anchor, signing_key)


def write_anchor(anchor: Anchor, path: str | Path) -> None:
    """Write the anchor as JSON (written to a temporary name, then renamed)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_bytes(orjson.dumps(msgspec.to_builtins(anchor),
                                       option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2))
    temporary.replace(target)


def read_anchor(path: str | Path) -> Anchor:
    """Read and check an anchor file; raises :class:`AnchorInvalid`."""
    try:
        with Path(path).open("rb") as file:
            # Bounded: a path such as /dev/zero must not be read to the end.
            data = file.read(limits.anchor_bytes_max + 1)
        if len(data) > limits.anchor_bytes_max:
            raise AnchorInvalid(f"{path} is larger than {limits.anchor_bytes_max} bytes: "
                                f"not an anchor")
        anchor = msgspec.json.decode(data, type=Anchor)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as error:
        raise AnchorInvalid(f"cannot read anchor {path}: {error}") from error
    if anchor.format != ANCHOR_FORMAT or anchor.version != ANCHOR_VERSION:
        raise AnchorInvalid(f"{path} is not a wal-engine anchor of version {ANCHOR_VERSION}")
    if anchor.mode not in ("heads", "root") or anchor.tasks != len(anchor.heads):
        raise AnchorInvalid(f"{path} is inconsistent (mode {anchor.mode!r}, "
                            f"{anchor.tasks} tasks, {len(anchor.heads)} heads)")
    hexes = [("root", anchor.root)] + [(f"head of {h.task_id}", h.hash) for h in anchor.heads]
    if anchor.signature is not None:
        hexes += [("public key", anchor.signature.public_key),
                  ("signature", anchor.signature.value)]
    for what, text in hexes:
        if len(text) % 2 or not _HEX.fullmatch(text):
            raise AnchorInvalid(f"{path}: the {what} is not hex")
    return anchor


async def export_anchor(database: Database, path: str | Path, *, mode: AnchorMode = "heads",
                        signing_key: Any = None) -> Anchor:
    """``wal-engine anchor``: take an anchor and write it to ``path``."""
    anchor = await create_anchor(database, mode=mode, signing_key=signing_key)
    write_anchor(anchor, path)
    return anchor


# ------------------------------------------------------------------------------ signatures


def _ed25519() -> Any:
    try:
        return importlib.import_module("cryptography.hazmat.primitives.asymmetric.ed25519")
    except ImportError as error:
        raise ConfigurationError(
            "signing anchors needs the 'cryptography' package: "
            "pip install 'wal-engine[security]'") from error


def _serialization() -> Any:
    _ed25519()
    return importlib.import_module("cryptography.hazmat.primitives.serialization")


def generate_signing_key() -> tuple[bytes, bytes]:
    """A new Ed25519 key pair as ``(private PEM, public PEM)`` (PKCS#8 / SubjectPublicKeyInfo)."""
    serialization = _serialization()
    private = _ed25519().Ed25519PrivateKey.generate()
    private_pem = private.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
    public_pem = private.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)
    return bytes(private_pem), bytes(public_pem)


def load_signing_key(pem: bytes | str | Path) -> Any:
    """An Ed25519 private key from PEM bytes or a PEM file."""
    data = Path(pem).read_bytes() if isinstance(pem, str | Path) else pem
    key = _serialization().load_pem_private_key(data, password=None)
    if not isinstance(key, _ed25519().Ed25519PrivateKey):
        raise ConfigurationError("the anchor signing key must be an Ed25519 private key")
    return key


def load_public_key(pem: bytes | str | Path) -> bytes:
    """The raw 32-byte Ed25519 public key from PEM bytes or a PEM file."""
    data = Path(pem).read_bytes() if isinstance(pem, str | Path) else pem
    serialization = _serialization()
    key = serialization.load_pem_public_key(data)
    if not isinstance(key, _ed25519().Ed25519PublicKey):
        raise ConfigurationError("the anchor public key must be an Ed25519 public key")
    return bytes(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def sign_anchor(anchor: Anchor, signing_key: Any) -> Anchor:
    """The anchor with an Ed25519 signature over its body."""
    key = load_signing_key(signing_key) if isinstance(signing_key, bytes | str | Path) \
        else signing_key
    serialization = _serialization()
    public = key.public_key().public_bytes(serialization.Encoding.Raw,
                                           serialization.PublicFormat.Raw)
    signature = AnchorSignature(public_key=bytes(public).hex(),
                                value=bytes(key.sign(anchor.body())).hex())
    return msgspec.structs.replace(anchor, signature=signature)


def check_signature(anchor: Anchor, public_key: bytes | None = None) -> bool:
    """Check the anchor's signature; returns whether it is signed.

    With ``public_key`` (raw 32 bytes), the anchor must be signed by that key. Raises
    :class:`AnchorInvalid` when a signature does not hold.
    """
    signature = anchor.signature
    if signature is None:
        if public_key is not None:
            raise AnchorInvalid("the anchor is not signed, but a public key was given")
        return False
    if signature.algorithm != "ed25519":
        raise AnchorInvalid(f"unknown signature algorithm {signature.algorithm!r}")
    if public_key is not None and bytes.fromhex(signature.public_key) != public_key:
        raise AnchorInvalid("the anchor is signed by another key")
    ed25519 = _ed25519()
    exceptions = importlib.import_module("cryptography.exceptions")
    try:
        key = ed25519.Ed25519PublicKey.from_public_bytes(bytes.fromhex(signature.public_key))
        key.verify(bytes.fromhex(signature.value), anchor.body())
    except (ValueError, exceptions.InvalidSignature) as error:
        raise AnchorInvalid("the anchor's signature does not match its content") from error
    return True


# ------------------------------------------------------------------------------ verification


async def verify_anchor(database: Database, anchor: Anchor | str | Path, *,
                        public_key: bytes | None = None,
                        check_chains: bool = True) -> AnchorReport:
    """``wal-engine verify --anchor FILE``: does the database still hold what the anchor saw?

    Checks the signature (raises :class:`AnchorInvalid` if it does not hold), then each
    anchored head: the task must still reach the anchored seq, with the anchored hash (or,
    in root mode, the recomputed root must match). With ``check_chains`` each anchored
    task's chain is verified too, naming the first bad seq.
    """
    if not isinstance(anchor, Anchor):
        anchor = read_anchor(anchor)
    signed = check_signature(anchor, public_key)
    if anchor.tenant is not None and anchor.tenant != database.tenant:
        # Another tenant's tasks are invisible here: every head would look deleted.
        raise AnchorInvalid(f"the anchor holds tenant {anchor.tenant!r}'s tasks; this "
                            f"connection is bound to tenant {database.tenant!r}")
    findings: list[AnchorFinding] = []
    leaves: list[bytes] = []
    archived = 0
    for start in range(0, len(anchor.heads), anchor_page_tasks):
        page = anchor.heads[start:start + anchor_page_tasks]
        rows = await database.fetch(ANCHORED_EVENTS, [h.task_id for h in page],
                                    [h.seq for h in page])
        stored = {(r["task_id"], int(r["seq"])): r for r in rows}
        for head in page:
            row = stored.get((head.task_id, head.seq))
            if row is not None and _archived(head, row):
                archived += 1
                if int(row["archived_seq"]) == head.seq:  # Its leaf is known: the root holds.
                    leaves.append(leaf_hash(head.task_id, head.seq, bytes(row["archived_hash"])))
                continue
            finding, leaf = _compare(head, row)
            if finding is not None:
                findings.append(finding)
            if leaf is not None:
                leaves.append(leaf)
    # (A task archived past its anchored seq leaves no leaf: the root is then not checked;
    # its archive holds the anchored event.)
    if anchor.mode == "root" and len(leaves) == len(anchor.heads) and \
            merkle_root(leaves).hex() != anchor.root:
        findings.append(AnchorFinding(task_id=None, seq=None, kind="root",
                                      detail="the heads' Merkle root differs: a chain was "
                                             "rewritten"))
    if anchor.mode == "heads":
        recomputed = merkle_root([leaf_hash(h.task_id, h.seq, bytes.fromhex(h.hash))
                                  for h in anchor.heads])
        if recomputed.hex() != anchor.root:
            raise AnchorInvalid("the anchor's heads do not match its root")
    chains = await _failed_chains(database, anchor) if check_chains else []
    findings += [AnchorFinding(task_id=c.task_id, seq=c.violation.seq, kind="chain",
                               detail=f"{c.violation.kind}: {c.violation.detail}")
                 for c in chains if c.violation is not None]
    return AnchorReport(anchored_tasks=len(anchor.heads), signed=signed, findings=findings,
                        chains=chains, archived=archived)


def _archived(head: AnchoredHead, row: Any) -> bool:
    """Whether the anchored task has left the database through retention since, at or past
    the anchored seq (at it, with the anchored hash)."""
    if row is None or row["last_seq"] is not None or row["archived_seq"] is None:
        return False
    if int(row["archived_seq"]) == head.seq and head.hash:
        return bytes(row["archived_hash"]).hex() == head.hash
    return int(row["archived_seq"]) >= head.seq


def _compare(head: AnchoredHead, row: Any) -> tuple[AnchorFinding | None, bytes | None]:
    """The finding for one anchored head, and its recomputed leaf when it still exists."""
    if row is None or row["last_seq"] is None:
        return AnchorFinding(task_id=head.task_id, seq=head.seq, kind="missing_task",
                             detail="the task has no events any more"), None
    if row["hash"] is None:
        return AnchorFinding(
            task_id=head.task_id, seq=int(row["last_seq"]) + 1, kind="truncated",
            detail=f"the anchor saw seq {head.seq}; the log ends at {row['last_seq']}"), None
    stored = bytes(row["hash"])
    if head.hash and stored.hex() != head.hash:
        return AnchorFinding(task_id=head.task_id, seq=head.seq, kind="rewritten",
                             detail="the event at the anchored seq has another hash"), None
    return None, leaf_hash(head.task_id, head.seq, stored)


async def _failed_chains(database: Database, anchor: Anchor) -> list[VerifyReport]:
    store = Store(database)
    failed = []
    for head in anchor.heads:
        try:
            report = await store.verify_task(head.task_id)
        except WalError:
            continue  # A task that is gone is already a finding.
        if not report.ok:
            failed.append(report)
    return failed
