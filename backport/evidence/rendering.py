"""REPORT.md against the receipt: the report must be exactly what the (attached) receipt renders to.

A value that only the receipt and REPORT.md hold (a tree digest, a spec) has two witnesses: when
they disagree, both files are named, since either may have been edited. (A consistent rewrite of
every witness is a forgery that only a signature over the receipt can catch.)
"""

from __future__ import annotations

import copy
import itertools
import re

from backport.evidence.environment import code_digests
from backport.evidence.layout import RECEIPT, REPORT
from backport.evidence.problem import Problem
from backport.evidence.report import render_report

_TOKEN = re.compile(r"@@\d+@@")
RENDER_ERRORS = (AttributeError, KeyError, TypeError, ValueError, IndexError)


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


def rendering_problems(statement: dict, report: bytes) -> list[Problem]:
    """report_problems, with the other toolkit named when the receipt's code is not this one's."""
    try:
        return _other_renderer_named(statement, report_problems(statement, report))
    except RENDER_ERRORS as exc:
        return [
            Problem(RECEIPT, "inconsistent", f"cannot be rendered as REPORT.md ({type(exc).__name__}: {exc})")
        ]
