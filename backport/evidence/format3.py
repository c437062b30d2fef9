"""Bundle format 3 (read, no longer written): every value the receipt copies from a file must agree.

The receipt embeds the JSON files (`apply-report.json`, `probes/<role>.json`,
`upstream-tests.json`) and REPORT.md renders the receipt, so most values have three
witnesses: the file, the receipt and REPORT.md. When a file and the receipt disagree,
REPORT.md decides which one was edited: the one it does not agree with. A value that only
the receipt and REPORT.md hold (a tree digest, a spec) has two witnesses: when they disagree,
both files are named, since either may have been edited. (A consistent rewrite of every
witness is a forgery that only a signature over the receipt can catch.)

`verify` runs these checks after the digests and the receipt's own consistency pass, so a
receipt here is internally consistent and every file matches its digest in predicate.files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backport.evidence.layout import (
    APPLY_REPORT,
    RECEIPT,
    REPORT,
    UPSTREAM_TESTS,
    canonical_json,
    probe_file,
    role_of,
    sha256_bytes,
)
from backport.evidence.problem import Problem
from backport.evidence.report import render_report
from backport.evidence.statement import embedded, restate
from backport.evidence.table import first_difference, read_canonical

from . import artifacts

_RESTATE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, IndexError)


def _where(name: str) -> str:
    role = role_of(name)
    return f"predicate.probes.{role}" if role else {APPLY_REPORT: "predicate.apply",
                                                   UPSTREAM_TESTS: "predicate.upstream_tests"}[name]


def _restated(statement: dict, name: str, document: Any) -> dict:
    """The receipt as it would be had the run written `document` as this file."""
    if name == APPLY_REPORT:
        return restate(statement, apply=document)
    if name == UPSTREAM_TESTS:
        return restate(statement, upstream=document)
    p = statement["predicate"]
    probes = {role: embedded(p, probe_file(role)) for role in p["probes"]}
    role = role_of(name)
    if role is None:  # one of _RESTATE_ERRORS: the caller says the file cannot be restated
        raise ValueError(f"{name}: not a file the receipt restates")
    return restate(statement, probes={**probes, role: document})


def _recorded_digest(predicate: dict, name: str) -> str | None:
    """The sha256 the receipt records beside its copy of a file (None: it records none)."""
    role = role_of(name)
    doc = (
        predicate["probes"].get(role)
        if role
        else predicate["upstream_tests"]
        if name == UPSTREAM_TESTS
        else None
    )
    return None if doc is None else doc.get("sha256", "<absent>")


def _renders_to(statement: dict, report: bytes) -> bool:
    try:
        return render_report(statement).encode() == report
    except _RESTATE_ERRORS:
        return False


def _embedded_file_problems(bundle: Path, statement: dict, names: set[str], report: bytes) -> list[Problem]:
    p = statement["predicate"]
    problems: list[Problem] = []
    receipt_renders = _renders_to(statement, report)
    candidates = sorted(n for n in names if role_of(n) or n in (APPLY_REPORT, UPSTREAM_TESTS))
    for name in candidates:
        want = embedded(p, name)
        if want is None:
            problems.append(Problem(name, "unexpected", "the receipt embeds no such document"))
            continue
        document, problem = read_canonical(bundle, name)
        if problem:
            problems.append(problem)
            continue
        data = (bundle / name).read_bytes()
        if data == canonical_json(want):
            recorded = _recorded_digest(p, name)
            if recorded not in (None, sha256_bytes(data)):
                problems.append(Problem(RECEIPT, "inconsistent", f"{_where(name)}.sha256 is {recorded}, "
                                        f"{name} and its copy in the receipt hash to {sha256_bytes(data)}"))
            continue
        where, theirs, ours = first_difference(document, want) or ("", document, want)
        try:
            file_renders = _renders_to(_restated(statement, name, document), report)
        except _RESTATE_ERRORS:
            file_renders = False
        part = f"{_where(name)}{where}"
        if receipt_renders and not file_renders:
            problems.append(Problem(name, "inconsistent", f"{where or '(top)'} is {theirs!r}; receipt.json "
                                    f"({part}) and REPORT.md have {ours!r}"))
        elif file_renders and not receipt_renders:
            problems.append(Problem(RECEIPT, "inconsistent", f"{part} is {ours!r}; {name} and REPORT.md "
                                    f"have {theirs!r}"))
        else:
            why = "REPORT.md does not show the value" if receipt_renders else "REPORT.md agrees with neither"
            problems.append(Problem(name, "inconsistent", f"{where or '(top)'} is {theirs!r}, receipt.json "
                                    f"({part}) has {ours!r}; {why}, so either file may have been edited"))
            problems.append(
                Problem(RECEIPT, "inconsistent", f"{part} is {ours!r}, {name} has {theirs!r}; {why}")
            )
    for role in p["probes"]:
        if probe_file(role) not in names:
            problems.append(Problem(probe_file(role), "missing", "the receipt records probe results for it"))
    if p["apply"] is not None and APPLY_REPORT not in names:
        problems.append(Problem(APPLY_REPORT, "missing", "the receipt records an apply report"))
    if UPSTREAM_TESTS not in names:
        problems.append(Problem(UPSTREAM_TESTS, "missing", "the receipt records upstream tests"))
    return problems


def agreement_problems(bundle: Path, statement: dict, names: set[str]) -> list[Problem]:
    """A format 3 bundle: the files against the receipt's copies of them, the export against the receipt.
    REPORT.md is held by its digest only: it was rendered by the toolkit that wrote the bundle, and
    this one renders format 4's (docs/decisions.md)."""
    if REPORT not in names:
        return [Problem(REPORT, "missing", "every bundle has the receipt rendered as REPORT.md")]
    report = (bundle / REPORT).read_bytes()
    problems = _embedded_file_problems(bundle, statement, names, report)
    return problems + artifacts.bundle_problems(bundle, statement)
