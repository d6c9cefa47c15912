"""benchmarks.secret_corpus, the measure of redaction against gitleaks' rule file and
trufflehog's detectors, on a small rule file and Go files of our own (the real ones are read
from a checkout, never kept)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.secret_corpus import (
    GoSource,
    detector_summary,
    literal_run,
    measure,
    python_regex,
    trufflehog_rules,
)

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


def test_trufflehog_detectors_are_read_from_go_source(tmp_path: Path) -> None:
    """Go detectors of our own, laid out as in a trufflehog checkout: a literal pattern is a
    format rule, one built on PrefixRegex (its Go definition read from the checkout) a
    keyword rule, an id's pattern is not measured, a non-literal argument is skipped, a
    bare value is its own kind; a detector is caught when all its patterns are."""
    detectors = tmp_path / "pkg" / "detectors"
    (detectors / "acme").mkdir(parents=True)
    (detectors / "detectors.go").write_text(
        "package detectors\n\nfunc PrefixRegex(keywords []string) string {\n"
        "\tpre := `(?i:`\n\tmiddle := strings.Join(keywords, \"|\")\n"
        "\tpost := `)(?:.|[\\n\\r]){0,40}?`\n\treturn pre + middle + post\n}\n")
    (detectors / "acme" / "acme.go").write_text(
        "package acme\n\nvar (\n"
        "\tkeyPat = regexp.MustCompile(`\\b(ghp_[0-9a-zA-Z]{36})\\b`)\n"
        "\tidPat = regexp.MustCompile(`\\b([0-9]{12})\\b`)\n"
        "\ttokenPat = regexp.MustCompile(detectors.PrefixRegex([]string{\"acmevendor\"}) +\n"
        "\t\t\"\\\\b([a-z0-9]{32})\\\\b\") // a comment\n"
        "\tsecretPat = regexp.MustCompile(fmt.Sprintf(`%s`, common.UUIDPattern))\n"
        "\tpasswordPat = regexp.MustCompile(`\\b([a-f0-9]{40})\\b`)\n)\n")
    (detectors / "acme" / "acme_test.go").write_text(
        "package acme\nvar keyPat = regexp.MustCompile(`never`)\n")
    rules, skipped, counts = trufflehog_rules(GoSource(tmp_path))
    assert counts == {"files": 2, "patterns": 5, "not_secret": 1}
    assert {rule["id"]: rule["kind"] for rule in rules} == {
        "acme:keyPat": "format", "acme:tokenPat": "keyword", "acme:passwordPat": "bare"}
    assert rules[1]["regex"] == "(?i:acmevendor)(?:.|[\\n\\r]){0,40}?\\b([a-z0-9]{32})\\b"
    assert list(skipped) == ["acme:secretPat"]
    outcome = measure(rules, 3)
    assert outcome["format"]["caught"] == ["acme:keyPat"]
    summary = detector_summary(outcome)
    assert summary["measured"] == 1 and summary["format"]["partly"] == 1, summary


def test_literal_runs_tell_a_vendor_format_from_a_bare_value() -> None:
    assert literal_run(r"\b((?:ghp|gho)_[a-zA-Z0-9]{36})") == 4
    assert literal_run(r"(?:sq0csp|sq0idp)-[0-9A-Za-z]{10}") == 7
    assert literal_run(r"\b([0-9a-f]{32})\b") == 0
