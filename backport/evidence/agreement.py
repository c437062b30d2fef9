"""Every value that more than one file of a bundle holds must agree.

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

import copy
import itertools
import json
import re
from pathlib import Path
from typing import Any

from backport.evidence.environment import code_digests
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

from . import artifacts

_ABSENT = "<absent>"
_TOKEN = re.compile(r"@@\d+@@")
_RESTATE_ERRORS = (AttributeError, KeyError, TypeError, ValueError, IndexError)


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(where, a's value, b's value) of the first difference between two JSON values, in key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = first_difference(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{index}]")
            if found:
                return found
        return None if len(a) == len(b) else (f"{path} (length)", len(a), len(b))
    return None if (type(a) is type(b) and a == b) else (path, a, b)


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
        data = (bundle / name).read_bytes()
        try:
            document = json.loads(data)
        except ValueError as exc:
            problems.append(Problem(name, "inconsistent", f"not JSON ({exc})"))
            continue
        if data != canonical_json(document):
            problems.append(
                Problem(name, "inconsistent", "not in the canonical JSON form the receipt's digest covers")
            )
            continue
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


def _masked(statement: dict) -> dict:
    """The statement with every value that only the receipt and REPORT.md hold replaced by a token."""
    s = copy.deepcopy(statement)
    p = s["predicate"]
    tokens = itertools.count()

    def mask(obj: dict, key: str) -> None:
        obj[key] = f"@@{next(tokens)}@@"

    mask(p["inputs"]["target"], "spec")
    for role, tree in p["inputs"]["trees"].items():
        for key in ("spec", "version", "tree_digest", "commit", "artifact_sha256"):
            if not (key == "commit" and role == "patched" and p["apply"] is not None):  # apply's head_commit
                mask(tree, key)
    for patch in p["inputs"]["patches"]:
        mask(patch, "path")
    mask(p["toolkit"], "version")
    mask(p["toolkit"], "git_commit")
    mask(p["environment"], "python")
    mask(p["environment"], "platform")
    return s


def _only_masked_values_differ(masked: str, line: str) -> bool:
    if not _TOKEN.search(masked):
        return False
    pattern = ".*".join(re.escape(part) for part in _TOKEN.split(masked))
    return re.fullmatch(pattern, line) is not None


def report_problems(statement: dict, report: bytes) -> list[Problem]:
    """REPORT.md must be exactly what the receipt renders to."""
    rendered = render_report(statement)
    if rendered.encode() == report:
        return []
    try:
        got = report.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return [Problem(REPORT, "inconsistent", "not UTF-8 text, unlike what the receipt renders")]
    want = rendered.split("\n")
    masked = render_report(_masked(statement)).split("\n")
    if len(got) != len(want):
        index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return [Problem(REPORT, "inconsistent", f"has {len(got)} lines, the receipt renders {len(want)}; "
                        f"the first difference is at line {index + 1}")]
    differing = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    own = [i for i in differing if not _only_masked_values_differ(masked[i], got[i])]
    if own:
        i = own[0]
        return [
            Problem(REPORT, "inconsistent", f"line {i + 1} is {got[i]!r}, the receipt renders {want[i]!r}")
        ]
    i = differing[0]
    return [
        Problem(
            REPORT,
            "inconsistent",
            f"line {i + 1} is {got[i]!r} where receipt.json renders {want[i]!r}; "
            "only these two files hold the value, so either may have been edited",
        ),
        Problem(
            RECEIPT,
            "inconsistent",
            f"renders REPORT.md line {i + 1} as {want[i]!r}, REPORT.md has "
            f"{got[i]!r}; only these two files hold the value, so either may have been edited",
        ),
    ]


def _other_renderer_named(statement: dict, problems: list[Problem]) -> list[Problem]:
    """A REPORT.md that differs from this toolkit's rendering may come from another toolkit's code:
    say so (the bundle still fails: only the code that wrote it can confirm its rendering)."""
    wrote = ((statement["predicate"].get("toolkit") or {}).get("code") or {}).get("backport_sha256")
    here = code_digests()["backport_sha256"]
    if not problems or wrote in (None, here):
        return problems
    hint = (f" (written by toolkit code {wrote[:12]}, this toolkit is {here[:12]}: verify with the toolkit "
            f"that wrote it, named in receipt.json's predicate.toolkit)")
    return [Problem(pr.file, pr.kind, pr.detail + hint) if pr.file == REPORT else pr for pr in problems]


def agreement_problems(bundle: Path, statement: dict, names: set[str]) -> list[Problem]:
    """The files against the receipt's copies of them, then REPORT.md against the receipt's rendering."""
    if REPORT not in names:
        return [Problem(REPORT, "missing", "every bundle has the receipt rendered as REPORT.md")]
    report = (bundle / REPORT).read_bytes()
    problems = _embedded_file_problems(bundle, statement, names, report)
    problems += artifacts.bundle_problems(bundle, statement)
    if problems:
        return problems
    try:
        return _other_renderer_named(statement, report_problems(statement, report))
    except _RESTATE_ERRORS as exc:
        return [
            Problem(RECEIPT, "inconsistent", f"cannot be rendered as REPORT.md ({type(exc).__name__}: {exc})")
        ]
