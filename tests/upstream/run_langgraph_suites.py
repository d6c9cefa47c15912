"""Run LangGraph's own test suites against wal-engine's saver and LangGraph's savers.

Three suites, taken from the PyPI sdists of the installed ``langgraph`` and
``langgraph-checkpoint-postgres`` (downloaded with pip into a cache directory at run time,
never committed here):

* ``langgraph_async``: langgraph's tests parametrized by ``async_checkpointer``;
* ``langgraph_sync``: langgraph's tests parametrized by ``sync_checkpointer``;
* ``postgres_async``: checkpoint-postgres' ``tests/test_async.py`` (``saver_name``).

wal-engine's saver is one more checkpointer of each: ``langgraph_conftest.py`` replaces the
sdist's ``tests/conftest.py`` (fixtures with ``memory``, ``postgres`` and ``wal_engine``), and
``wal_upstream_plugin.py`` adds ``wal_engine`` to checkpoint-postgres' ``saver_name``, keeps
only the checkpointer tests and writes every outcome as JSON. The run uses one PostgreSQL
(``WAL_ENGINE_TEST_DSN``, else an embedded server) and a fresh database per test. The two
test-only packages the suites import (pytest-mock, syrupy) are installed with pip
``--target`` into the cache, never into the environment.

Usage::

    python tests/upstream/run_langgraph_suites.py [--suite NAME ...] [-k EXPR] [--json]

It prints passed / failed per suite and saver, and the failures of wal-engine's saver.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
REPO: Final = HERE.parents[1]
TEST_PACKAGES: Final = ("pytest-mock>=3.14,<4", "syrupy>=4.8,<6")
"""Imported by LangGraph's tests, not needed by wal-engine itself."""
TEST_TIMEOUT_S: Final = 180
"""Per upstream test (pytest-timeout): a hang fails that test, not the run."""
SUITE_TIMEOUT_S: Final = 3 * 3600


@dataclass(frozen=True)
class Suite:
    """One upstream suite: which sdist, which files, which parameter names the saver."""

    name: str
    distribution: str
    param: str
    savers: tuple[str, ...]
    files: str
    """A regular expression a test file must contain to be run (or a file name)."""


SUITES: Final = {
    "langgraph_async": Suite("langgraph_async", "langgraph", "async_checkpointer",
                             ("memory", "postgres", "wal_engine"), r"\basync_checkpointer\b"),
    "langgraph_sync": Suite("langgraph_sync", "langgraph", "sync_checkpointer",
                            ("memory", "postgres", "wal_engine"), r"(?<!a)sync_checkpointer\b"),
    "postgres_async": Suite("postgres_async", "langgraph-checkpoint-postgres", "saver_name",
                            ("base", "pool", "pipe", "shallow", "wal_engine"),
                            "test_async.py"),
}


@dataclass
class Result:
    """Outcomes of one suite: saver -> outcome -> count, and wal-engine's failures."""

    suite: str
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    """wal-engine's failed tests -> their report."""
    others: list[str] = field(default_factory=list)
    """The other savers' failed tests."""
    returncode: int = 0


def default_cache() -> Path:
    configured = os.environ.get("WAL_ENGINE_UPSTREAM_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wal-engine-upstream"


def sdist(cache: Path, distribution: str) -> Path:
    """The sdist of the installed version of ``distribution``, downloaded once into the cache."""
    version = importlib.metadata.version(distribution)
    folder = cache / "sdists"
    stem = distribution.replace("-", "_")
    for candidate in (f"{stem}-{version}.tar.gz", f"{distribution}-{version}.tar.gz"):
        if (folder / candidate).exists():
            return folder / candidate
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", distribution, f"{distribution}=={version}", "-d", str(folder)],
                   check=True, timeout=600)
    return sdist(cache, distribution)


def test_packages(cache: Path) -> Path:
    """A directory holding pytest-mock and syrupy (installed there once)."""
    target = cache / "deps"
    if all(importlib.util.find_spec(name) is not None for name in ("pytest_mock", "syrupy")):
        return target
    if not (target / "pytest_mock").exists() or not (target / "syrupy").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(target), *TEST_PACKAGES], check=True, timeout=600)
    return target


def unpack_tests(archive: Path, work: Path) -> Path:
    """A fresh copy of the sdist's ``tests/`` and ``pyproject.toml`` (not its sources, which
    would shadow the installed package)."""
    root = work / archive.name.removesuffix(".tar.gz")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(archive) as bundle:
        top = bundle.getnames()[0].split("/", 1)[0]
        wanted = [member for member in bundle.getmembers()
                  if member.name.startswith(f"{top}/tests/")
                  or member.name == f"{top}/pyproject.toml"]
        for member in wanted:
            member.name = member.name.split("/", 1)[1]
        bundle.extractall(root, members=wanted, filter="data")
    return root


def prepare(suite: Suite, cache: Path, admin_dsn: str) -> Path:
    """The unpacked tests of ``suite`` with wal-engine's fixtures in place."""
    root = unpack_tests(sdist(cache, suite.distribution), cache / "work" / suite.name)
    if suite.distribution == "langgraph":
        shutil.copyfile(HERE / "langgraph_conftest.py", root / "tests" / "conftest.py")
    else:
        conftest = root / "tests" / "conftest.py"
        text = conftest.read_text(encoding="utf-8")
        server = admin_dsn.split("?", 1)[0].rsplit("/", 1)[0] + "/"
        text = re.sub(r'DEFAULT_POSTGRES_URI = ".*"', f'DEFAULT_POSTGRES_URI = "{server}"', text)
        text = re.sub(r'DEFAULT_URI = ".*"', f'DEFAULT_URI = "{server}postgres?sslmode=disable"',
                      text)
        conftest.write_text(text, encoding="utf-8")
    return root


def test_files(root: Path, suite: Suite) -> list[str]:
    if suite.files.endswith(".py"):
        return [f"tests/{suite.files}"]
    pattern = re.compile(suite.files)
    return sorted(f"tests/{path.name}" for path in (root / "tests").glob("test_*.py")
                  if pattern.search(path.read_text(encoding="utf-8")))


def run_suite(suite: Suite, cache: Path, admin_dsn: str, *, keyword: str | None = None,
              savers: tuple[str, ...] | None = None,
              files: list[str] | None = None, strict: bool = False) -> Result:
    """Run one suite in a pytest subprocess and tally its outcomes per saver.

    ``files`` (names under the sdist's ``tests/``) narrows the files the suite runs;
    ``strict`` runs it with ``LANGGRAPH_STRICT_MSGPACK=true``.
    """
    root = prepare(suite, cache, admin_dsn)
    plugins = cache / "plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(HERE / "wal_upstream_plugin.py", plugins / "wal_upstream_plugin.py")
    report = Path(tempfile.mkstemp(prefix=f"{suite.name}-", suffix=".json", dir=cache)[1])
    chosen = savers or suite.savers
    environment = {
        **os.environ,
        "WAL_UPSTREAM_PARAM": suite.param,
        "WAL_UPSTREAM_SAVERS": ",".join(chosen),
        "WAL_UPSTREAM_REPORT": str(report),
        "WAL_UPSTREAM_ADMIN_DSN": admin_dsn,
        "PYTHONPATH": os.pathsep.join([str(plugins), str(test_packages(cache)), str(REPO),
                                       os.environ.get("PYTHONPATH", "")]),
        "NO_DOCKER": "true",
        "LANGGRAPH_STRICT_MSGPACK": "true" if strict else "false",
    }
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "wal_upstream_plugin", "-o", "addopts=",
               "--timeout", str(TEST_TIMEOUT_S), "--tb=short",
               *(test_files(root, suite) if not files else [f"tests/{name}" for name in files])]
    if keyword:
        command += ["-k", keyword]
    completed = subprocess.run(command, cwd=root, env=environment, timeout=SUITE_TIMEOUT_S,
                               capture_output=True, text=True)
    result = Result(suite.name, returncode=completed.returncode)
    outcomes: dict[str, dict[str, Any]] = json.loads(report.read_text() or "{}")
    report.unlink()
    if not outcomes:
        raise RuntimeError(f"{suite.name}: no test ran\n{completed.stdout[-4000:]}"
                           f"\n{completed.stderr[-4000:]}")
    for nodeid, entry in outcomes.items():
        result.counts.setdefault(entry["saver"], Counter())[entry["outcome"]] += 1
        if entry["outcome"] in ("failed", "error"):
            if entry["saver"] == "wal_engine":
                result.failures[nodeid] = entry["detail"]
            else:
                result.others.append(nodeid)
    return result


def render(results: list[Result]) -> str:
    lines = [f"{'suite':<16} {'saver':<12} {'total':>6} {'passed':>7} {'failed':>7} "
             f"{'error':>6} {'skipped':>8} {'xfailed':>8}"]
    for result in results:
        for saver, counts in sorted(result.counts.items()):
            lines.append(
                f"{result.suite:<16} {saver:<12} {sum(counts.values()):>6} "
                f"{counts['passed']:>7} {counts['failed']:>7} {counts['error']:>6} "
                f"{counts['skipped']:>8} {counts['xfailed']:>8}")
    for result in results:
        for nodeid in sorted(result.others):
            lines.append(f"failed (other saver) {result.suite} {nodeid}")
        for nodeid, detail in sorted(result.failures.items()):
            lines.append(f"\nFAILED (wal_engine) {result.suite} {nodeid}\n{detail[-1500:]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", action="append", choices=sorted(SUITES))
    parser.add_argument("--saver", action="append", help="savers to run (default: all)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression (a subset)")
    parser.add_argument("--file", action="append", help="test file of the suite (a subset)")
    parser.add_argument("--cache", type=Path, default=default_cache())
    parser.add_argument("--json", action="store_true", help="print counts as JSON")
    parser.add_argument("--strict", action="store_true",
                        help="run with LANGGRAPH_STRICT_MSGPACK=true")
    arguments = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from wal_engine.testing.postgres import start_test_server

    server = start_test_server()
    try:
        results = [run_suite(SUITES[name], arguments.cache, server.admin_dsn,
                             keyword=arguments.keyword,
                             savers=tuple(arguments.saver) if arguments.saver else None,
                             files=arguments.file, strict=arguments.strict)
                   for name in arguments.suite or sorted(SUITES)]
    finally:
        server.close()
    if arguments.json:
        print(json.dumps({result.suite: {saver: dict(counts) for saver, counts
                                         in result.counts.items()} for result in results},
                         indent=1, sort_keys=True))
    else:
        print(render(results))
    return 1 if any(result.failures for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
