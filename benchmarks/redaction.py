"""Redaction: time per KiB on hostile text, before and after the linear patterns, and the
fast path on ordinary prose.

Workloads (CPU only, no database; every contender timed in the same run, interleaved in
rounds, CPU time of the process):

* ``hostile/<unit>``: ``DefaultRedactor().redact_text`` over a text made of one hostile unit
  repeated (:mod:`wal_engine.testing.hostile_text`: an unterminated PEM header, a JWT
  prefix, URL schemes, ...) of 64 KiB (``--quick``: 16 KiB). The reference is the
  **before**: the default patterns as they were up to this change (``BEFORE_PATTERNS``,
  kept here for this purpose), some of which backtrack quadratically. The ratio is after
  over before.
* ``hostile-1MiB/<unit>``: the after alone over 1 MiB (the payload limit), to show the time
  per KiB does not grow with the size.
* ``prose-1KB``: a 1 KB English paragraph with no credential (one colon in it, so the
  assignment rules look), and ``prose-1KB-no-separator``, the same without its colon, the
  fast path (the quick character and trigger tests skip every regex); before as the
  reference.

Each figure is the median over rounds of the per-round time, with the min-max of the rounds
as its spread, in microseconds per KiB of text (per call for the prose).

Usage: ``python -m benchmarks.redaction [--quick] [--rounds N] [--json PATH | --no-json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from benchmarks import harness
from wal_engine.security.redaction import DEFAULT_PATTERNS, CredentialPattern, DefaultRedactor
from wal_engine.testing.hostile_text import KIB, hostile_text

NAME: Final = "redaction"

_AWS: Final = ("AKIA", "ASIA", "ABIA", "ACCA", "AGPA", "AIDA", "AIPA", "ANPA", "ANVA", "APKA",
               "AROA")
BEFORE_PATTERNS: Final = (
    CredentialPattern(
        "private_key",
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
        r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----",
        "[REDACTED:private_key]", ("-----BEGIN",), exact=True, requires=("-",)),
    CredentialPattern(
        "aws_access_key_id", r"\b(?:" + "|".join(_AWS) + r")[A-Z0-9]{16}\b",
        "[REDACTED:aws_access_key_id]", _AWS, exact=True, requires=("A",)),
    CredentialPattern("github_token",
                      r"\b(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})\b",
                      "[REDACTED:github_token]",
                      ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), exact=True,
                      requires=("_",)),
    CredentialPattern("gitlab_token", r"\bglpat-[A-Za-z0-9_-]{20,}", "[REDACTED:gitlab_token]",
                      ("glpat-",), exact=True, requires=("-",)),
    CredentialPattern("slack_token", r"\bxox[abposr]-[A-Za-z0-9-]{10,}",
                      "[REDACTED:slack_token]", ("xox",), exact=True, requires=("-",)),
    CredentialPattern("slack_webhook", r"https://hooks\.slack\.com/services/[A-Za-z0-9/_-]+",
                      "[REDACTED:slack_webhook]", ("hooks.slack.com",), exact=True,
                      requires=(":",)),
    CredentialPattern("stripe_key", r"\b(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{16,}",
                      "[REDACTED:stripe_key]", ("k_live_", "k_test_"), exact=True,
                      requires=("_",)),
    CredentialPattern("api_key", r"\bsk-[A-Za-z0-9_-]{20,}", "[REDACTED:api_key]", ("sk-",),
                      exact=True, requires=("-",)),
    CredentialPattern("google_api_key", r"\bAIza[0-9A-Za-z_-]{35}",
                      "[REDACTED:google_api_key]", ("AIza",), exact=True, requires=("A",)),
    CredentialPattern("package_token", r"\b(?:npm_[A-Za-z0-9]{36}|pypi-[A-Za-z0-9_-]{50,})",
                      "[REDACTED:package_token]", ("npm_", "pypi-"), exact=True,
                      requires=("_-",)),
    CredentialPattern("jwt",
                      r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}",
                      "[REDACTED:jwt]", ("eyJ",), exact=True, requires=("J", ".")),
    CredentialPattern("bearer",
                      r"(?i:\b(bearer)\s+)(?=[A-Za-z._~+/-]*[0-9])[A-Za-z0-9._~+/-]{8,}=*",
                      r"\1 [REDACTED]", ("bearer",), requires=("0123456789",)),
    CredentialPattern("basic_auth",
                      r"(?i:(authorization\s*[:=]\s*basic)\s+)[A-Za-z0-9+/]{6,}=*",
                      r"\1 [REDACTED]", ("basic",), requires=(":=",)),
    CredentialPattern("url_password", r"\b([a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]+):[^\s@/]+@",
                      r"\1:[REDACTED]@", ("://",), exact=True, requires=(":", "@")),
    CredentialPattern(
        "assignment",
        r"(?i:\b(password|passwd|pwd|secret|client[_-]?secret|api[_-]?key|access[_-]?key|"
        r"access[_-]?token|auth[_-]?token|token)(\s*[=:]\s*))(?!\[REDACTED)([^\s&'\",;]{3,})",
        r"\1\2[REDACTED]", ("pass", "pwd", "secret", "key", "token"), requires=(":=",)),
)
"""The default formats before redaction was made linear: the reference of this benchmark."""

HOSTILE_UNITS: Final = ("eyJ-", "-----BEGIN PRIVATE KEY-----", "a.", "a-", "eyJa.",
                        "password=", "Bearer a", "a://b:c")
"""Units whose repetition made some format of the before quadratic, then a few that did not."""

PROSE: Final = (
    "The agent read the quarterly report and summarised it for the team. Revenue grew in "
    "every region except the north, where a supplier changed its terms in the spring. The "
    "summary lists the three largest customers, the open questions for the next meeting, "
    "and a short note on hiring: two engineers joined, one left, and the office move is "
    "planned for the autumn. Nothing in the report needs an answer before Friday, but the "
    "finance team asked for the figures by region and by month, with last year beside "
    "them, so that the board pack can be prepared in time. The agent will draft that table "
    "next, then send it for review. It also noted that the travel policy changed in March "
    "and that the new rules apply to every trip booked after the first of April, which "
    "the team should keep in mind when planning the visits in the second half of the year."
)

Contender = tuple[str, Callable[[str], object], bool]
"""(name, redaction function, whether it is the reference)."""


def time_round(function: Callable[[str], object], text: str, calls: int) -> float:
    """CPU seconds of ``calls`` calls of ``function(text)``."""
    started = time.process_time()
    for _ in range(calls):
        function(text)
    return time.process_time() - started


def run_workload(name: str, text: str, contenders: Sequence[Contender], *, rounds: int,
                 calls: int, per_kib: bool) -> dict[str, Any]:
    """Time the contenders interleaved (round r starts with contender r mod n)."""
    unit = len(text) / KIB if per_kib else 1.0
    samples: dict[str, list[float]] = {contender[0]: [] for contender in contenders}
    for round_index in range(rounds):
        shift = round_index % len(contenders)
        for label, function, _ in [*contenders[shift:], *contenders[:shift]]:
            seconds = time_round(function, text, calls)
            samples[label].append(seconds * 1e6 / calls / unit)
    reference = next((c[0] for c in contenders if c[2]), None)
    figures = []
    for label, _, is_reference in contenders:
        values = samples[label]
        median = statistics.median(values)
        ratio = None if reference is None else median / statistics.median(samples[reference])
        figures.append({"name": label, "reference": is_reference, "median_us": median,
                        "min_us": min(values), "max_us": max(values), "ratio": ratio,
                        "samples_us": values})
    return {"name": name, "bytes": len(text), "calls_per_round": calls, "rounds": rounds,
            "unit": "us/KiB" if per_kib else "us/call", "contenders": figures}


def workloads(quick: bool, rounds: int) -> list[dict[str, Any]]:
    """Every workload of the run, in order."""
    before = DefaultRedactor(patterns=BEFORE_PATTERNS).redact_text
    after = DefaultRedactor(patterns=DEFAULT_PATTERNS).redact_text
    pair: list[Contender] = [("before", before, True), ("after", after, False)]
    size = (16 if quick else 64) * KIB
    results = [run_workload(f"hostile/{unit!r}", hostile_text(unit, size), pair,
                            rounds=rounds, calls=1, per_kib=True) for unit in HOSTILE_UNITS]
    big = (256 if quick else 1024) * KIB
    results += [run_workload(f"hostile-{big // KIB}KiB/{unit!r}", hostile_text(unit, big),
                             [("after", after, False)], rounds=rounds, calls=1, per_kib=True)
                for unit in HOSTILE_UNITS[:4]]
    results.append(run_workload("prose-1KB", PROSE[:1000], pair, rounds=rounds,
                                calls=2000 if quick else 20000, per_kib=False))
    # The same prose without its one colon: no assignment can be in it, the fast path.
    results.append(run_workload("prose-1KB-no-separator", PROSE[:1000].replace(":", ","),
                                pair, rounds=rounds, calls=2000 if quick else 20000,
                                per_kib=False))
    return results


def describe_host() -> dict[str, Any]:
    """The machine header without a database (this benchmark uses none)."""
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else None,
        "cpu_model": harness._cpu_model(),
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": {"wal-engine": harness._version("wal-engine")},
        "git": harness._git_revision(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_report(machine: dict[str, Any], results: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per workload and contender."""
    lines = [f"# {NAME}", "", f"{machine['cpu_model']}, {machine['cores']} cores, "
             f"{machine['python']}, load {machine['load_average']}, git {machine['git']}", "",
             "| workload | contender | median | min-max | unit | after/before |",
             "| --- | --- | ---: | ---: | --- | ---: |"]
    for workload in results:
        for figure in workload["contenders"]:
            ratio = "" if figure["ratio"] is None or figure["reference"] else (
                f"{figure['ratio']:.4f}x")
            label = figure["name"] + (" (ref)" if figure["reference"] else "")
            lines.append(f"| {workload['name']} | {label} | {figure['median_us']:,.2f} | "
                         f"{figure['min_us']:,.2f}-{figure['max_us']:,.2f} | "
                         f"{workload['unit']} | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the report, write the JSON results."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 2)")
    parser.add_argument("--json", type=Path, dest="json_path",
                        help=f"where to write the JSON results (default "
                        f"benchmarks/results/{NAME}.json)")
    parser.add_argument("--no-json", action="store_true", help="do not write JSON results")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    machine = describe_host()
    results = workloads(args.quick, rounds)
    print(format_report(machine, results))
    if not args.no_json:
        target = args.json_path or harness.RESULTS_DIR / f"{NAME}.json"
        document = {"benchmark": NAME, "machine": machine,
                    "settings": {"rounds": rounds, "quick": args.quick},
                    "workloads": results}
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(target.name + ".tmp")
        temporary.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        temporary.replace(target)
        print(f"\nresults written to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
