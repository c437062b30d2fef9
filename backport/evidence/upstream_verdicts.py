"""Upstream's own tests joined to the pair verdicts: per fix, file and tree, what they showed.

Each upstream test file (at its revision) gets one outcome per tree, from its tests' outcomes
(`upstream-tests.json`), the worst first: `refused` (its bytes did not match the pin: never
run), `unavailable` (not fetched), `failed` (a test failed or errored), `stale-test` (the
test's doubles do not fit the release), `incompatible` (it needs code the release lacks by
design), `passed`, `skipped`. The pair (pristine -> patched) then reads as the probe cases do:

================  ==================================================================
patched           pair
================  ==================================================================
passed            `fixed` when pristine failed, `held` when it passed, else `passed`
failed            `regressed` when pristine passed, else `still-failing`
refused           `refused`
anything else     `inconclusive` (stale-test, incompatible, unavailable, skipped)
================  ==================================================================

A finding: `regressed`, `refused`, or `still-failing` where the patched tree has the fix (the
pack applied it, or the release already had it); a fix the pack does not carry to the
release (`not-applicable`) is not one, and the row says so. `inconclusive` is never a pass.
A fix has upstream evidence when one of its files passed or failed on the patched tree.
"""

from __future__ import annotations

from backport.evidence.layout import BASE, HEAD
from backport.vocab import PatchStatus, TestOutcome, UpstreamPair

_O = TestOutcome
FILE_ORDER = (_O.REFUSED, _O.UNAVAILABLE, _O.FAILED, _O.STALE_TEST, _O.INCOMPATIBLE, _O.PASSED, _O.SKIPPED)
UPSTREAM_PAIRS = tuple(UpstreamPair)
_FINDING_PAIRS = (UpstreamPair.REGRESSED, UpstreamPair.REFUSED)
_HAS_FIX = (PatchStatus.APPLIED, PatchStatus.PRESENT)


def file_outcome(outcomes: list[str]) -> TestOutcome:
    """One file's outcome on one tree from its tests' outcomes."""
    seen = {_O.FAILED if o == _O.ERROR else o for o in outcomes}
    return next((o for o in FILE_ORDER if o in seen), _O.SKIPPED)


def upstream_pair(base: str | None, head: str | None) -> UpstreamPair:
    """The pair verdict of one test file from its outcomes on base and head (junit.py's outcomes)."""
    if head == _O.PASSED:
        if base == _O.FAILED:
            return UpstreamPair.FIXED
        return UpstreamPair.HELD if base == _O.PASSED else UpstreamPair.PASSED
    if head == _O.FAILED:
        return UpstreamPair.REGRESSED if base == _O.PASSED else UpstreamPair.STILL_FAILING
    if head == _O.REFUSED:
        return UpstreamPair.REFUSED
    return UpstreamPair.INCONCLUSIVE


def _fix_status(apply: dict | None) -> dict[str, str]:
    """Per fix, what the engine did on the patched tree (no apply report: the head is given)."""
    return {p["fix"]: p.get("status") for p in (apply or {}).get("patches") or [] if p.get("fix")}


def file_rows(upstream: dict | None, apply: dict | None = None) -> list[dict]:
    """One row per (fix, file, revision): per tree its outcome, counts and subtests; the pair."""
    upstream = upstream or {}
    fixes = {(f.get("path"), f.get("rev")): f.get("fix") for f in upstream.get("files") or []}
    status = _fix_status(apply)
    rows: dict[tuple, dict] = {}
    for tree in upstream.get("trees") or []:
        role = str(tree.get("tree"))
        by_file: dict[tuple, list[dict]] = {}
        for test in tree.get("tests") or []:
            by_file.setdefault((test.get("file"), test.get("rev")), []).append(test)
        for key, tests in by_file.items():
            row = rows.setdefault(key, {"fix": fixes.get(key), "file": key[0], "rev": key[1], "trees": {}})
            counts: dict[str, int] = {}
            for test in tests:
                counts[str(test.get("outcome"))] = counts.get(str(test.get("outcome")), 0) + 1
            reason = next((t.get("reason") for t in tests if t.get("outcome") not in (_O.PASSED, _O.SKIPPED)
                           and t.get("reason")), None)
            row["trees"][role] = {"outcome": file_outcome([str(t.get("outcome")) for t in tests]),
                                  "counts": dict(sorted(counts.items())),
                                  "subtests": (tree.get("subtests") or {}).get(f"{key[0]}@{key[1]}") or {},
                                  "reason": reason}
    out = []
    for row in rows.values():
        base, head = (row["trees"].get(r, {}).get("outcome") for r in (BASE, HEAD))
        row["pair"] = upstream_pair(base, head)
        fix_status = status.get(row["fix"]) if apply is not None else "given"
        row["fix_status"] = fix_status
        row["finding"] = row["pair"] in _FINDING_PAIRS or (
            row["pair"] == UpstreamPair.STILL_FAILING and (apply is None or fix_status in _HAS_FIX))
        out.append(row)
    return sorted(out, key=lambda r: (str(r["fix"]), str(r["file"]), str(r["rev"])))


def evidence_summary(upstream: dict | None, apply: dict | None = None) -> dict:
    """Which fixes upstream's tests speak for, which they do not (and why), and the findings."""
    upstream = upstream or {}
    rows = file_rows(upstream, apply)
    fixes = sorted({f for f in _fix_status(apply)} | {r["fix"] for r in rows if r["fix"]}
                   | {f.get("fix") for f in upstream.get("files") or [] if f.get("fix")})
    listed = {f.get("fix") for f in upstream.get("files") or []}
    without: dict[str, str] = {}
    with_evidence = []
    for fix in fixes:
        mine = [r for r in rows if r["fix"] == fix]
        if any(r["trees"].get(HEAD, {}).get("outcome") in (_O.PASSED, _O.FAILED) for r in mine):
            with_evidence.append(fix)
        elif fix not in listed:
            without[fix] = "fixes.toml lists no readable upstream test for it"
        elif upstream.get("skipped"):
            without[fix] = f"upstream tests did not run: {upstream['skipped']}"
        elif not mine:
            without[fix] = "its test files did not run on any tree"
        else:
            without[fix] = "; ".join(
                f"{r['file'].rsplit('/', 1)[-1]}@{str(r['rev'])[:8]}: "
                f"{r['trees'].get(HEAD, {}).get('outcome', 'not run')} on patched" for r in mine)
    pairs = {p: 0 for p in UPSTREAM_PAIRS}
    for row in rows:
        pairs[row["pair"]] = pairs.get(row["pair"], 0) + 1
    return {
        "files": rows,
        "pairs": pairs,
        "fixes": len(fixes),
        "with_evidence": with_evidence,
        "without_evidence": without,
        "findings": [{"fix": r["fix"], "file": r["file"], "rev": r["rev"], "pair": r["pair"],
                      "reason": (r["trees"].get(HEAD) or {}).get("reason")} for r in rows if r["finding"]],
    }
