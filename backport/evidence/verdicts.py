"""Tree verdicts, pair verdicts, the case rows and the summary of a run.

A run probes up to three trees, each under a role name: ``pristine`` (the target as
upstream shipped it), ``patched`` (the same tree with the pack applied) and
``reference`` (upstream's release that has every fix). The pair is pristine -> patched.

Pair verdict per case (base = pristine, head = patched):

==================  =========  =============  =========  ================
base \\ head        safe       unsafe         error      not-applicable
==================  =========  =============  =========  ================
safe                held       regressed      error      error
unsafe              fixed      still-unsafe   error      error
error               error      error          error      error
not-applicable      added      regressed      error      not-applicable
==================  =========  =============  =========  ================

* ``error`` is a finding, never safe: the probe could not judge the tree. A case that a
  tree did not report at all counts as ``error`` too, and so does a case that becomes
  not-applicable on head while it ran on base (the patch removed the code it drives).
* ``not-applicable`` (on both): the code path the case drives exists in neither tree
  (for example a later release's feature); not a finding, listed in the report.
* ``added``: the code path is absent on base and safe on head; not a finding.
* An exposure run (mode ``exposure``: the pack cannot serve the release, no head tree was built)
  reads the pristine tree as its own head: the release stays as upstream shipped it, so an
  unsafe case is ``still-unsafe`` (a finding) and a safe one ``held``.

A run passes when no case is ``regressed`` or ``error`` and no case outside the
must-preserve set is ``still-unsafe``. Must-preserve cases (valid, retracted, preempted,
re-entering requests) must not regress; they are ``held`` in a healthy run.

The reference check compares the patched verdict with the reference verdict per case and
lists every difference. It is information for the reviewer (the reference may lack a fix
that no release has yet, or carry later changes), not a pass/fail criterion.
"""

from __future__ import annotations

from backport.evidence.layout import BASE, HEAD, REFERENCE, ROLES, product_role
from backport.vocab import PairVerdict, RunResult, TreeVerdict

from . import coverage as cov

TREE_VERDICTS = tuple(TreeVerdict)
PAIR_VERDICTS = tuple(PairVerdict)
PASSING = {PairVerdict.FIXED, PairVerdict.HELD, PairVerdict.ADDED, PairVerdict.NOT_APPLICABLE}

_S, _U, _NA = TreeVerdict.SAFE, TreeVerdict.UNSAFE, TreeVerdict.NOT_APPLICABLE
_PAIR_TABLE: dict[tuple[str | None, str | None], PairVerdict] = {
    (_S, _S): PairVerdict.HELD,
    (_S, _U): PairVerdict.REGRESSED,
    (_U, _S): PairVerdict.FIXED,
    (_U, _U): PairVerdict.STILL_UNSAFE,
    (_NA, _S): PairVerdict.ADDED,
    (_NA, _U): PairVerdict.REGRESSED,
    (_NA, _NA): PairVerdict.NOT_APPLICABLE,
}


def pair_verdict(base: str | None, head: str | None) -> PairVerdict:
    """The pair verdict of one case from its base and head verdicts (None: the tree did not report it;
    the verdicts are read from JSON, so any string: one outside the vocabulary is an error)."""
    return _PAIR_TABLE.get((base, head), PairVerdict.ERROR)


def is_finding(pair: str, must_preserve: bool) -> bool:
    if pair in (PairVerdict.REGRESSED, PairVerdict.ERROR):
        return True
    return pair == PairVerdict.STILL_UNSAFE and not must_preserve


def case_rows(probes: dict[str, dict]) -> list[dict]:
    """One row per (probe, case) across the trees, in harness order; pair and reference check filled in."""
    order: list[tuple[str, str]] = []
    meta: dict[tuple[str, str], dict] = {}
    verdicts: dict[tuple[str, str], dict[str, str]] = {}
    for role in ROLES:
        doc = probes.get(role)
        if doc is None:
            continue
        for case in doc.get("cases", []):
            key = (case["probe"], case["case"])
            if key not in meta:
                order.append(key)
                meta[key] = {
                    "must_preserve": bool(case.get("must_preserve")),
                    "expect": case.get("expect", ""),
                    "beyond_upstream": bool(case.get("beyond_upstream")),
                }
            verdicts.setdefault(key, {})[role] = case.get("verdict")
    head = product_role(probes)  # no head tree (an exposure run): the pristine tree stays as it is
    rows = []
    for key in order:
        seen = verdicts[key]
        row = {
            "probe": key[0],
            "case": key[1],
            "must_preserve": meta[key]["must_preserve"],
            "expect": meta[key]["expect"],
            "verdicts": {role: seen.get(role) for role in ROLES if role in probes},
            "pair": pair_verdict(seen.get(BASE), seen.get(head)),
        }
        # A case of this pack's own fix (no release has it) is not compared with the reference.
        compared = REFERENCE in probes and not meta[key]["beyond_upstream"]
        row["reference_agrees"] = (seen.get(HEAD) == seen.get(REFERENCE)) if compared else None
        rows.append(row)
    return rows


def reference_differences(rows: list[dict]) -> list[dict]:
    return [{"probe": r["probe"], "case": r["case"], "patched": r["verdicts"].get(HEAD),
             "reference": r["verdicts"].get(REFERENCE)}
            for r in rows if r["reference_agrees"] is False]


def upstream_counts(upstream: dict | None) -> dict:
    """Outcome counts of upstream's tests per tree."""
    counts: dict[str, dict[str, int]] = {}
    for tree in (upstream or {}).get("trees") or []:
        per = counts.setdefault(str(tree.get("tree")), {})
        for test in tree.get("tests") or []:
            outcome = str(test.get("outcome"))
            per[outcome] = per.get(outcome, 0) + 1
    return {role: dict(sorted(per.items())) for role, per in sorted(counts.items())}


def summarise(rows: list[dict], probes: dict[str, dict], upstream: dict | None, coverage: dict | None = None,
              apply: dict | None = None) -> dict:
    """The summary of a run; `coverage` (the receipt's section) adds its totals and, under a floor
    (`run --min-coverage`), makes the result a failure. Upstream's tests join the verdict per fix
    (`upstream_verdicts`, which reads `apply` for the fixes the patched tree has): a finding
    there fails the run as a probe case's does."""
    from backport.evidence.upstream_verdicts import evidence_summary  # it reads this module's roles

    upstream_evidence = evidence_summary(upstream, apply)
    pair_counts = {v: 0 for v in PAIR_VERDICTS}
    for row in rows:
        pair_counts[row["pair"]] = pair_counts.get(row["pair"], 0) + 1
    per_tree = {}
    for role, doc in probes.items():
        counts = {v: 0 for v in TREE_VERDICTS}
        for case in doc.get("cases", []):
            counts[case.get("verdict")] = counts.get(case.get("verdict"), 0) + 1
        per_tree[role] = counts
    findings = [
        {"probe": r["probe"], "case": r["case"], "pair": r["pair"], "must_preserve": r["must_preserve"]}
        for r in rows
        if is_finding(r["pair"], r["must_preserve"])
    ]
    return {
        "cases": len(rows),
        "must_preserve_cases": sum(1 for r in rows if r["must_preserve"]),
        "pair_verdicts": pair_counts,
        "per_tree": per_tree,
        "findings": findings,
        "reference_differences": sum(1 for r in rows if r["reference_agrees"] is False),
        "upstream_tests": upstream_counts(upstream),
        "upstream_evidence": upstream_evidence,
        "coverage": cov.summary(coverage),
        "result": (
            RunResult.FAIL
            if findings or upstream_evidence["findings"] or not rows or cov.below_floor(coverage)
            else RunResult.PASS
        ),
    }
