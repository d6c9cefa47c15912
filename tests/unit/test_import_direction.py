"""Imports point down: import-linter's contracts (pyproject.toml, [tool.importlinter]) hold,
and what no static check sees holds in a fresh interpreter.

The contracts check every import statement of the tree. They cannot see what runs: the parent
package's `__init__` executed by every `import wal_engine.x`, and the names `wal_engine`
resolves lazily through `importlib` (PEP 562). The fresh-interpreter tests cover those.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Loaded by a pure import only through a chain of the pure modules (never directly by them).
RUNNING_SIDE_EXTERNALS = ("asyncpg", "structlog", "redis", "httpx", "prometheus_client")


def _contract(contract_id: str) -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts: list[dict[str, object]] = config["contracts"]
    return next(c for c in contracts if c["id"] == contract_id)


def _pure_modules() -> list[str]:
    modules = _contract("pure")["source_modules"]
    assert isinstance(modules, list)
    return [str(m) for m in modules]


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """Run `lint-imports` on the packages under `tree` (its pyproject.toml's contracts)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache", "--no-logo", str(tree / "pyproject.toml")],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_hold() -> None:
    """Every contract of pyproject.toml is kept by the tree as it is."""
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_import_contracts_catch_an_import_against_the_direction(tmp_path: Path) -> None:
    """A copy of the tree with two wrong imports breaks the contracts that name them."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("wal_engine", "replay"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    # The base reaching the driver (so replay would load it too), the store the runtime.
    events = tmp_path / "wal_engine" / "events.py"
    events.write_text(events.read_text() + "\nimport asyncpg  # noqa\n")
    queries = tmp_path / "wal_engine" / "store" / "queries.py"
    queries.write_text(queries.read_text() + "\nimport wal_engine.runtime.worker  # noqa\n")

    out = _lint_imports(tmp_path)

    assert out.returncode == 1, out.stdout + out.stderr
    assert "Layers: each package imports only the layers below it BROKEN" in out.stdout
    assert "Pure: replay, verification and the base load no driver nor running side BROKEN" in (
        out.stdout
    )
    assert "wal_engine.store is not allowed to import wal_engine.runtime" in out.stdout
    assert "replay is not allowed to import asyncpg" in out.stdout
    assert "wal_engine.events -> asyncpg" in out.stdout


def _loaded_after(code: str) -> list[str]:
    """Modules of ours and of the running side's drivers loaded in a fresh interpreter."""
    ours = ("wal_engine", "replay", *RUNNING_SIDE_EXTERNALS)
    probe = (
        f"import sys\n{code}\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {ours!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
    )
    return out.stdout.split()


def _outside_the_pure_side(loaded: list[str]) -> list[str]:
    pure = _pure_modules()
    return [
        m
        for m in loaded
        if m != "wal_engine" and not any(m == p or m.startswith(p + ".") for p in pure)
    ]


@pytest.mark.parametrize(
    "code",
    [
        "import wal_engine",
        "import replay",
        # Resolved through importlib by wal_engine.__getattr__, which no static check follows.
        "from wal_engine import Budget, PlanNode, RetryPolicy, WalError",
    ],
)
def test_pure_imports_load_nothing_of_the_running_side(code: str) -> None:
    """The root package, replay and the pure lazy names load only the pure modules."""
    loaded = _loaded_after(code)
    assert any(m.split(".")[0] in ("wal_engine", "replay") for m in loaded)
    assert _outside_the_pure_side(loaded) == []


def test_the_probe_sees_the_running_side() -> None:
    """The check above can fail: a name of the running side loads asyncpg and the store."""
    outside = _outside_the_pure_side(_loaded_after("from wal_engine import Store"))
    assert "asyncpg" in outside
    assert "wal_engine.store" in outside
