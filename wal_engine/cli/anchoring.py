"""Anchored tamper evidence: ``anchor``, ``anchor-keygen``, and the anchor half of
``verify --anchor`` (see :mod:`wal_engine.audit.anchor`).

An anchor file holds every task's head as it was; kept outside the database, it lets
``verify --anchor FILE`` detect a truncated tail or a rewritten chain that the chains alone
cannot show. Signing needs the ``security`` extra (``cryptography``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

import click
from rich.markup import escape

from wal_engine.audit.anchor import (
    Anchor,
    AnchorFinding,
    AnchorInvalid,
    AnchorMode,
    AnchorReport,
    export_anchor,
    generate_signing_key,
    load_public_key,
    load_signing_key,
    read_anchor,
    verify_anchor,
)
from wal_engine.cli.common import (
    EXIT_USAGE,
    CliError,
    console,
    development_option,
    dsn_option,
    emit,
    json_option,
    open_engine,
    run,
)
from wal_engine.cli.render import anchor_json, anchor_report_json
from wal_engine.errors import ConfigurationError
from wal_engine.store import Database

K = TypeVar("K")

private_key_file_mode: Final = 0o600


@click.command()
@click.argument("path", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--mode", type=click.Choice(["heads", "root"]), default="heads",
              show_default=True,
              help="heads: each task's id, seq and hash, and their Merkle root; root: ids and "
                   "seqs with the root only (smaller; a rewrite is then reported for the "
                   "whole anchor, not per task).")
@click.option("--signing-key", "key_path", metavar="PEM_FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Sign the anchor with this Ed25519 private key (see `anchor-keygen`; "
                   "needs the security extra).")
@dsn_option
@development_option
@json_option
def anchor(path: Path, mode: str, key_path: Path | None, dsn: str | None,
           as_json: bool) -> None:
    """Write every task's head to FILE, to keep outside the database; `verify --anchor FILE`
    later detects a truncated tail or a rewritten chain."""
    written = run(_anchor(path, "root" if mode == "root" else "heads", key_path, dsn), dsn=dsn)
    view = anchor_json(written, str(path))
    if as_json:
        emit(view)
        return
    out = console()
    out.print(f"anchor of {view['tasks']} task(s) ({view['mode']} mode) written to "
              f"{escape(str(path))}: database {escape(view['database'])} at "
              f"{view['created_at']}", soft_wrap=True)
    signed = "unsigned" if not view["signed"] else f"signed by {view['public_key']}"
    out.print(f"root {view['root']}, {signed}", soft_wrap=True)


async def _anchor(path: Path, mode: AnchorMode, key_path: Path | None,
                  dsn: str | None) -> Anchor:
    signing_key = None if key_path is None else read_key(load_signing_key, key_path,
                                                         "--signing-key")
    if not path.parent.is_dir():
        raise CliError(f"cannot write anchor {path}: no directory {path.parent}", EXIT_USAGE)
    async with open_engine(dsn) as engine:
        try:
            return await export_anchor(engine.database, path, mode=mode,
                                       signing_key=signing_key)
        except OSError as error:
            if error.filename is None:
                raise  # Not the file: the connection (reported as a database error).
            raise CliError(f"cannot write anchor {path}: {error.strerror or error}",
                           EXIT_USAGE) from error


@click.command("anchor-keygen")
@click.argument("private_path", metavar="PRIVATE_PEM",
                type=click.Path(dir_okay=False, path_type=Path))
@click.argument("public_path", metavar="PUBLIC_PEM",
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite files that exist.")
@json_option
def anchor_keygen(private_path: Path, public_path: Path, force: bool, as_json: bool) -> None:
    """Write a new Ed25519 key pair for signed anchors: PRIVATE_PEM (mode 0600, for `anchor
    --signing-key`) and PUBLIC_PEM (for `verify --public-key`). Needs the security extra."""
    public_key = run(_anchor_keygen(private_path, public_path, force))
    if as_json:
        emit({"private_key": str(private_path), "public_key": str(public_path),
              "public_key_hex": public_key.hex()})
        return
    out = console()
    out.print(f"private key written to {escape(str(private_path))} (keep it secret: "
              "`anchor --signing-key`)", soft_wrap=True)
    out.print(f"public key written to {escape(str(public_path))} (`verify --public-key`): "
              f"{public_key.hex()}", soft_wrap=True)


async def _anchor_keygen(private_path: Path, public_path: Path, force: bool) -> bytes:
    return await asyncio.to_thread(_write_key_pair, private_path, public_path, force)


def _write_key_pair(private_path: Path, public_path: Path, force: bool) -> bytes:
    """Write the pair (neither file when either exists, unless ``force``); the raw public key."""
    if private_path.resolve() == public_path.resolve():
        raise CliError("PRIVATE_PEM and PUBLIC_PEM must be two different files", EXIT_USAGE)
    private_pem, public_pem = generate_signing_key()
    if not force:
        for path in (private_path, public_path):
            if path.exists():
                raise CliError(f"{path} exists; pass --force to overwrite it", EXIT_USAGE)
    _write_file(private_path, private_pem, force=force, private=True)
    _write_file(public_path, public_pem, force=force, private=False)
    return load_public_key(public_pem)


def _write_file(path: Path, data: bytes, *, force: bool, private: bool) -> None:
    """Write ``data``; a private key is readable by its owner only, also when it replaces a
    file that was not."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    try:
        descriptor = os.open(path, flags, private_key_file_mode if private else 0o666)
    except FileExistsError as error:
        raise CliError(f"{path} exists; pass --force to overwrite it", EXIT_USAGE) from error
    except OSError as error:
        raise CliError(f"cannot write {path}: {error.strerror or error}", EXIT_USAGE) from error
    with os.fdopen(descriptor, "wb") as file:
        if private:
            os.fchmod(file.fileno(), private_key_file_mode)
        file.write(data)


# ----------------------------------------------------------------------------- verify --anchor


def read_key(loader: Callable[[Path], K], path: Path, option: str) -> K:
    """A key read by ``loader`` from ``path``; a file that holds no such key is bad usage.

    A missing ``cryptography`` package stays a configuration error (the one line naming
    the security extra).
    """
    try:
        return loader(path)
    except (OSError, ValueError, TypeError) as error:
        raise CliError(f"{option} {path}: not a usable key: {error}", EXIT_USAGE) from error
    except ConfigurationError as error:
        if importlib.util.find_spec("cryptography") is None:
            raise
        raise CliError(f"{option} {path}: {error}", EXIT_USAGE) from error


def read_anchor_file(path: Path) -> Anchor:
    """The anchor in ``path``; an unreadable or malformed file is bad usage."""
    try:
        anchor = read_anchor(path)
    except AnchorInvalid as error:
        raise CliError(str(error), EXIT_USAGE) from error
    texts = [anchor.root, *(head.hash for head in anchor.heads)]
    if anchor.signature is not None:
        texts += [anchor.signature.public_key, anchor.signature.value]
    bad = next((text for text in texts if not _is_hex(text)), None)
    if bad is not None:
        raise CliError(f"{path} is not a valid anchor: {bad[:80]!r} is not hex", EXIT_USAGE)
    return anchor


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


async def check_anchor(database: Database, anchor: Anchor, path: Path,
                       public_key: bytes | None, *, check_chains: bool, as_json: bool) -> bool:
    """Verify the database against ``anchor``, print the outcome; whether it holds.

    An anchor whose signature does not hold (another key, an edited file) is a finding
    too: nothing it says can be trusted.
    """
    try:
        report = await verify_anchor(database, anchor, public_key=public_key,
                                     check_chains=check_chains)
    except AnchorInvalid as error:
        report = AnchorReport(anchored_tasks=len(anchor.heads), signed=False, findings=[
            AnchorFinding(task_id=None, seq=None, kind="invalid_anchor", detail=str(error))])
    if as_json:
        emit(anchor_report_json(report, anchor, str(path)))
        return report.ok
    out = console()
    for finding in report.findings:
        where = "anchor" if finding.task_id is None else f"task {finding.task_id}"
        at = "" if finding.seq is None else f" at seq {finding.seq}"
        out.print(f"{escape(where)}: [red]FAILED[/]{at} ({finding.kind}): "
                  f"{escape(finding.detail)}", soft_wrap=True)
    if report.signed:
        signed = "signature ok"
    else:
        signed = "unsigned" if anchor.signature is None else "signature not accepted"
    verdict = "all ok" if report.ok else f"[red]{len(report.findings)} finding(s)[/]"
    archived = f", {report.archived} archived by retention since (`verify --archive`)" \
        if report.archived else ""
    out.print(f"anchor {escape(str(path))} ({report.anchored_tasks} task(s), {anchor.mode} "
              f"mode, {signed}, taken {escape(anchor.created_at)}{archived}): {verdict}",
              soft_wrap=True)
    return report.ok
