"""Redaction measured against gitleaks' rules: which of its formats the default redactor
removes (issue 16: "measured against the public corpora, without copying their rules into
the tree").

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

Usage: ``python -m benchmarks.secret_corpus GITLEAKS_TOML [--examples N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Final

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from wal_engine.security.redaction import DefaultRedactor

SEMI_GENERIC_START: Final = "(?i)[\\w.-]{0,50}?(?:"
PRINTABLE: Final = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
SHORTEST_SECRET: Final = 8
"""Shorter secrets are not credentials (and occur in any text): not counted."""


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
                               for kind in ("format", "keyword")}
    outcome["skipped"] = {}
    for rule in rules:
        name, regex = rule["id"], rule.get("regex")
        if not regex:
            outcome["skipped"][name] = "no regex (a path rule)"
            continue
        kind = "keyword" if regex.startswith(SEMI_GENERIC_START) else "format"
        try:
            pattern = re.compile(python_regex(regex))
        except re.error as error:
            outcome["skipped"][name] = f"not Python syntax: {error}"
            continue
        missed: list[str] = []
        tried = 0
        for example in examples_of(pattern, count):
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gitleaks_toml", type=Path)
    parser.add_argument("--examples", type=int, default=5, help="examples per rule")
    parser.add_argument("--json", dest="json_path", type=Path, default=None)
    args = parser.parse_args()
    rules = tomllib.loads(args.gitleaks_toml.read_text(encoding="utf-8"))["rules"]
    outcome = measure(rules, args.examples)
    for kind in ("format", "keyword"):
        counts = outcome[kind]
        rules_seen = len(counts["caught"]) + len(counts["partly"]) + len(counts["missed"])
        print(f"{kind} rules: {rules_seen}; every example caught {len(counts['caught'])}, "
              f"some {len(counts['partly'])}, none {len(counts['missed'])}; examples "
              f"{counts['examples_caught']} of {counts['examples']} caught "
              f"(up to {args.examples} a rule)")
        for label in ("partly", "missed"):
            for name, example in sorted(counts[label].items()):
                print(f"  {label} {name}: {example[:100]!r}")
    print(f"skipped: {len(outcome['skipped'])}")
    for name, why in sorted(outcome["skipped"].items()):
        print(f"  {name}: {why}")
    if args.json_path is not None:
        outcome["source"] = {"file": args.gitleaks_toml.name, "sha256": hashlib.sha256(
            args.gitleaks_toml.read_bytes()).hexdigest(), "examples_per_rule": args.examples,
            "hypothesis": hypothesis.__version__}
        args.json_path.write_text(json.dumps(outcome, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
