"""Redaction measured against gitleaks' rules and trufflehog's detectors: which of their
formats the default redactor removes (issue 16: "measured against the public corpora,
without copying their rules into the tree").

gitleaks' rule file is read from the path given (``config/gitleaks.toml`` of a gitleaks
checkout); nothing of it is kept here. For each rule with a regex, examples are generated
from the regex itself (Hypothesis' ``from_regex``, derandomized, printable ASCII), so the
same file always gives the same figures. The secret is the rule's secret group (else its
first group, else the whole match); an example counts as caught when that secret is gone
from the redacted text ``"the tool printed <example> today"``. A rule is caught when all its
examples are.

Rules come in two kinds, reported apart:

* **format** rules: a vendor's token shape (a prefix, a length, an alphabet);
* **keyword** rules (gitleaks' semi-generic ones, whose regex starts with a run of name
  characters then the vendor's name): a value near a vendor name such as ``algolia``. The
  redactor removes a value under a secret-looking key name, not under a bare vendor name,
  so most of these are expected to pass (docs/security.md, "Limits").

Examples are generated with gitleaks' case-insensitivity flags removed, so that a vendor
prefix keeps the case the rule writes it in (``npm_``, ``SG.``, ``eyJ``) as real tokens do; a
flag left in would also make up ``NPM_`` or ``EYj`` tokens no vendor issues. Go's ``\\z`` is
Python's ``\\Z``, and POSIX classes (``[[:alnum:]]``) are spelled out. A rule Python still
cannot compile is counted as skipped.

trufflehog's detectors are Go code, not a rule file: each ``regexp.MustCompile(...)`` in
``pkg/detectors/**/*.go`` (tests left out) is read from a checkout, or from a bare git
directory at its ``HEAD``, at run time. Its argument is evaluated when it is a literal
expression (raw and interpreted string literals joined by ``+``, and
``detectors.PrefixRegex([]string{...})``, whose Go definition is read from the same
checkout); any other (a ``fmt.Sprintf``, a constant of another package) is skipped and
counted. A pattern is measured when its variable names a secret (``keyPat``,
``secretPat``, ``tokenPat``, ``passwordPat``...); those of ids, e-mails, URLs and hosts,
which a detector pairs with the secret, are counted apart. Patterns built on
``PrefixRegex`` (a vendor keyword, then up to 40 characters, then the value) are the
keyword kind, the others the format kind; a detector is caught when every example of
every secret pattern it has is.

Usage: ``python -m benchmarks.secret_corpus [GITLEAKS_TOML] [--trufflehog PATH]
[--examples N] [--json PATH]``; with ``--json``, each corpus measured replaces its own
part of the file (``gitleaks``, ``trufflehog``) and the other is kept.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from wal_engine.security.redaction import DefaultRedactor

SEMI_GENERIC_START: Final = "(?i)[\\w.-]{0,50}?(?:"
PRINTABLE: Final = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
PREFIX_LENGTH_MIN: Final = 3
"""A trufflehog pattern with a literal run this long is a vendor format; shorter, a bare
value."""
SHORTEST_SECRET: Final = 8
"""Shorter secrets are not credentials (and occur in any text): not counted."""


KINDS: Final = ("format", "keyword", "bare")
POSIX_CLASSES: Final = {"[:alnum:]": "A-Za-z0-9", "[:alpha:]": "A-Za-z", "[:digit:]": "0-9",
                        "[:upper:]": "A-Z", "[:lower:]": "a-z", "[:xdigit:]": "0-9A-Fa-f"}


def python_regex(go: str) -> str:
    """``go`` in Python's syntax (POSIX classes spelled out), without its
    case-insensitivity flags (see above)."""
    text = go.replace("(?i)", "").replace("\\z", "\\Z")
    for posix, spelled in POSIX_CLASSES.items():
        text = text.replace(posix, spelled)
    return text


def examples_of(pattern: re.Pattern[str], count: int) -> list[str]:
    """``count`` strings ``pattern`` fully matches, the same on every run."""
    found: list[str] = []

    @settings(derandomize=True, max_examples=count, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(st.from_regex(pattern, fullmatch=True, alphabet=PRINTABLE))
    def collect(example: str) -> None:
        found.append(example)

    collect()
    return found[:count]


def secret_of(pattern: re.Pattern[str], example: str, group: int | None) -> str:
    match = pattern.fullmatch(example)
    assert match is not None
    if group is None:
        group = 1 if pattern.groups else 0
    return match.group(group) or ""


def measure(rules: list[dict[str, Any]], count: int) -> dict[str, Any]:
    """Per kind of rule: the rules whose examples were all caught, those with some examples
    missed (a missed example each), and the skipped rules with why."""
    redactor = DefaultRedactor()
    outcome: dict[str, Any] = {kind: {"caught": [], "partly": {}, "missed": {},
                                      "examples": 0, "examples_caught": 0}
                               for kind in KINDS}
    outcome["skipped"] = {}
    for rule in rules:
        name, regex = rule["id"], rule.get("regex")
        if not regex:
            outcome["skipped"][name] = "no regex (a path rule)"
            continue
        kind = rule.get("kind") or (
            "keyword" if regex.startswith(SEMI_GENERIC_START) else "format")
        try:
            pattern = re.compile(python_regex(regex))
        except re.error as error:
            outcome["skipped"][name] = f"not Python syntax: {error}"
            continue
        missed: list[str] = []
        tried = 0
        try:
            examples = examples_of(pattern, count)
        except Exception as error:  # Hypothesis cannot generate from some valid regexes.
            outcome["skipped"][name] = f"no example generated: {type(error).__name__}"
            continue
        for example in examples:
            secret = secret_of(pattern, example, rule.get("secretGroup"))
            if len(secret.strip()) < SHORTEST_SECRET:
                continue
            tried += 1
            if secret in redactor.redact_text(f"the tool printed {example} today"):
                missed.append(example)
        if tried == 0:
            outcome["skipped"][name] = f"no example with a secret of {SHORTEST_SECRET}+ chars"
            continue
        counts = outcome[kind]
        counts["examples"] += tried
        counts["examples_caught"] += tried - len(missed)
        if not missed:
            counts["caught"].append(name)
        elif len(missed) < tried:
            counts["partly"][name] = missed[0]
        else:
            counts["missed"][name] = missed[0]
    return outcome


# ----------------------------------------------------------------------------- trufflehog

DETECTORS: Final = "pkg/detectors"
MUST_COMPILE: Final = re.compile(r"(?:(\w+)\s*(?::=|=)\s*)?regexp\.MustCompile\(")
SECRET_NAME: Final = re.compile(r"key|secret|token|pass|pword|pwd|cred|auth|sig|conn|pat$",
                                re.IGNORECASE)
NOT_SECRET_NAME: Final = re.compile(r"ids?$|url|uri|email|user|domain|host|endpoint|region"
                                    r"|org|project|tenant|account|instance|server", re.IGNORECASE)
GO_TOKEN: Final = re.compile(r"""\s+|//[^\n]*|`[^`]*`|"(?:[^"\\\n]|\\.)*"|\+|,|[(){}]"""
                             r"""|\[\]string|[\w.]+""")


class GoSource:
    """The Go files under ``pkg/detectors`` of a trufflehog checkout or git directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bare = not (path / DETECTORS).is_dir()

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", f"--git-dir={self.path}", *args], check=True,
                              capture_output=True, text=True).stdout

    def commit(self) -> str:
        if self.bare:
            return self._git("log", "-1", "--format=%h %cs", "HEAD").strip()
        found = subprocess.run(["git", "-C", str(self.path), "log", "-1", "--format=%h %cs"],
                               capture_output=True, text=True)
        return found.stdout.strip() or "unknown"

    def files(self) -> Iterator[tuple[str, str]]:
        """``(path, text)`` of every non-test Go file under ``pkg/detectors``."""
        if self.bare:
            names = self._git("ls-tree", "-r", "--name-only", "HEAD", DETECTORS).split("\n")
        else:
            names = [str(f.relative_to(self.path)) for f in (self.path / DETECTORS).rglob("*.go")]
        for name in sorted(names):
            if name.endswith(".go") and not name.endswith("_test.go"):
                yield name, self.read(name)

    def read(self, name: str) -> str:
        if self.bare:
            return self._git("show", f"HEAD:{name}")
        return (self.path / name).read_text(encoding="utf-8")


def go_string(token: str) -> str:
    """A Go string literal's value (raw, or interpreted: Go's escapes are Python's)."""
    if token.startswith("`"):
        return token[1:-1]
    value = ast.literal_eval(token)
    assert isinstance(value, str)
    return value


def prefix_regex_of(source: GoSource) -> tuple[str, str] | None:
    """What ``detectors.PrefixRegex(keywords)`` puts before and after the joined keywords,
    read from its Go definition (``pre := ...``, ``post := ...``)."""
    text = source.read(f"{DETECTORS}/detectors.go")
    body = re.search(r"func PrefixRegex\(keywords \[\]string\) string \{(.*?)\n\}", text, re.S)
    if body is None:
        return None
    parts = {}
    for part in ("pre", "post"):
        found = re.search(rf"\b{part}\s*:=\s*(`[^`]*`|\"(?:[^\"\\]|\\.)*\")", body.group(1))
        if found is None:
            return None
        parts[part] = go_string(found.group(1))
    return parts["pre"], parts["post"]


class NotLiteral(Exception):
    """The argument of MustCompile is not a literal expression."""


def go_expression(text: str, start: int, prefix: tuple[str, str] | None) -> tuple[str, bool]:
    """The value of the Go expression from ``start`` to its closing ``)``, and whether it
    used ``PrefixRegex``. Raises NotLiteral for anything but string literals, ``+`` and
    ``detectors.PrefixRegex([]string{...})``."""
    tokens: list[str] = []
    depth, position = 1, start
    while depth:
        token = GO_TOKEN.match(text, position)
        if token is None:
            raise NotLiteral(text[position:position + 30])
        position = token.end()
        value = token.group()
        if value.isspace() or value.startswith("//"):
            continue
        depth += {"(": 1, ")": -1}.get(value, 0)
        if depth:
            tokens.append(value)
    result, keyworded, index = [], False, 0
    expect_term = True
    while index < len(tokens):
        token = tokens[index]
        if expect_term and token[0] in "`\"":
            result.append(go_string(token))
            index += 1
        elif expect_term and token == "detectors.PrefixRegex" and prefix is not None:
            if tokens[index + 1:index + 4] != ["(", "[]string", "{"]:
                raise NotLiteral("PrefixRegex of a variable")
            index += 4
            keywords = []
            while tokens[index] != "}":
                if tokens[index] != ",":
                    if tokens[index][0] not in "`\"":
                        raise NotLiteral("PrefixRegex of a variable")
                    keywords.append(go_string(tokens[index]))
                index += 1
            if tokens[index + 1] != ")":
                raise NotLiteral("PrefixRegex call")
            index += 2
            result.append(prefix[0] + "|".join(keywords) + prefix[1])
            keyworded = True
        elif not expect_term and token in "+,":
            index += 1
            if token == ",":  # A trailing comma ends the argument list.
                break
        else:
            raise NotLiteral(token)
        expect_term = not expect_term
    if expect_term:
        raise NotLiteral("empty")
    return "".join(result), keyworded


def trufflehog_rules(source: GoSource) -> tuple[list[dict[str, Any]], dict[str, str],
                                                   dict[str, int]]:
    """The secret patterns of trufflehog's detectors as rules for :func:`measure` (id
    ``detector-dir:variable``), those skipped with why, and counts of what was found."""
    prefix = prefix_regex_of(source)
    rules: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    counts = {"files": 0, "patterns": 0, "not_secret": 0}
    for path, text in source.files():
        counts["files"] += 1
        detector = path[len(DETECTORS) + 1:].rsplit("/", 1)[0] if "/" in path[
            len(DETECTORS) + 1:] else path[len(DETECTORS) + 1:]
        for number, call in enumerate(MUST_COMPILE.finditer(text)):
            counts["patterns"] += 1
            variable = call.group(1) or f"anonymous{number}"
            rule_id = f"{detector}:{variable}"
            while rule_id in skipped or any(rule["id"] == rule_id for rule in rules[-8:]):
                rule_id += "'"
            name = variable.removesuffix("Pattern").removesuffix("Pat").removesuffix("Regex")
            if call.group(1) and (NOT_SECRET_NAME.search(name) or not SECRET_NAME.search(
                    variable)):
                counts["not_secret"] += 1
                continue
            try:
                regex, keyworded = go_expression(text, call.end(), prefix)
            except NotLiteral as error:
                skipped[rule_id] = f"not a literal expression ({str(error)[:40]})"
                continue
            if re.search(r"\\[pP]", regex):
                skipped[rule_id] = "Unicode classes (\\p) Python's re lacks"
                continue
            kind = "keyword" if keyworded else (
                "format" if literal_run(python_regex(regex)) >= PREFIX_LENGTH_MIN else "bare")
            rules.append({"id": rule_id, "regex": regex, "kind": kind})
    return rules, skipped, counts


def literal_run(pattern: str) -> int:
    """The longest run of literal characters every match of ``pattern`` holds (0 if it
    does not parse): a vendor's prefix (``xoxb-``, ``sk_live_``) gives one, a bare value
    (``[a-f0-9]{32}``, which trufflehog finds only near its keywords) none."""
    import re._parser as parser  # CPython's own parser of the pattern syntax

    def literal(op: Any, value: Any) -> int | None:
        """The length of an item that is literal text whatever matches (a character, a
        group or an alternation of literal texts), else None."""
        if op is parser.LITERAL:
            return 1
        if op is parser.IN:  # One of a few given characters: ``[rs]k_live_``, ``gh[op]_``.
            return 1 if len(value) <= 4 and all(kind is parser.LITERAL
                                                for kind, _ in value) else None
        if op is parser.SUBPATTERN:
            lengths = [literal(*item) for item in value[-1]]
            return None if None in lengths else sum(x for x in lengths if x is not None)
        if op is parser.BRANCH:
            lengths = [literal(parser.SUBPATTERN, (None, 0, 0, branch)) for branch in value[1]]
            return None if None in lengths else min(x for x in lengths if x is not None)
        return None

    def longest(items: Any) -> int:
        best = run = 0
        for op, value in items:
            length = literal(op, value)
            if length is not None:
                run += length
                best = max(best, run)
                continue
            run = 0
            if op is parser.SUBPATTERN:
                best = max(best, longest(value[-1]))
            elif op is parser.BRANCH:
                best = max(best, min(longest(branch) for branch in value[1]))
            elif op in (parser.MAX_REPEAT, parser.MIN_REPEAT, parser.POSSESSIVE_REPEAT) \
                    and value[0] >= 1:
                best = max(best, longest(value[2]))
        return best

    try:
        return longest(parser.parse(pattern))
    except re.error:
        return 0


def detector_summary(outcome: dict[str, Any]) -> dict[str, Any]:
    """Per detector (directory), from the fate of its measured patterns: caught when every
    example of every pattern was caught, missed when none was, partly otherwise. Detectors
    are counted by kind: ``format`` if one of their patterns is a vendor format, else
    ``keyword`` if one is a keyword pattern, else ``bare``."""
    fates: dict[str, list[str]] = {}
    kinds: dict[str, set[str]] = {}
    for kind in KINDS:
        counts = outcome[kind]
        for fate, ids in (("caught", counts["caught"]), ("partly", counts["partly"]),
                          ("missed", counts["missed"])):
            for rule_id in ids:
                detector = rule_id.split(":", 1)[0]
                fates.setdefault(detector, []).append(fate)
                kinds.setdefault(detector, set()).add(kind)
    summary: dict[str, Any] = {kind: {"caught": 0, "partly": 0, "missed": 0} for kind in KINDS}
    for detector, seen in fates.items():
        kind = next(kind for kind in KINDS if kind in kinds[detector])
        if all(fate == "caught" for fate in seen):
            summary[kind]["caught"] += 1
        elif all(fate == "missed" for fate in seen):
            summary[kind]["missed"] += 1
        else:
            summary[kind]["partly"] += 1
    summary["measured"] = len(fates)
    return summary


def report(title: str, outcome: dict[str, Any], examples: int) -> None:
    print(f"== {title}")
    for kind in KINDS:
        counts = outcome[kind]
        if not counts["examples"] and kind == "bare":
            continue
        rules_seen = len(counts["caught"]) + len(counts["partly"]) + len(counts["missed"])
        print(f"{kind} rules: {rules_seen}; every example caught {len(counts['caught'])}, "
              f"some {len(counts['partly'])}, none {len(counts['missed'])}; examples "
              f"{counts['examples_caught']} of {counts['examples']} caught "
              f"(up to {examples} a rule)")
        for label in ("partly", "missed"):
            for name, example in sorted(counts[label].items()):
                print(f"  {label} {name}: {example[:100]!r}")
    print(f"skipped: {len(outcome['skipped'])}")
    for name, why in sorted(outcome["skipped"].items()):
        print(f"  {name}: {why}")
    if "detectors" in outcome:
        print(f"detectors: {outcome['detectors']}; patterns: {outcome['patterns']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gitleaks_toml", type=Path, nargs="?")
    parser.add_argument("--trufflehog", type=Path, default=None,
                        help="a trufflehog checkout, or its git directory (HEAD is read)")
    parser.add_argument("--examples", type=int, default=5, help="examples per rule")
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    args = parser.parse_args()
    if args.gitleaks_toml is None and args.trufflehog is None:
        parser.error("give a gitleaks rule file, --trufflehog, or both")
    parts: dict[str, Any] = {}
    if args.gitleaks_toml is not None:
        rules = tomllib.loads(args.gitleaks_toml.read_text(encoding="utf-8"))["rules"]
        outcome = measure(rules, args.examples)
        report("gitleaks", outcome, args.examples)
        outcome["source"] = {"file": args.gitleaks_toml.name, "sha256": hashlib.sha256(
            args.gitleaks_toml.read_bytes()).hexdigest(), "examples_per_rule": args.examples,
            "hypothesis": hypothesis.__version__}
        parts["gitleaks"] = outcome
    if args.trufflehog is not None:
        source = GoSource(args.trufflehog)
        rules, skipped, counts = trufflehog_rules(source)
        outcome = measure(rules, args.examples)
        outcome["skipped"].update(skipped)
        outcome["detectors"] = detector_summary(outcome)
        outcome["patterns"] = {**counts, "measured": len(rules), "skipped": len(
            outcome["skipped"])}
        report("trufflehog", outcome, args.examples)
        outcome["source"] = {"commit": source.commit(), "examples_per_rule": args.examples,
                             "hypothesis": hypothesis.__version__}
        parts["trufflehog"] = outcome
    if args.json_path is not None:
        merged: dict[str, Any] = {}
        if args.json_path.exists():
            merged = json.loads(args.json_path.read_text(encoding="utf-8"))
            if "format" in merged:  # The former layout: gitleaks alone, at the top.
                merged = {"gitleaks": merged}
        merged.update(parts)
        args.json_path.write_text(json.dumps(merged, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
