"""No verdict reads message text (issue 46, "Done when").

The engine's `reason` strings (and the hunks' conflict reasons) are prose for people. Every
verdict drawn from an apply report reads its values (`status`, `cause`) instead: "the pack cannot
serve this release" and the exposure line (evidence/scope.py), "the release ships the fix" (the
VEX class statuses and action statements, evidence/vulnerabilities.py), the run's mode and its
PASS/FAIL. Here every message the engine builds is renamed as it is built, on real pinned
release trees through the real engine, and each of those verdicts must come out the same.

Two renamings: every message reversed (no word of it survives), and every message replaced by
one text holding every phrase a prose reader could look for ("missing dependency", "fixed_in",
"no variant", ...), so a verdict that read the text would flip one way or the other.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from backport import evidence
from backport.engine import apply_series
from backport.engine import decide as decide_module
from backport.engine import overlay as overlay_module
from backport.evidence.verdicts import case_rows, summarise
from backport.evidence.vulnerabilities import VulnClass, action_statement, class_status, load_classes
from backport.job.run import unserved
from backport.pack import load_pack
from backport.tree import clone_tree
from tests.conftest import REPO

PHRASES = ("missing dependency: pr36988 (failed); 0.5.19 is in fixed_in >=0.5.19; no variant applies to "
           "sglang 0.5.19; variants: none; no backport for sglang 0.5.19: the pack carries it for "
           "<0 only; reverse-applies cleanly; context not found; file has local changes")
RENAMINGS = {"reversed": lambda text: text[::-1], "every phrase": lambda text: PHRASES if text else ""}


def _pack(tmp: Path, scenario: str) -> Path:
    """The real pack, or a copy with one real defect: a variant missing for 0.5.19 (the pack cannot
    serve it) or a variant that does not place there (a pack defect, not an exposure)."""
    if scenario == "real":
        return REPO / "patches"
    series = tmp / f"pack-{scenario}"
    if not series.exists():
        shutil.copytree(REPO / "patches", series)
        if scenario == "no variant":
            (series / "pr36988" / "pr36988-0.5.19.patch").unlink()
        else:  # "does not place": the 0.4.10 variant claims 0.5.19 in place of its own
            (series / "pr38935" / "pr38935-0.5.19.patch").unlink()
            old = series / "pr38935" / "pr38935-0.4.10.patch"
            old.write_text(re.sub(r"(?m)^Applies-To: .*$", "Applies-To: >=0.5.19,<0.5.20", old.read_text()))
    return series


def _apply(tree, pack, version: str, tmp: Path):
    """The real engine on a fresh clone of the real release tree: a real apply, which commits (the
    report of a written series is rebuilt with its commits; it must keep its values)."""
    clone = clone_tree(tree, tmp / "clones")
    return apply_series(clone.path, pack, version, package_prefix=clone.package_prefix)


def _renamed(monkeypatch, rename) -> None:
    """Every PatchResult and HunkResult the engine builds gets its message renamed at construction."""
    def wrap(cls):
        def build(*args, **kwargs):
            made = cls(*args, **kwargs)
            return dataclasses.replace(made, reason=rename(made.reason))
        return build

    monkeypatch.setattr(decide_module, "PatchResult", wrap(decide_module.PatchResult))
    monkeypatch.setattr(decide_module, "HunkResult", wrap(decide_module.HunkResult))
    monkeypatch.setattr(overlay_module, "HunkResult", wrap(overlay_module.HunkResult))


def _cases(row: VulnClass, verdict: str, pair: str) -> list[dict]:
    """One case row per probe of the class, all with the same verdict on both trees."""
    return [{"probe": probe, "case": "c", "must_preserve": False, "pair": pair,
             "verdicts": {"pristine": verdict, "patched": verdict}} for probe in row.probes]


def _upstream(fix: str) -> dict:
    """One upstream test file of `fix` that fails on both trees: a finding only where the patched
    tree has the fix (the engine applied it or found it present)."""
    path, rev = f"test/{fix}.py", "0" * 40
    trees = [{"tree": role, "tests": [{"file": path, "rev": rev, "outcome": "failed", "name": "t"}]}
             for role in ("pristine", "patched")]
    return {"files": [{"fix": fix, "path": path, "rev": rev}], "trees": trees}


def verdicts(report, version: str, classes: list[VulnClass]) -> dict:
    """Every verdict drawn from one apply report (its messages aside)."""
    apply = report.to_json()
    probes = {role: {"cases": [{"probe": "p", "case": "c", "verdict": "safe"}]}
              for role in ("pristine", "patched")}
    rows = case_rows(probes)
    out: dict = {
        "status": (report.status, report.exit_code),
        "unserved": evidence.unserved_fixes(report),
        "exposure run": unserved(report),
        "exposure line": evidence.exposure_line(version, report),
        # the run's PASS/FAIL where a fix's upstream test still fails (a finding only with the fix)
        "result": {p.fix: summarise(rows, probes, _upstream(p.fix), None, apply)["result"]
                   for p in report.patches},
    }
    for row in classes:
        # nothing ran: not_affected exactly where the tree has no code of `introduced_with`
        quiet = class_status(row, _cases(row, "not-applicable", "not-applicable"), apply)
        # exposed: the action statement names the fixes the pack has no backport of
        exposed = class_status(row, _cases(row, "unsafe", "still-unsafe"), apply)
        out[row.id] = (quiet.status, quiet.notes, exposed.status,
                          action_statement(row, exposed, version, apply))
    return out


SCENARIOS = [  # (release, pack): every status and cause the engine has, on real trees
    ("0.4.7", "real"),  # out-of-scope fixes (#35049's code absent: SBP-2026-0003 not_affected)
    ("0.5.19", "real"),  # applied, shipped, out-of-scope
    ("0.5.23", "real"),  # already-present
    ("0.5.19", "no variant"),  # no-variant and missing-dependency: the pack cannot serve it
    ("0.5.19", "does not place"),  # does-not-place: the series does not apply
]


@pytest.mark.network  # the real wheels (cached after the first run)
@pytest.mark.parametrize("version, scenario", SCENARIOS)
def test_renaming_every_engine_message_changes_no_verdict(tmp_path, monkeypatch, release_tree, version,
                                                          scenario):
    tree = release_tree(version)
    pack = load_pack(_pack(tmp_path, scenario))
    classes = load_classes(REPO / "patches")

    def run():
        return _apply(tree, pack, version, tmp_path)

    baseline = run()
    expected = verdicts(baseline, version, classes)
    causes = {p.cause for p in baseline.patches if p.cause}
    assert causes, "the scenario must exercise a failure or not-applicable value"
    for name, rename in RENAMINGS.items():
        with monkeypatch.context() as m:
            _renamed(m, rename)
            renamed = run()
        # the renaming took: every message that said something now says something else
        said = [(a.reason, b.reason) for a, b in zip(baseline.patches, renamed.patches) if a.reason]
        assert said and all(a != b for a, b in said), name
        assert [(p.fix, p.status, p.cause) for p in renamed.patches] == \
            [(p.fix, p.status, p.cause) for p in baseline.patches], name
        assert verdicts(renamed, version, classes) == expected, name


@pytest.mark.network
def test_the_scenarios_reach_each_verdict(tmp_path, release_tree):
    """The scenarios above are not vacuous: between them the pack cannot serve a release, a series
    does not apply without that, a fix ships in the release, and a class's code is absent."""
    classes = load_classes(REPO / "patches")
    seen: dict[tuple[str, str], dict] = {}
    for version, scenario in SCENARIOS:
        tree = release_tree(version)
        report = _apply(tree, load_pack(_pack(tmp_path, scenario)), version, tmp_path)
        seen[(version, scenario)] = verdicts(report, version, classes)
    assert seen[("0.5.19", "no variant")]["unserved"][0] == ["pr36988"]
    assert seen[("0.5.19", "no variant")]["exposure run"] is True
    assert seen[("0.5.19", "does not place")]["unserved"] is None
    assert seen[("0.5.19", "does not place")]["status"] == ("failed", 1)
    assert seen[("0.5.19", "real")]["status"] == ("applied", 0)
    # #35049 ships in 0.5.19 (its code is there); 0.4.7 is out of its scope (no code of it)
    assert seen[("0.5.19", "real")]["SBP-2026-0003"][0] == "under_investigation"
    assert seen[("0.4.7", "real")]["SBP-2026-0003"][0] == "not_affected"
    # the action statement names a fix the pack has no backport of, never one the release ships
    statement = seen[("0.5.19", "real")]["SBP-2026-0001"][3]
    assert "sbp-refused-room" in statement
    results = seen[("0.5.19", "real")]["result"]
    assert results["pr36988"] == "fail" and results["pr12107"] == "pass"  # applied; shipped
