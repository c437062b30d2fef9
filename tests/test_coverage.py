"""The coverage section (backport/job/coverage.py): the lines each patch adds that probe cases and
upstream's tests ran (the union rule), and the pristine functions a fix changes with the lines the
unsafe cases ran. A small SGLang-shaped tree in a real git repository, one real commit per patch
as the engine writes them; the probe documents' coverage is given (the harness's shape), and
upstream's tests run under the probe interpreter's real coverage.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import git
import pytest

from backport.engine.report import ApplyReport, HunkResult, PatchResult
from backport.errors import BadInput
from backport.evidence.coverage import problems, render
from backport.job.coverage import (
    EXCLUSIONS,
    Exclusion,
    changed_functions,
    load_exclusions,
    measure,
    pristine_functions,
    stale_exclusions,
    times_added,
    upstream_lines,
)
from backport.records import TreeProbe
from backport.upstream import TestRef, run_upstream_tests
from backport.vocab import ApplyStatus, HunkStatus, PatchStatus
from tests import test_upstream_tests as shared
from tests.test_upstream_tests import BEHAVIOUR, PYTHON, REV, UNIT, UTILS_PATCHED, UTILS_PRISTINE, make_tree

# the local raw-file server, the synthetic trees and a fresh cache per test (never the shared one)
server, synthetic_trees, cache_dir = shared.server, shared.trees, shared.cache_dir

UTILS = "sglang/srt/disaggregation/utils.py"
# UTILS_PATCHED: 10 `def is_unadmitted_reject`, 11 its return, 16 `if is_unadmitted_reject(req):`,
# 17 `return False` are the patch's executable lines; admit is lines 10-13 of UTILS_PRISTINE.
PATCHED_STATEMENTS = [1, 4, 5, 6, 7, 10, 11, 14, 16, 17, 18, 19]
PRISTINE_STATEMENTS = [1, 4, 5, 6, 7, 10, 12, 13]


def _commit(repo: git.Repo, message: str) -> str:
    repo.git.add("-A")
    with repo.git.custom_environment(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                                     GIT_COMMITTER_EMAIL="t@t"):
        repo.git.commit("-q", "-m", message)
    return repo.head.commit.hexsha


@pytest.fixture
def run_inputs(tmp_path):
    """A pristine tree and its patched clone (one commit for the fix), as the job sees them."""
    pristine = make_tree(tmp_path / "pristine", UTILS_PRISTINE)
    patched = make_tree(tmp_path / "patched", UTILS_PRISTINE)
    repo = git.Repo.init(patched)
    _commit(repo, "pristine")
    (patched / UTILS).write_text(UTILS_PATCHED)
    commit = _commit(repo, "pr38935")
    trees = {role: SimpleNamespace(package_root=root, tree_path=root)
             for role, root in (("pristine", pristine), ("patched", patched))}
    apply_json = ApplyReport(tree=str(patched), version="0.5.19", base_commit=commit, head_commit=commit,
                             status=ApplyStatus.APPLIED, patches=(PatchResult(
                                 fix="pr38935", variant="pr38935-0.5.19.patch", status=PatchStatus.APPLIED,
                                 commit=commit, hunks=(HunkResult(file=UTILS, status=HunkStatus.EXACT),)),))
    probe_docs = {
        "patched": _harness_doc(patched, [], {UTILS: {"statements": PATCHED_STATEMENTS,
                                                      "executed": [1, 4, 5, 6, 7, 10, 14, 16, 18, 19]}}),
        "pristine": _harness_doc(
            pristine, [("rejected", "unsafe"), ("valid", "safe")],
            {UTILS: {"statements": PRISTINE_STATEMENTS, "executed": PRISTINE_STATEMENTS,
                     "cases": {"admission/rejected": [12], "admission/valid": [12, 13]}}}),
    }
    return trees, apply_json, probe_docs


def _harness_doc(root: Path, cases: list[tuple[str, str]], coverage: dict) -> dict:
    """A probe harness document (as probes/runtime/harness.py writes it) with admission cases."""
    return {"tree": str(root), "version": "0.5.19", "sglang_file": None, "python": "3.11.7", "torch": None,
            "import_seconds": 1.0, "coverage": coverage,
            "cases": [{"probe": "admission", "case": case, "must_preserve": False, "expect": "",
                       "observed": "", "verdict": verdict, "details": {}} for case, verdict in cases]}


def _probes(docs: dict[str, dict]) -> dict[str, TreeProbe]:
    return {role: TreeProbe.from_json(doc) for role, doc in docs.items()}


def _upstream_doc(executed: list[int] | None, **extra) -> dict:
    entry = {"tree": "patched", "tests": [{"outcome": "passed"}], **extra}
    if executed is not None:
        entry["coverage"] = {UTILS: executed}
    return {"skipped": None, "trees": [{"tree": "pristine", "tests": []}, entry]}


PACK = SimpleNamespace(fixes={})


def test_a_line_is_not_executed_only_when_neither_probes_nor_upstream_tests_ran_it(run_inputs):
    trees, apply_json, probe_docs = run_inputs
    upstream = _upstream_doc([10, 11, 16])
    section, stripped = measure(trees, apply_json, PACK, _probes(probe_docs), None, upstream)
    (patch,) = section["patches"]
    assert (patch["added"], patch["executed_by_probes"], patch["executed_by_upstream_tests"]) == (4, 2, 3)
    assert patch["executed_only_by_upstream_tests"] == [f"{UTILS}:11"]
    assert patch["not_executed"] == [f"{UTILS}:17"]
    assert section["upstream_tests"] == {"measured": True, "reason": None}
    assert section["totals"]["executed_by_upstream_tests"] == 3 and section["totals"]["not_executed"] == 1
    # upstream-tests.json keeps, per fix, only the added lines its tests ran (not the raw line lists)
    patched_entry = upstream["trees"][1]
    assert patched_entry["added_lines_executed"] == {"pr38935": [f"{UTILS}:10", f"{UTILS}:11", f"{UTILS}:16"]}
    assert "coverage" not in patched_entry and all(p.coverage is None for p in stripped.values())
    # what verify re-derives holds, against the same upstream document and pristine results
    assert problems(section, upstream=upstream, pristine=probe_docs["pristine"]) == []
    assert "Upstream's tests ran 3 of them, 1 that no probe case ran; 1 ran under neither." in "\n".join(
        render(section))


@pytest.mark.parametrize("upstream, reason", [
    (None, "upstream tests did not run"),
    ({"skipped": "disabled with --no-upstream-tests", "trees": []},
     "upstream tests did not run: disabled with --no-upstream-tests"),
    (_upstream_doc(None, coverage_unavailable="the probe interpreter has no coverage package"),
     "the probe interpreter has no coverage package"),
])
def test_upstream_tests_not_measured_stay_null_with_the_reason(run_inputs, upstream, reason):
    trees, apply_json, probe_docs = run_inputs
    section, _ = measure(trees, apply_json, PACK, _probes(probe_docs), None, copy.deepcopy(upstream))
    (patch,) = section["patches"]
    assert patch["executed_by_upstream_tests"] is None and patch["executed_only_by_upstream_tests"] == []
    assert patch["not_executed"] == [f"{UTILS}:11", f"{UTILS}:17"]  # the probes' own verdict
    assert section["upstream_tests"] == {"measured": False, "reason": reason}
    assert section["totals"]["executed_by_upstream_tests"] is None
    assert f"Upstream's tests: not measured ({reason})" in "\n".join(render(section))
    assert problems(section, upstream=upstream, pristine=probe_docs["pristine"]) == []


def test_the_sections_contradictions_are_found(run_inputs):
    trees, apply_json, probe_docs = run_inputs
    upstream = _upstream_doc([10, 11, 16])
    section, _ = measure(trees, apply_json, PACK, _probes(probe_docs), None, upstream)
    pristine = probe_docs["pristine"]

    def found(edit_section=None, edit_upstream=None) -> list[str]:
        s, u = copy.deepcopy(section), copy.deepcopy(upstream)
        (edit_section or (lambda x: None))(s)
        (edit_upstream or (lambda x: None))(u)
        return problems(s, upstream=u, pristine=pristine)

    assert any("lists 3 added lines" in p for p in found(lambda s: s["patches"][0].update(
        executed_by_upstream_tests=2)))
    assert any("upstream tests were skipped" in p for p in found(
        edit_upstream=lambda u: u.update(skipped="offline")))
    assert any("does not say ran" in p for p in found(edit_upstream=lambda u: u["trees"][1].update(
        added_lines_executed={"pr38935": [f"{UTILS}:10", f"{UTILS}:16", f"{UTILS}:17"]})))
    assert any(
        "not unsafe on the pristine tree" in p
        for p in found(lambda s: s["pristine_functions"][0].update(unsafe_cases=["admission/valid"]))
    )
    assert any("impossible" in p for p in found(lambda s: s["pristine_functions"][0].update(
        executed_by_unsafe_cases=9)))


def test_pristine_functions_name_what_a_fix_changes_and_what_the_unsafe_cases_ran(run_inputs):
    trees, apply_json, probe_docs = run_inputs
    commit = apply_json.patches[0].commit
    # The hunk that inserts `is_unadmitted_reject` lands between functions: only admit is changed.
    assert changed_functions(trees["patched"].tree_path, "", commit) == [(UTILS, "admit")]
    (entry,) = pristine_functions(trees["pristine"].package_root, trees["patched"].tree_path, "", apply_json,
                                  probe_docs["pristine"])
    assert entry == {"fix": "pr38935", "file": UTILS, "function": "admit", "first_line": 10, "last_line": 13,
                     "lines": 3, "executed_by_unsafe_cases": 1, "unsafe_cases": ["admission/rejected"]}
    section, _ = measure(trees, apply_json, PACK, _probes(probe_docs), None, None)
    assert section["pristine_functions"] == [entry] and section["pristine_reason"] is None
    assert (
        "| pr38935 | `sglang/srt/disaggregation/utils.py:10-13` `admit` | 3 | 1 | `admission/rejected` |"
        in render(section)
    )


def test_methods_and_removed_lines_are_found_by_qualified_name(tmp_path):
    root = tmp_path / "tree"
    (root / "sglang").mkdir(parents=True)
    source = ("class Queue:\n    def add(self, req):\n        x = 1\n        return x\n\n"
              "    def pop(self):\n        return None\n")
    (root / "sglang" / "q.py").write_text(source)
    (root / "sglang" / "r.py").write_text("def first():\n    return 1\n")
    repo = git.Repo.init(root)
    _commit(repo, "pristine")
    (root / "sglang" / "q.py").write_text(
        source.replace("        x = 1\n", "        x = 2\n").replace(
            "        return None\n", "        return None\n        # end\n"
        )
    )
    (root / "sglang" / "r.py").write_text("def first():\n    return 1\n\n\ndef second():\n    return 2\n")
    commit = _commit(repo, "fix")
    # a changed line inside add; a comment appended to pop's body (indented into it); a new function
    # after `first` is not a change of `first`, though its body is indented deeper than first's def
    assert changed_functions(root, "", commit) == [("sglang/q.py", "Queue.add"), ("sglang/q.py", "Queue.pop")]


def test_without_per_case_coverage_the_functions_are_listed_uncounted(run_inputs):
    trees, apply_json, probe_docs = run_inputs
    del probe_docs["pristine"]["coverage"][UTILS]["cases"]
    section, _ = measure(trees, apply_json, PACK, _probes(probe_docs), None, None)
    (entry,) = section["pristine_functions"]
    assert (entry["lines"], entry["executed_by_unsafe_cases"], entry["unsafe_cases"]) == (None, None, [])
    assert section["pristine_reason"] == "the pristine probe run recorded no per-case coverage"


# ---- upstream's tests under coverage.py ----------------------------------------------------------


def test_upstream_tests_without_coverage_in_the_interpreter_say_so(server, synthetic_trees):
    # This interpreter (the toolkit's) has no coverage package: the tests still run.
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)
    ref = TestRef(f"{UNIT}/test_admission_behaviour.py", REV)
    document = run_upstream_tests([("patched", synthetic_trees["patched"])], [ref], python=PYTHON,
                                  base_url=server.url, coverage={"patched": [UTILS]})
    (entry,) = document["trees"]
    assert {t["outcome"] for t in entry["tests"]} == {"passed", "skipped"}
    assert "coverage" not in entry and upstream_lines(document) == (None, entry["coverage_unavailable"])
    assert entry["coverage_unavailable"] == "the probe interpreter has no coverage package"


@pytest.mark.probe_env
def test_upstream_tests_record_the_lines_they_ran(server, synthetic_trees, probe_python):
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)
    ref = TestRef(f"{UNIT}/test_admission_behaviour.py", REV)
    document = run_upstream_tests([("pristine", synthetic_trees["pristine"]),
                                   ("patched", synthetic_trees["patched"])], [ref],
                                  python=probe_python, base_url=server.url, coverage={"patched": [UTILS]})
    pristine, patched = document["trees"]
    assert "coverage" not in pristine and "coverage_unavailable" not in pristine  # only where asked
    assert {t["outcome"] for t in patched["tests"]} == {"passed", "skipped"}
    ran = set(patched["coverage"][UTILS])
    # both test cases call admit, and admit calls is_unadmitted_reject; a reject returns False
    assert {10, 11, 14, 16, 17, 18, 19} <= ran
    lines, reason = upstream_lines(document)
    assert reason is None and lines == {UTILS: ran}


# ---- the pack's reviewed exclusion list (patches/coverage-exclusions.toml) -----------------------


def _exclusion_pack(tmp_path, **entry) -> SimpleNamespace:
    """A pack whose exclusion list is the one entry given (a root, no fixes)."""
    entry = {"fix": "pr38935", "variants": ["pr38935-0.5.19.patch"], "file": UTILS, "lines": ["return False"],
             "after": "if is_unadmitted_reject(req):", "reason": "a reviewed reason", **entry}
    lines = [f"{k} = {json.dumps(v)}" for k, v in entry.items() if v is not None]
    (tmp_path / "pack").mkdir(exist_ok=True)
    (tmp_path / "pack" / EXCLUSIONS).write_text("[[exclude]]\n" + "\n".join(lines) + "\n")
    return SimpleNamespace(fixes={}, root=tmp_path / "pack", variants={})


def test_a_listed_run_of_added_lines_is_excluded_with_its_reason(run_inputs, tmp_path):
    trees, apply_json, probe_docs = run_inputs
    section, _ = measure(trees, apply_json, _exclusion_pack(tmp_path), _probes(probe_docs), None, None)
    (patch,) = section["patches"]
    assert patch["excluded"] == [{"line": f"{UTILS}:17", "reason": "a reviewed reason"}]
    assert patch["not_executed"] == [f"{UTILS}:11"] and patch["added"] == 3
    assert "1 excluded with a listed reason" in "\n".join(render(section))
    assert f"| `{UTILS}:17` (a reviewed reason) |" in "\n".join(render(section))
    # a run of lines with one reason reads as one range in REPORT.md
    section["patches"][0]["excluded"].insert(0, {"line": f"{UTILS}:16", "reason": "a reviewed reason"})
    assert f"| `{UTILS}:16-17` (a reviewed reason) |" in "\n".join(render(section))


def test_an_exclusion_names_its_variant_and_its_place(run_inputs, tmp_path):
    trees, apply_json, probe_docs = run_inputs
    for other in ({"variants": ["pr38935-0.5.18.patch"]}, {"after": "queue.append(req)"}):
        pack = _exclusion_pack(tmp_path, **other)
        probes = _probes(copy.deepcopy(probe_docs))
        section, _ = measure(copy.deepcopy(trees), copy.deepcopy(apply_json), pack, probes, None, None)
        assert section["patches"][0]["excluded"] == [], other
        assert section["patches"][0]["not_executed"] == [f"{UTILS}:11", f"{UTILS}:17"], other


@pytest.mark.parametrize("entry", [{"reason": "  "}, {"variants": []}, {"lines": []}, {"owner": "x"}])
def test_an_exclusion_without_a_reason_or_a_place_is_refused(tmp_path, entry):
    with pytest.raises(BadInput, match="entry 1"):
        load_exclusions(_exclusion_pack(tmp_path, **entry).root)


def test_a_stale_exclusion_is_named():
    """The run must be consecutive added lines of the named variant, once (context lines do not count)."""
    hunk = SimpleNamespace(
        lines=((" ", "if x:"), ("+", "    return False"), ("-", "    pass"), (" ", "y = 1"))
    )
    variant = SimpleNamespace(
        name="pr38935-0.5.19.patch", files=(SimpleNamespace(path=UTILS, hunks=(hunk,)),)
    )
    ok = Exclusion("pr38935", (variant.name,), UTILS, ("return False",), "r", ("if x:",))
    assert times_added(variant, ok) == 1
    assert times_added(variant, Exclusion("pr38935", (), UTILS, ("y = 1",), "r")) == 0  # context, not added
    assert times_added(variant, Exclusion("pr38935", (), UTILS, ("return False",), "r", ("z",))) == 0


def test_the_packs_exclusions_match_their_variants_and_give_reasons():
    """Every entry of patches/coverage-exclusions.toml names variants of the pack that each add its run of
    lines exactly once, and says why no case runs it."""
    from backport.pack import load_pack
    from tests.conftest import REPO

    pack = load_pack(REPO / "patches")
    entries = load_exclusions(pack.root)
    assert entries and all(len(e.reason) > 40 for e in entries)
    assert stale_exclusions(pack) == []
