"""benchmarks.secret_corpus, the measure of redaction against gitleaks' rule file, on a
small rule file of our own (the real one is read from a gitleaks checkout, never kept)."""

from __future__ import annotations

from benchmarks.secret_corpus import measure, python_regex

RULES = [
    {"id": "github-classic", "regex": r"\b(ghp_[0-9a-zA-Z]{36})\b"},
    {"id": "vendor-keyword",
     "regex": r"(?i)[\w.-]{0,50}?(?:examplevendor)[ \t]{0,3}=[ \t]{0,3}([a-z0-9]{32})\b"},
    {"id": "a-path-rule", "path": r"\.p12$"},
    {"id": "short", "regex": r"x[0-9]{2}"},
]


def test_rules_are_sorted_into_caught_missed_and_skipped() -> None:
    """A GitHub token format is caught on every example, a value near a bare vendor name is
    missed (docs/security.md, Limits), a path rule and a rule with no 8-character secret
    are skipped, each with why."""
    outcome = measure(RULES, 3)
    assert outcome["format"]["caught"] == ["github-classic"]
    assert list(outcome["keyword"]["missed"]) == ["vendor-keyword"]
    assert sorted(outcome["skipped"]) == ["a-path-rule", "short"]
    assert outcome["format"]["examples"] == outcome["format"]["examples_caught"] == 3


def test_go_syntax_is_translated() -> None:
    """Case flags are dropped (vendor prefixes keep their case), \\z and POSIX classes are
    spelled in Python's syntax."""
    assert python_regex(r"(?i)\b(pat[[:alnum:]]{14})\z") == r"\b(pat[A-Za-z0-9]{14})\Z"
