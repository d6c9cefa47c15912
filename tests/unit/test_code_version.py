"""``wal_engine.code_version``: an agent version derived from source text the user chooses,
stable across calls and processes, changed by any edit of that text or of the salt."""

from __future__ import annotations

import functools
import importlib
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import wal_engine
from wal_engine.engine import _check_agent_labels, agent_version_length_max
from wal_engine.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[2]

AGENT = '''\
async def agent(ctx, task_input):
    found = await ctx.tool("search", search, {"q": task_input})
    return found


async def search(args):
    return [args["q"]]
'''


@pytest.fixture
def modules(tmp_path: Path) -> Iterator[Any]:
    """Writes a module under ``tmp_path`` and imports it (removed from sys.modules after)."""
    names: list[str] = []
    sys.path.insert(0, str(tmp_path))

    def write(name: str, text: str, newline: str = "\n") -> ModuleType:
        (tmp_path / f"{name}.py").write_bytes(text.replace("\n", newline).encode())
        names.append(name)
        importlib.invalidate_caches()
        return importlib.import_module(name)

    try:
        yield write
    finally:
        sys.path.remove(str(tmp_path))
        for name in names:
            sys.modules.pop(name, None)


def test_the_same_code_gives_the_same_version_across_calls_and_processes(
        modules: Any, tmp_path: Path) -> None:
    """Two calls, and a new interpreter (another hash seed), give the same digest."""
    one = modules("cv_stable", AGENT)
    version = wal_engine.code_version(one.agent, one.search)
    assert version == wal_engine.code_version(one.agent, one.search)
    script = ("import wal_engine, cv_stable; "
              "print(wal_engine.code_version(cv_stable.agent, cv_stable.search))")
    other = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True,
                           capture_output=True, text=True,
                           env={"PYTHONPATH": os.pathsep.join((str(tmp_path), str(ROOT))),
                                "PYTHONHASHSEED": "12345"})
    assert other.stdout.strip() == version


def test_a_change_of_the_hashed_source_changes_the_version(modules: Any) -> None:
    """Changed arguments in the agent, or a change anywhere in a hashed module, give another
    version; code not hashed does not count, and the same text in another module (or with
    Windows line endings) is the same version."""
    old = modules("cv_old", AGENT)
    new = modules("cv_new", AGENT.replace('{"q": task_input}', '{"q": task_input, "n": 5}'))
    same = modules("cv_same", AGENT)
    crlf = modules("cv_crlf", AGENT, newline="\r\n")
    assert wal_engine.code_version(old.agent) != wal_engine.code_version(new.agent)
    assert wal_engine.code_version(old) != wal_engine.code_version(new)
    assert wal_engine.code_version(old.search) == wal_engine.code_version(new.search)
    assert wal_engine.code_version(old.agent) == wal_engine.code_version(same.agent)
    assert wal_engine.code_version(old) == wal_engine.code_version(crlf)
    edited = modules("cv_edited", AGENT + "\n# a comment is a change too\n")
    assert wal_engine.code_version(edited) != wal_engine.code_version(old)


def test_order_and_grouping_of_sources_count(modules: Any) -> None:
    """The sources are hashed in order, each behind its length: (a, b) is not (b, a), and
    text moved from one source to the next is not the same input."""
    mod = modules("cv_order", AGENT)
    assert (wal_engine.code_version(mod.agent, mod.search)
            != wal_engine.code_version(mod.search, mod.agent))
    assert wal_engine.code_version(mod.agent) != wal_engine.code_version(mod.agent, mod.agent)


def test_the_salt_changes_the_version(modules: Any) -> None:
    """A salt changes the digest: a deploy the user wants to pin apart (a library bump, a
    prompt file) without a code change."""
    mod = modules("cv_salt", AGENT)
    plain = wal_engine.code_version(mod.agent)
    assert wal_engine.code_version(mod.agent, salt="") == plain
    assert wal_engine.code_version(mod.agent, salt="prompts-2026-12") != plain
    assert (wal_engine.code_version(mod.agent, salt="a")
            != wal_engine.code_version(mod.agent, salt="b"))


def test_the_version_is_a_valid_agent_version(modules: Any) -> None:
    """16 lowercase hex digits, within the engine's version limit, accepted by the same
    check ``engine.agent(version=...)`` makes."""
    mod = modules("cv_valid", AGENT)
    version = wal_engine.code_version(mod, mod.agent, salt="x")
    assert re.fullmatch(r"[0-9a-f]{16}", version), version
    assert len(version) <= agent_version_length_max
    _check_agent_labels("support", version, (wal_engine.code_version(mod.search),))


def test_classes_and_decorated_functions_are_hashed_by_their_own_source() -> None:
    """A class hashes its body; a ``functools.wraps`` decorator is unwrapped to the
    function's own source."""
    class Tools:
        def search(self) -> list[str]:
            return []

    def traced(function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any) -> Any:
            return function(*args)
        return wrapper

    def plain() -> int:
        return 1

    assert wal_engine.code_version(Tools) != wal_engine.code_version(plain)
    assert wal_engine.code_version(traced(plain)) == wal_engine.code_version(plain)


@pytest.mark.parametrize("sources", [(), (len,), (object(),), (42,)],
                         ids=["nothing", "builtin", "instance", "number"])
def test_a_source_that_cannot_be_read_is_a_typed_error(sources: tuple[Any, ...]) -> None:
    """No source, or one whose text Python cannot find: InvalidInput, naming it."""
    with pytest.raises(InvalidInput, match="code_version"):
        wal_engine.code_version(*sources)


def test_a_salt_that_is_not_text_is_a_typed_error() -> None:
    """``salt=b"..."`` (or any non-str): InvalidInput."""
    with pytest.raises(InvalidInput, match="salt must be a string"):
        wal_engine.code_version(test_a_salt_that_is_not_text_is_a_typed_error,
                                salt=b"x")  # type: ignore[arg-type]


def test_source_typed_at_a_repl_is_a_typed_error() -> None:
    """Code compiled from a string has no file to read: InvalidInput, not OSError."""
    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent("def made(): return 1"), "<stdin>", "exec"), namespace)
    with pytest.raises(InvalidInput, match="cannot read the source"):
        wal_engine.code_version(namespace["made"])
