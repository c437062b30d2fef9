"""Evidence: pair verdicts, receipts, bundles and `verify`, on fixtures of the probe/apply JSON.

The fixtures have the shapes `probes.harness`, `ApplyReport.to_json()` and
`run_upstream_tests` print, with absolute temporary paths in them as a real run has, so
normalisation and determinism are tested on their own, without a probe environment. The
`run` tests at the end drive the real job on the cached 0.5.19 tree with the probe subprocess
stubbed; one end-to-end test runs the real `run sglang==0.5.19` (marked probe_env).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from backport import cli, evidence
from backport.errors import BadInput, Finding
from backport.evidence import TreeInput
from backport.evidence.artifacts import TREE_DIGEST_METHOD
from backport.evidence.environment import Environment, Interpreter, Toolkit
from backport.evidence.table import TABLE_KEYS, attached_from, pointed
from backport.records import TreeProbe

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "evidence" / "receipt.schema.json").read_text())

D = {n: f"{n:x}" * 64 for n in range(1, 10)}  # fake sha256 digests
C = {n: f"{n:x}" * 40 for n in range(1, 10)}  # fake commits
BUNDLE_FILES = [
    ".sglang-backport-bundle",
    "REPORT.md",
    "SHA256SUMS",
    "apply-report.json",
    "probes/patched.json",
    "probes/pristine.json",
    "probes/reference.json",
    "receipt.json",
    "upstream-tests.json",
]


def case(probe, name, verdict, must_preserve=False, **details):
    return {"probe": probe, "case": name, "must_preserve": must_preserve,
            "expect": f"{name} behaves safely", "observed": f"observed {verdict}",
            "verdict": verdict, "details": details}


# (probe, case, must_preserve, pristine, patched, reference)
PASSING_CASES = [
    ("admission", "rejected_request_not_enqueued_prefill", False, "unsafe", "safe", "safe"),
    ("admission", "rejected_request_not_enqueued_decode", False, "unsafe", "safe", "safe"),
    ("admission", "valid_request_admitted", True, "safe", "safe", "safe"),
    ("admission", "retracted_request_reenters", True, "safe", "safe", "safe"),
    ("prefill_retire", "delayed_result_ignored", False, "not-applicable", "safe", "safe"),
    ("page_lifetime", "prefill_source_pages_held", False, "not-applicable", "not-applicable", "unsafe"),
]


def probe_doc(root: Path, role_index: int, cases, *, import_seconds=8.5, link: Path | None = None) -> dict:
    link = link or Path("/nowhere/probes")
    return {
        "tree": str(root),
        "version": "0.5.19" if role_index < 2 else "0.5.22",
        "sglang_file": str(root / "sglang" / "__init__.py"),
        "python": "3.11.7",
        "torch": "2.13.0+cpu",
        "import_seconds": import_seconds,
        "cases": [case(p, n, verdicts[role_index], mp,
                       traceback=f"File \"{root}/sglang/srt/disaggregation/prefill.py\", line 1",
                       link=f"{link}/admission.py")
                  for p, n, mp, *verdicts in cases],
    }


PREFILL, UTILS = "sglang/srt/disaggregation/prefill.py", "sglang/srt/disaggregation/utils.py"
# Per fix, the added lines upstream's tests ran on the patched tree (upstream-tests.json records them).
UPSTREAM_RAN = {"pr36988": [f"{PREFILL}:710", f"{PREFILL}:712"], "pr38935": []}


def fixture_coverage() -> dict:
    """The coverage section a run with upstream's tests under coverage writes (job/coverage.py)."""
    from backport.evidence.coverage import entries, totals

    patches = [
        {
            "fix": "pr36988",
            "variant": "pr36988-0.5.19.patch",
            "added": 5,
            "executed_by_probes": 3,
            "executed_by_upstream_tests": 2,
            "executed_only_by_upstream_tests": [f"{PREFILL}:712"],
            "excluded": [],
            "not_executed": [f"{PREFILL}:715"],
        },
        {
            "fix": "pr38935",
            "variant": "pr38935-0.5.19.patch",
            "added": 2,
            "executed_by_probes": 2,
            "executed_by_upstream_tests": 0,
            "executed_only_by_upstream_tests": [],
            "excluded": [{"line": f"{UTILS}:14", "reason": "a transport library no CPU runs"}],
            "not_executed": [],
        },
    ]
    functions = [
        {"fix": "pr36988", "file": PREFILL, "function": "PrefillMixin.process_batch_result_disagg_prefill",
         "first_line": 690, "last_line": 760, "lines": 40, "executed_by_unsafe_cases": 12,
         "unsafe_cases": ["admission/rejected_request_not_enqueued_prefill"]},
        {"fix": "pr38935", "file": UTILS, "function": "admit", "first_line": 10, "last_line": 13, "lines": 3,
         "executed_by_unsafe_cases": 0, "unsafe_cases": []},
    ]
    section = {"measured": True, "patches": patches}
    return {**section, "totals": totals(entries(section)), "min_percent": None,
            "upstream_tests": {"measured": True, "reason": None}, "pristine_functions": functions,
            "pristine_reason": None}


def fixture_run(tmp: Path, *, cases=PASSING_CASES, started="2026-11-30T10:00:00+00:00",
                import_seconds=8.5, reference=True, **record_fields) -> evidence.Bundle:
    """A run's raw outputs as the real parts print them, with this run's temporary paths.
    `record_fields`: more of the run's record (RunRecord), e.g. `live=` or `vulnerabilities=`."""
    pristine = tmp / "cache" / "trees" / f"wheel-{D[1]}" / "tree"
    patched = tmp / "cache" / "work" / "sglang-0.5.19-x1y2z3"
    ref = tmp / "cache" / "trees" / f"wheel-{D[2]}" / "tree"
    series = tmp / "toolkit" / "patches"
    link = tmp / "probe-link" / "probes"  # a caller's own directory, named in extra_paths
    trees = {
        "pristine": TreeInput(
            "pristine", "sglang==0.5.19", "0.5.19", D[3], C[1], D[1], False, pristine, pristine
        ),
        "patched": TreeInput(
            "patched", "sglang==0.5.19", "0.5.19", D[4], C[2], D[1], False, patched, patched
        ),
    }
    roots = [pristine, patched]
    if reference:
        trees["reference"] = TreeInput(
            "reference", "sglang==0.5.22", "0.5.22", D[5], C[3], D[2], False, ref, ref
        )
        roots.append(ref)
    probe_docs = {role: probe_doc(root, i, cases, import_seconds=import_seconds + i, link=link)
                  for i, (role, root) in enumerate(zip(trees, roots))}
    apply_report = {
        "schema": 1,
        "tree": str(patched),
        "version": "0.5.19",
        "package_prefix": "",
        "check": False,
        "base_commit": C[1],
        "head_commit": C[2],
        "status": "applied",
        "patches": [
            {
                "fix": "pr36988",
                "variant": "pr36988-0.5.19.patch",
                "variant_sha256": D[6],
                "status": "applied",
                "reason": "",
                "commit": C[4],
                "hunks": [
                    {
                        "file": "sglang/srt/disaggregation/prefill.py",
                        "status": "offset",
                        "offset": 3,
                        "fuzz": 0,
                        "line": 700,
                    }
                ],
            },
            {
                "fix": "pr38935",
                "variant": "pr38935-0.5.19.patch",
                "variant_sha256": D[7],
                "status": "applied",
                "reason": "",
                "commit": C[2],
                "hunks": [
                    {
                        "file": "sglang/srt/disaggregation/utils.py",
                        "status": "exact",
                        "offset": 0,
                        "fuzz": 0,
                        "line": 10,
                    }
                ],
            },
        ],
    }
    test = "test/registered/unit/disaggregation/test_admission_abort_not_enqueued.py"
    upstream = {
        "skipped": None,
        "files": [{"path": test, "rev": C[5], "fix": "pr38935", "sha256": D[8],
                   "source": "cache" if started.endswith("11:00:00+00:00") else "https://example/raw",
                   "error": None, "unavailable": None}],
        "trees": [{"tree": role, "tests": [
            {"file": test, "rev": C[5], "sha256": D[8], "nodeid": f"{test}::T::test_rejected",
             "outcome": "failed" if role == "pristine" else "passed",
             "reason": f"AssertionError in {pristine}/sglang/x.py" if role == "pristine" else None}]}
            for role in trees],
    }
    upstream["trees"][1]["added_lines_executed"] = UPSTREAM_RAN
    patches = [{"fix": p["fix"], "variant": p["variant"], "path": f"{p['fix']}/{p['variant']}",
                "sha256": p["variant_sha256"], "status": p["status"]} for p in apply_report["patches"]]
    timestamps = {"started": started, "finished": started, "duration_seconds": 61.5,
                  "steps": [{"step": "probe-pristine", "seconds": 20.1}],
                  "paths": {"bundle": str(tmp / "bundle"), "patched_tree": str(patched)}}
    environment = Environment(
        probe=Interpreter(python="3.11.7", implementation="CPython", platform="Linux-x86_64",
                          machine="x86_64", packages={"torch": "2.13.0+cpu", "transformers": "5.12.1"}),
        toolkit_python="3.11.7", toolkit_packages={"gitpython": "3.1.45"},
    )
    return evidence.assemble(evidence.RunRecord(
        mode="backport",
        target={"spec": "sglang==0.5.19", "kind": "wheel", "version": "0.5.19", "artifact_sha256": D[1],
                "commit": None, "unpinned": False, "head": None},
        trees=trees, probes={role: TreeProbe.from_json(doc) for role, doc in probe_docs.items()},
        apply_report=apply_report, patches=patches,
        series_files=[{"path": "fixes.toml", "sha256": D[9]}], upstream_tests=upstream,
        environment=environment,
        toolkit=Toolkit(version="0.1.0", git_commit=None, git_dirty=None,
                        code={"backport_sha256": "ab" * 32, "probes_sha256": "ac" * 32,
                              "probe_requirements_sha256": "ad" * 32},
                        distribution={"installed_from": "wheel",
                                      "wheel": "sglang_backport-0.1.0-py3-none-any.whl",
                                      "wheel_sha256": "ae" * 32}),
        timestamps=timestamps, reference_choice="default",
        extra_paths=((series, ""), (tmp / "cache", "<cache>"), (link, "probes")), coverage=fixture_coverage(),
        **record_fields))


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "run"))


def _files(bundle: Path) -> list[str]:
    return sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())


def _validate(statement: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(statement)


def _receipt(bundle: Path) -> dict:
    return json.loads((bundle / "receipt.json").read_text())


def _reseal(bundle: Path, statement: dict | None = None) -> None:
    """Write the receipt (if given) and recompute SHA256SUMS, as someone hiding a change would."""
    if statement is not None:
        (bundle / "receipt.json").write_bytes(evidence.canonical_json(statement))
    digests = {n: evidence.sha256_file(bundle / n) for n in _files(bundle) if n != "SHA256SUMS"}
    (bundle / "SHA256SUMS").write_text(evidence.sums_text(digests))


def _rewrite(bundle: Path, edit) -> None:
    """Edit the receipt and reseal SHA256SUMS."""
    statement = _receipt(bundle)
    edit(statement)
    _reseal(bundle, statement)


# ---- pair verdicts --------------------------------------------------------------------------------


@pytest.mark.parametrize("base, head, expected", [
    ("unsafe", "safe", "fixed"),
    ("safe", "safe", "held"),
    ("unsafe", "unsafe", "still-unsafe"),
    ("safe", "unsafe", "regressed"),
    ("not-applicable", "safe", "added"),
    ("not-applicable", "unsafe", "regressed"),
    ("not-applicable", "not-applicable", "not-applicable"),
    ("safe", "not-applicable", "error"),
    ("unsafe", "not-applicable", "error"),
    ("error", "safe", "error"),
    ("safe", "error", "error"),
    ("unsafe", "error", "error"),
    ("error", "error", "error"),
    (None, "safe", "error"),
    ("safe", None, "error"),
])
def test_pair_verdict_table(base, head, expected):
    assert evidence.pair_verdict(base, head) == expected


def test_findings_and_must_preserve():
    assert evidence.is_finding("error", True) and evidence.is_finding("error", False)
    assert evidence.is_finding("regressed", True)
    assert evidence.is_finding("still-unsafe", False)
    assert not evidence.is_finding("still-unsafe", True)  # must-preserve: only regressions count
    for ok in evidence.PASSING:
        assert not evidence.is_finding(ok, False)
    assert set(evidence.PAIR_VERDICTS) - evidence.PASSING == {"still-unsafe", "regressed", "error"}


def test_case_rows_pair_and_reference_check(tmp_path):
    statement = fixture_run(tmp_path).statement
    p = statement["predicate"]
    rows = {(r["probe"], r["case"]): r for r in p["cases"]}
    assert rows[("admission", "rejected_request_not_enqueued_prefill")]["pair"] == "fixed"
    assert rows[("admission", "valid_request_admitted")]["pair"] == "held"
    assert rows[("prefill_retire", "delayed_result_ignored")]["pair"] == "added"
    diff = rows[("page_lifetime", "prefill_source_pages_held")]
    assert diff["pair"] == "not-applicable" and diff["reference_agrees"] is False
    assert p["reference_differences"] == [{"probe": "page_lifetime", "case": "prefill_source_pages_held",
                                           "patched": "not-applicable", "reference": "unsafe"}]
    s = p["summary"]
    assert s["result"] == "pass" and s["findings"] == []
    assert s["pair_verdicts"] == {"fixed": 2, "held": 2, "still-unsafe": 0, "regressed": 0, "added": 1,
                                  "not-applicable": 1, "error": 0}
    assert s["per_tree"]["pristine"] == {"safe": 2, "unsafe": 2, "error": 0, "not-applicable": 2}
    assert s["upstream_tests"] == {
        "patched": {"passed": 1},
        "pristine": {"failed": 1},
        "reference": {"passed": 1},
    }


@pytest.mark.parametrize("extra, finding", [
    (("handoff", "stale_pages_read", False, "unsafe", "unsafe", "safe"), "still-unsafe"),
    (("admission", "preempted_request_reenters", True, "safe", "unsafe", "safe"), "regressed"),
    (("handoff", "decode_release", False, "unsafe", "error", "safe"), "error"),
])
def test_failing_runs(tmp_path, extra, finding):
    bundle = fixture_run(tmp_path, cases=[*PASSING_CASES, extra])
    s = bundle.summary
    assert s["result"] == "fail"
    assert s["findings"] == [
        {"probe": extra[0], "case": extra[1], "pair": finding, "must_preserve": extra[2]}
    ]
    _validate(pointed(bundle.statement))  # what receipt.json holds of the (attached) statement
    assert "**" + finding + "**" in bundle.files["REPORT.md"].decode()
    assert evidence.verify(evidence.write_bundle(tmp_path / "out", bundle)).summary["result"] == "fail"


def test_must_preserve_still_unsafe_is_not_a_finding(tmp_path):
    s = fixture_run(tmp_path, cases=[*PASSING_CASES,
                                     ("admission", "odd_valid", True, "unsafe", "unsafe", "unsafe")]).summary
    assert s["result"] == "pass" and s["pair_verdicts"]["still-unsafe"] == 1


def test_a_run_without_cases_fails(tmp_path):
    assert fixture_run(tmp_path, cases=[]).summary["result"] == "fail"


# ---- the receipt ----------------------------------------------------------------------------------


def test_receipt_is_an_in_toto_statement_and_validates(bundle_dir):
    statement = _receipt(bundle_dir)
    _validate(statement)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://sglang-backport.dev/receipt/v1"
    p = statement["predicate"]
    # The subject is the artifact: the patched tree by its digest (no export in this run) ...
    assert statement["subject"] == [{"name": "patched-tree/sglang",  # dirHash1, as the attestations say it
                                     "digest": {"dirHash1": p["inputs"]["trees"]["patched"]["tree_digest"]},
                                     "annotations": {"version": "0.5.19", "digest_of": TREE_DIGEST_METHOD}}]
    assert p["export"] is None
    # ... and every bundle file is listed, with its digest, in predicate.files.
    assert sorted(p["files"]) == sorted(set(_files(bundle_dir)) - {"receipt.json", "SHA256SUMS"})
    for name, digest in p["files"].items():
        assert evidence.sha256_file(bundle_dir / name) == digest
    assert p["inputs"]["patches"][0] == {"fix": "pr36988", "variant": "pr36988-0.5.19.patch",
                                         "path": "pr36988/pr36988-0.5.19.patch", "sha256": D[6],
                                         "status": "applied"}
    assert p["inputs"]["trees"]["pristine"]["tree_digest"] == D[3]
    assert p["inputs"]["reference"]["spec"] == "sglang==0.5.22"
    assert p["inputs"]["reference"]["chosen"] == "default"
    # Format 4: the receipt points at the files (predicate.files) and copies none of them; its
    # verdict table keeps what a policy engine reads, the cases' prose stays in the probe files.
    assert p["schema_version"] == 4 and not {"probes", "apply", "upstream_tests"} & set(p)
    assert all(set(row) == set(TABLE_KEYS) for row in p["cases"]) and len(p["cases"]) == 6
    assert p["cases"][0] == {"probe": "admission", "case": "rejected_request_not_enqueued_prefill",
                             "must_preserve": False, "verdicts": {"pristine": "unsafe", "patched": "safe",
                                                                  "reference": "safe"},
                             "pair": "fixed", "reference_agrees": True}
    held = attached_from(bundle_dir, statement)
    for role in ("pristine", "patched", "reference"):
        assert held["predicate"]["probes"][role]["file"] == f"probes/{role}.json"
        assert held["predicate"]["probes"][role]["sha256"] == p["files"][f"probes/{role}.json"]
    assert evidence.check_statement(held) == []


def test_probe_outputs_are_normalised(bundle_dir, tmp_path):
    p = _receipt(bundle_dir)["predicate"]
    for role in ("pristine", "patched", "reference"):
        doc = json.loads((bundle_dir / "probes" / f"{role}.json").read_text())
        assert doc["tree"] == role
        assert doc["sglang_file"] == "sglang/__init__.py"
        assert "import_seconds" not in doc
        assert doc["cases"][0]["details"]["traceback"].startswith(f'File "{role}/sglang/srt/')
        assert doc["cases"][0]["details"]["link"] == "probes/admission.py"
    assert p["timestamps"]["import_seconds"] == {"pristine": 8.5, "patched": 9.5, "reference": 10.5}
    apply_report = json.loads((bundle_dir / "apply-report.json").read_text())
    assert apply_report["tree"] == "patched"
    upstream = json.loads((bundle_dir / "upstream-tests.json").read_text())
    assert upstream["trees"][0]["tests"][0]["reason"] == "AssertionError in pristine/sglang/x.py"
    assert "source" not in upstream["files"][0]
    assert p["timestamps"]["upstream_test_sources"] == {f"{upstream['files'][0]['path']}@{C[5]}":
                                                        "https://example/raw"}
    # No temporary path survives anywhere outside `timestamps`.
    for name in _files(bundle_dir):
        text = (bundle_dir / name).read_text()
        if name == "receipt.json":
            body = json.loads(text)
            body["predicate"].pop("timestamps")
            text = json.dumps(body)
        assert str(tmp_path) not in text, name


def test_only_the_paths_named_are_replaced(tmp_path):
    """The evidence module guesses no path (no other module's temporary names): the caller names them."""
    foreign = "/tmp/sglang-backport-probes-ab12_cd/probes/admission.py"
    doc = {"tree": "/x/tree", "cases": [], "details": {"link": foreign, "own": "/x/tree/sglang/a.py"}}
    from backport.evidence.scrub import normalise_probe

    normalised, _ = normalise_probe(doc, "patched", "/x/tree")
    assert normalised["details"] == {"link": foreign, "own": "patched/sglang/a.py"}
    named, _ = normalise_probe(
        doc, "patched", "/x/tree", [("/tmp/sglang-backport-probes-ab12_cd/probes", "probes")]
    )
    assert named["details"]["link"] == "probes/admission.py"


def test_same_inputs_differ_only_in_timestamps(tmp_path):
    one = fixture_run(tmp_path / "a", started="2026-11-30T10:00:00+00:00", import_seconds=8.1)
    two = fixture_run(tmp_path / "bb", started="2026-11-30T11:00:00+00:00", import_seconds=12.7)
    for name in one.files:
        if name in ("receipt.json", "SHA256SUMS"):
            continue
        assert one.files[name] == two.files[name], name
    r1, r2 = (json.loads(b.files["receipt.json"]) for b in (one, two))
    assert r1["predicate"].pop("timestamps") != r2["predicate"].pop("timestamps")
    assert r1 == r2
    # and byte for byte: every differing line lies inside the `timestamps` block
    import difflib

    def block(lines):
        start = lines.index('    "timestamps": {')
        return start, lines.index("    },", start) + 1

    l1, l2 = (b.files["receipt.json"].decode().splitlines() for b in (one, two))
    (s1, e1), (s2, e2) = block(l1), block(l2)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=l1, b=l2, autojunk=False).get_opcodes():
        if tag != "equal":
            assert s1 <= i1 and i2 <= e1 and s2 <= j1 and j2 <= e2, (l1[i1:i2], l2[j1:j2])


def test_written_bundles_are_byte_identical_apart_from_the_receipt(tmp_path):
    a = evidence.write_bundle(
        tmp_path / "a", fixture_run(tmp_path / "r1", started="2026-01-01T00:00:00+00:00")
    )
    b = evidence.write_bundle(
        tmp_path / "b", fixture_run(tmp_path / "r2", started="2026-01-02T00:00:00+00:00")
    )
    assert _files(a) == _files(b)
    differing = [n for n in _files(a) if (a / n).read_bytes() != (b / n).read_bytes()]
    assert differing == ["SHA256SUMS", "receipt.json"]


def test_schema_rejects_broken_receipts(bundle_dir):
    statement = _receipt(bundle_dir)
    _validate(statement)
    for breaking in (lambda s: s.pop("subject"),
                     lambda s: s["predicate"]["cases"][0].update(pair="fine"),
                     lambda s: s["predicate"].update(probes={}),  # format 4 copies no file
                     lambda s: s["predicate"]["cases"][0].update(expect="prose"),
                     lambda s: s["predicate"].pop("timestamps"),
                     lambda s: s["subject"][0]["digest"].update(dirHash1="abc"),
                     lambda s: s["subject"][0]["digest"].update(sha256=D[1])):  # a tree has no sha256
        broken = copy.deepcopy(statement)
        breaking(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(SCHEMA).validate(broken)


# ---- the bundle -----------------------------------------------------------------------------------


def test_bundle_layout(bundle_dir):
    assert _files(bundle_dir) == BUNDLE_FILES
    listed = [line.split("  ", 1)[1] for line in (bundle_dir / "SHA256SUMS").read_text().splitlines()]
    assert listed == sorted(set(_files(bundle_dir)) - {"SHA256SUMS"})


def test_upstream_pair_bundle_has_no_apply_report(tmp_path):
    """`run BASE --head HEAD`: nothing applied, so no apply-report.json; it still verifies."""
    raw = fixture_run(tmp_path / "r", reference=False)
    p = raw.statement["predicate"]
    trees = {
        role: TreeInput(role, t["spec"], t["version"], t["tree_digest"], t["commit"], t["artifact_sha256"])
        for role, t in p["inputs"]["trees"].items()
    }
    docs = {role: {**evidence.statement.embedded(p, f"probes/{role}.json"), "tree": "/x"} for role in trees}
    bundle = evidence.assemble(evidence.RunRecord(
        mode="upstream-pair", target={**p["inputs"]["target"], "head": "sglang==0.5.22"}, trees=trees,
        probes={role: TreeProbe.from_json(doc) for role, doc in docs.items()}, apply_report=None, patches=[],
        series_files=[], upstream_tests=None,
        environment=Environment.from_json(p["environment"]), toolkit=Toolkit.from_json(p["toolkit"]),
        timestamps=p["timestamps"]))
    out = evidence.write_bundle(tmp_path / "pair", bundle)
    assert "apply-report.json" not in _files(out)
    assert "No patch applied (the head tree is given" in (out / "REPORT.md").read_text()
    assert evidence.verify(out).ok, evidence.verify(out).problems


def test_sha256sum_c_passes(bundle_dir):
    sha256sum = shutil.which("sha256sum")
    if sha256sum is None:
        pytest.skip("no sha256sum on this machine")
    proc = subprocess.run([sha256sum, "-c", "--strict", "SHA256SUMS"], cwd=bundle_dir, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": OK") == len(_files(bundle_dir)) - 1


def test_report_md(bundle_dir):
    report = (bundle_dir / "REPORT.md").read_text()
    assert "Result: **PASS**" in report
    assert f"| pr36988 | `pr36988/pr36988-0.5.19.patch` | applied | `{D[6]}` |" in report
    assert "| probe / case | pristine | patched | reference | pair | patched = reference |" in report
    assert (
        "| admission / rejected_request_not_enqueued_prefill | unsafe | safe | safe | fixed | yes |" in report
    )
    assert "| admission / valid_request_admitted * | safe | safe | safe | held | yes |" in report
    assert ("| page_lifetime / prefill_source_pages_held | not-applicable | not-applicable | unsafe "
            "| not-applicable | **no** |") in report
    assert ("| `test/registered/unit/disaggregation/test_admission_abort_not_enqueued.py::T::test_rejected` "
            f"| `{C[5][:12]}` | failed | passed | passed |") in report
    assert "| pr38935 | `test_admission_abort_not_enqueued.py` @ " in report and "| fixed |" in report
    assert report == evidence.render_report(attached_from(bundle_dir, _receipt(bundle_dir)))


def test_write_bundle_replaces_only_bundles(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    with pytest.raises(BadInput):
        evidence.write_bundle(out, fixture_run(tmp_path / "r"), replace=True)
    assert (out / "precious.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        evidence.check_bundle_target(tmp_path / "afile")
    bundle = tmp_path / "bundle"
    evidence.write_bundle(bundle, fixture_run(tmp_path / "r", started="2026-01-01T00:00:00+00:00"))
    first = (bundle / evidence.RECEIPT).read_bytes()
    # the toolkit's own files only: replaced in place, nothing kept aside
    placed = evidence.place_bundle(bundle, fixture_run(tmp_path / "r", started="2026-01-02T00:00:00+00:00"),
                                   replace=True)
    assert placed.previous is None and (bundle / evidence.RECEIPT).read_bytes() != first
    assert evidence.verify(bundle).ok
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind
    # an empty folder made for the bundle is written into, nothing set aside for it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert evidence.place_bundle(empty, fixture_run(tmp_path / "r")).previous is None
    assert evidence.verify(empty).ok and not list(tmp_path.glob("empty.previous-*"))


def test_a_folder_with_someones_sha256sums_is_not_a_bundle(tmp_path):
    """A release folder with its own SHA256SUMS (or even a receipt.json of someone else's) is
    never replaced, with or without replace, and nothing in it changes."""
    release = tmp_path / "release"
    release.mkdir()
    (release / "myapp-1.0.tar.gz").write_bytes(b"\x1f\x8b tarball")
    (release / "SHA256SUMS").write_text(f"{'0' * 64}  myapp-1.0.tar.gz\n")
    before = {p.name: p.read_bytes() for p in release.iterdir()}
    for replace in (False, True):
        with pytest.raises(BadInput, match="is not an evidence bundle"):
            evidence.write_bundle(release, fixture_run(tmp_path / "r"), replace=replace)
    (release / "receipt.json").write_text('{"predicateType": "https://example.org/other"}')
    with pytest.raises(BadInput, match="is not an evidence bundle"):
        evidence.write_bundle(release, fixture_run(tmp_path / "r"), replace=True)
    (release / "receipt.json").unlink()
    assert {p.name: p.read_bytes() for p in release.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["release"]  # no staging left
    assert not evidence.is_bundle(release)


def test_a_bundle_is_replaced_only_when_asked_and_foreign_files_are_kept(tmp_path):
    bundle = evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "r1",
                                                                     started="2026-01-01T00:00:00+00:00"))
    assert evidence.is_bundle(bundle) and (bundle / ".sglang-backport-bundle").is_file()
    (bundle / "receipt.dsse.json").write_text('{"signatures": []}')   # a signature over this receipt
    (bundle / "NOTES.txt").write_text("reviewed by A. on Monday")
    old_receipt = (bundle / evidence.RECEIPT).read_bytes()
    newer = fixture_run(tmp_path / "r2", started="2026-01-02T00:00:00+00:00")
    with pytest.raises(BadInput, match="holds an evidence bundle already; pass --force"):
        evidence.write_bundle(bundle, newer)
    assert (bundle / "NOTES.txt").is_file() and (bundle / evidence.RECEIPT).read_bytes() == old_receipt
    placed = evidence.place_bundle(bundle, newer, replace=True)
    assert placed.previous is not None and placed.previous.parent == tmp_path
    assert placed.previous.name.startswith("bundle.previous-")
    # the old bundle is whole, its signature beside the receipt it signs; the new one verifies clean
    assert (placed.previous / "receipt.dsse.json").read_text() == '{"signatures": []}'
    assert (placed.previous / "NOTES.txt").read_text() == "reviewed by A. on Monday"
    assert (placed.previous / evidence.RECEIPT).read_bytes() == old_receipt
    assert not (bundle / "NOTES.txt").exists() and not (bundle / "receipt.dsse.json").exists()
    assert evidence.verify(bundle).ok
    # an edited file of the toolkit's is the user's now: kept aside too, never deleted
    (bundle / evidence.REPORT).write_text("my edits\n")
    again = evidence.place_bundle(bundle, newer, replace=True)
    assert again.previous is not None and (again.previous / evidence.REPORT).read_text() == "my edits\n"
    assert again.previous != placed.previous and placed.previous.is_dir()


def test_verify_of_a_directory_that_is_not_a_bundle_is_bad_input(tmp_path):
    (tmp_path / "SHA256SUMS").write_text(f"{'0' * 64}  x\n")
    with pytest.raises(BadInput, match="not an evidence bundle"):
        evidence.verify(tmp_path)


# ---- verify: digests ------------------------------------------------------------------------------


def test_verify_passes(bundle_dir):
    result = evidence.verify(bundle_dir)
    assert result.ok, result.problems
    assert len(result.files) == 8 and result.summary["result"] == "pass"
    assert result.to_json()["first"] is None


def _positions(size: int) -> list[int]:
    return sorted({0, 1, size // 3, size // 2, (2 * size) // 3, size - 2, size - 1} - {-1})


def test_any_single_byte_change_is_named(bundle_dir, tmp_path):
    """Every file, several positions each (start, middle, end): verify names exactly that file."""
    checked = 0
    for name in _files(bundle_dir):
        original = (bundle_dir / name).read_bytes()
        for pos in _positions(len(original)):
            for replacement in {original[pos] ^ 0x01, ord("x") if original[pos] != ord("x") else ord("y")}:
                changed = bytearray(original)
                changed[pos] = replacement
                (bundle_dir / name).write_bytes(bytes(changed))
                result = evidence.verify(bundle_dir)
                assert not result.ok, (name, pos)
                assert result.first.file == name, (name, pos, result.first)
                assert result.first.kind == "modified", (name, pos, result.first)
                checked += 1
        (bundle_dir / name).write_bytes(original)
    assert checked > 50
    assert evidence.verify(bundle_dir).ok


def test_every_byte_of_sha256sums(bundle_dir):
    """SHA256SUMS is the one file whose edits could be blamed on another file: try every byte."""
    original = (bundle_dir / "SHA256SUMS").read_bytes()
    for pos in range(len(original)):
        changed = bytearray(original)
        changed[pos] = ord("0") if original[pos] != ord("0") else ord("1")
        (bundle_dir / "SHA256SUMS").write_bytes(bytes(changed))
        result = evidence.verify(bundle_dir)
        assert not result.ok and result.first.file == "SHA256SUMS", (pos, result.first)
    (bundle_dir / "SHA256SUMS").write_bytes(original)
    assert evidence.verify(bundle_dir).ok


@pytest.mark.parametrize("name", ["receipt.json", "REPORT.md", "apply-report.json", "probes/patched.json",
                                  "upstream-tests.json", "SHA256SUMS"])
def test_deleted_file_is_named(bundle_dir, name):
    (bundle_dir / name).unlink()
    result = evidence.verify(bundle_dir)
    assert not result.ok and result.first.file == name and result.first.kind == "missing"


@pytest.mark.parametrize("name", ["extra.txt", "probes/extra.json", ".hidden"])
def test_added_file_is_named(bundle_dir, name):
    (bundle_dir / name).write_text("{}\n")
    result = evidence.verify(bundle_dir)
    assert not result.ok and result.first.file == name and result.first.kind == "unexpected"


def test_symlink_is_named(bundle_dir):
    (bundle_dir / "link.md").symlink_to(bundle_dir / "REPORT.md")
    result = evidence.verify(bundle_dir)
    assert (result.first.file, result.first.kind) == ("link.md", "unexpected")


def test_renamed_file_is_named(bundle_dir):
    (bundle_dir / "REPORT.md").rename(bundle_dir / "REPORT.txt")
    result = evidence.verify(bundle_dir)
    assert [(p.file, p.kind) for p in result.problems] == [
        ("REPORT.md", "missing"),
        ("REPORT.txt", "unexpected"),
    ]


def test_resealed_file_is_caught_by_the_receipt(bundle_dir):
    (bundle_dir / "probes" / "patched.json").write_text("{}\n")
    _reseal(bundle_dir)
    result = evidence.verify(bundle_dir)
    assert (result.first.file, result.first.kind) == ("probes/patched.json", "modified")


def test_verify_of_a_missing_directory_is_bad_input(tmp_path):
    with pytest.raises(BadInput):
        evidence.verify(tmp_path / "nope")


# ---- verify: the schema is never skipped -----------------------------------------------------------


def test_a_receipt_outside_the_schema_is_named(bundle_dir):
    """An extra key breaks no derivation, only the schema: verify must still refuse it."""
    _rewrite(bundle_dir, lambda s: s["predicate"].update(note="trust me"))
    result = evidence.verify(bundle_dir)
    assert (result.first.file, result.first.kind) == ("receipt.json", "inconsistent")
    assert "receipt schema" in result.first.detail


def test_verify_refuses_to_run_without_its_schema(bundle_dir, tmp_path, monkeypatch):
    from backport import resources
    from backport.evidence import statement

    monkeypatch.setattr(resources, "receipt_schema", lambda: tmp_path / "missing.schema.json")
    statement._validator.cache_clear()
    try:
        with pytest.raises(Finding, match="receipt schema cannot be read"):
            evidence.verify(bundle_dir)
    finally:
        statement._validator.cache_clear()


# ---- verify: every value shared by several files agrees ------------------------------------------

RECEIPT, REPORT, APPLY = "receipt.json", "REPORT.md", "apply-report.json"
PATCHED, PRISTINE, REF, UPSTREAM = ("probes/patched.json", "probes/pristine.json", "probes/reference.json",
                                    "upstream-tests.json")


def _restated(**documents):
    """A receipt edit that keeps the receipt consistent with itself (a careful forger): the receipt a
    run would have written had its files held the edited documents (the files stay as they are)."""
    def edit(statement, bundle):
        from backport.evidence.statement import embedded, restate

        held = attached_from(bundle, statement)
        p = held["predicate"]
        document_edit = next(iter(documents.values()))
        if "probes" in documents:
            probes = {role: embedded(p, f"probes/{role}.json") for role in p["probes"]}
            document_edit(probes)
            new = restate(held, probes=probes)
        else:
            upstream = embedded(p, UPSTREAM)
            document_edit(upstream)
            new = restate(held, upstream=upstream)
        statement.clear()
        statement.update(pointed(new))

    edit.with_bundle = True  # type: ignore[attr-defined]
    return edit


def _set(path: str, value):
    """An edit that sets one value of a JSON document, by a dotted path with [index] parts."""
    def edit(document):
        parts = path.replace("[", ".").replace("]", "").split(".")
        target = document
        for part in parts[:-1]:
            target = target[int(part)] if part.isdigit() else target[part]
        last = parts[-1]
        target[int(last) if last.isdigit() else last] = value
    return edit


def _both(*edits):
    def edit(document):
        for one in edits:
            one(document)
    return edit


P = "predicate."
# (case id, file edited, the edit, files verify must name). A JSON edit is a function of the
# document; a REPORT.md edit is (old text, new text). One name: verify names that file alone.
# Two names: only the receipt and REPORT.md hold the value, so verify names both.
TAMPER_CASES = [
    # patch digests and statuses
    ("patch-sha-receipt-inputs", RECEIPT, _set(P + "inputs.patches[0].sha256", D[9]), [RECEIPT]),
    ("patch-sha-apply-report", APPLY, _set("patches[0].variant_sha256", D[9]), [APPLY]),
    ("patch-sha-report-md", REPORT, (f"| applied | `{D[6]}` |", f"| applied | `{D[9]}` |"), [REPORT]),
    ("patch-status-apply-report", APPLY, _set("patches[1].status", "already-present"), [APPLY]),
    ("patch-status-receipt", RECEIPT, _set(P + "inputs.patches[1].status", "already-present"), [RECEIPT]),
    (
        "patch-status-report-md",
        REPORT,
        ("`pr38935/pr38935-0.5.19.patch` | applied |", "`pr38935/pr38935-0.5.19.patch` | already-present |"),
        [REPORT],
    ),
    # tree digests
    # the patched tree's digest is also the receipt's subject: an edit of one copy is the receipt's own
    ("tree-digest-receipt", RECEIPT, _set(P + "inputs.trees.patched.tree_digest", D[9]), [RECEIPT]),
    ("tree-digest-subject", RECEIPT, _set("subject[0].digest.dirHash1", D[9]), [RECEIPT]),
    ("tree-digest-report-md", REPORT, (f"`{D[4]}`", f"`{D[9]}`"), [REPORT, RECEIPT]),
    (
        "reference-digest-receipt-one-copy",
        RECEIPT,
        _set(P + "inputs.trees.reference.tree_digest", D[9]),
        [RECEIPT],
    ),
    (
        "reference-digest-receipt-both-copies",
        RECEIPT,
        _both(
            _set(P + "inputs.trees.reference.tree_digest", D[9]),
            _set(P + "inputs.reference.tree_digest", D[9]),
        ),
        [REPORT, RECEIPT],
    ),
    ("artifact-digest-receipt", RECEIPT, _set(P + "inputs.target.artifact_sha256", D[9]), [RECEIPT]),
    # commits
    ("head-commit-apply-report", APPLY, _set("head_commit", C[9]), [APPLY]),
    ("patched-commit-receipt-one-copy", RECEIPT, _set(P + "inputs.trees.patched.commit", C[9]), [RECEIPT]),
    ("head-commit-report-md", REPORT, (f"head commit `{C[2]}`", f"head commit `{C[9]}`"), [REPORT]),
    ("pristine-commit-receipt", RECEIPT, _set(P + "inputs.trees.pristine.commit", C[9]), [REPORT, RECEIPT]),
    ("pristine-commit-report-md", REPORT, (f"`{C[1]}`", f"`{C[9]}`"), [REPORT, RECEIPT]),
    # verdicts
    ("verdict-probe-file", PATCHED, _set("cases[0].verdict", "unsafe"), [PATCHED]),
    ("verdict-reference-file", REF, _set("cases[5].verdict", "not-applicable"), [REF]),
    (
        "verdict-receipt-everywhere",
        RECEIPT,
        _restated(probes=_set("patched.cases[0].verdict", "unsafe")),
        [RECEIPT],
    ),
    ("verdict-receipt-table-only", RECEIPT, _set(P + "cases[0].verdicts.patched", "unsafe"), [RECEIPT]),
    ("pair-receipt", RECEIPT, _set(P + "cases[0].pair", "held"), [RECEIPT]),
    (
        "verdict-report-md",
        REPORT,
        (
            "enqueued_prefill | unsafe | safe | safe | fixed |",
            "enqueued_prefill | safe | safe | safe | held |",
        ),
        [REPORT],
    ),
    # the summary
    ("summary-result-receipt", RECEIPT, _set(P + "summary.result", "fail"), [RECEIPT]),
    ("summary-counts-receipt", RECEIPT, _set(P + "summary.pair_verdicts.fixed", 3), [RECEIPT]),
    (
        "summary-findings-receipt",
        RECEIPT,
        _set(
            P + "summary.findings",
            [{"probe": "admission", "case": "x", "pair": "error", "must_preserve": False}],
        ),
        [RECEIPT],
    ),
    ("reference-differences-receipt", RECEIPT, _set(P + "reference_differences", []), [RECEIPT]),
    ("summary-result-report-md", REPORT, ("Result: **PASS**", "Result: **FAIL**"), [REPORT]),
    ("summary-counts-report-md", REPORT, ("- fixed: 2", "- fixed: 3"), [REPORT]),
    # upstream tests
    ("upstream-outcome-file", UPSTREAM, _set("trees[0].tests[0].outcome", "passed"), [UPSTREAM]),
    (
        "upstream-outcome-receipt",
        RECEIPT,
        _restated(upstream=_set("trees.0.tests.0.outcome", "passed")),
        [RECEIPT],
    ),
    (
        "upstream-outcome-report-md",
        REPORT,
        ("| failed | passed | passed |", "| passed | passed | passed |"),
        [REPORT],
    ),
    # (REPORT.md shows every reason, so the receipt and the report outvote the file)
    ("upstream-reason-file", UPSTREAM, _set("trees[0].tests[0].reason", None), [UPSTREAM]),
    # upstream test pins (null: unpinned)
    # the pin is in the file and REPORT.md only: format 4 names REPORT.md, which no longer renders
    ("upstream-pin-file", UPSTREAM, _set("files[0].pin", D[8]), [REPORT]),
    ("upstream-pin-report-md", REPORT, ("`: unpinned (sha256 `", "`: pinned (sha256 `"), [REPORT]),
    # coverage: lines upstream's tests ran (the receipt's counts against upstream-tests.json's lines)
    (
        "coverage-upstream-count-receipt",
        RECEIPT,
        _set(P + "coverage.patches[0].executed_by_upstream_tests", 3),
        [RECEIPT],
    ),
    (
        "coverage-upstream-count-and-totals-receipt",
        RECEIPT,
        _both(
            _set(P + "coverage.patches[0].executed_by_upstream_tests", 3),
            _set(P + "coverage.totals.executed_by_upstream_tests", 3),
        ),
        [RECEIPT],
    ),
    (
        "coverage-upstream-not-measured-receipt",
        RECEIPT,
        _set(P + "coverage.patches[1].executed_by_upstream_tests", None),
        [RECEIPT],
    ),
    (
        "coverage-not-executed-moved-receipt",
        RECEIPT,
        _both(
            _set(P + "coverage.patches[0].not_executed", []),
            _set(
                P + "coverage.patches[0].executed_only_by_upstream_tests",
                [f"{PREFILL}:712", f"{PREFILL}:715"],
            ),
            _set(P + "coverage.totals.executed_only_by_upstream_tests", 2),
            _set(P + "coverage.totals.not_executed", 0),
        ),
        [RECEIPT],
    ),
    (
        "coverage-upstream-lines-file",  # the receipt's coverage record against the file (format 4)
        UPSTREAM,
        _set("trees[1].added_lines_executed.pr38935", [f"{UTILS}:12"]),
        [RECEIPT],
    ),
    ("coverage-upstream-count-report-md", REPORT, ("| 2 (only by them:", "| 3 (only by them:"), [REPORT]),
    # coverage: the pristine functions' lines the unsafe cases ran
    (
        "pristine-function-case-receipt",
        RECEIPT,
        _set(P + "coverage.pristine_functions[0].unsafe_cases", ["admission/valid_request_admitted"]),
        [RECEIPT],
    ),
    (
        "pristine-function-count-receipt",
        RECEIPT,
        _set(P + "coverage.pristine_functions[1].executed_by_unsafe_cases", 4),
        [RECEIPT],
    ),
    ("pristine-function-report-md", REPORT, ("| 40 | 12 |", "| 40 | 13 |"), [REPORT]),
    # the environment the probes ran in
    ("torch-probe-file", PRISTINE, _set("torch", "2.14.0+cpu"), [PRISTINE]),
    ("torch-receipt", RECEIPT, _set(P + "environment.torch", "2.14.0+cpu"), [RECEIPT]),
    ("python-receipt", RECEIPT, _set(P + "environment.python", "3.12.1"), [REPORT, RECEIPT]),
    # the tree subject's digests
    ("tree-subject-git-tree", RECEIPT, _set("subject[0].digest.gitTree", C[9]), [RECEIPT]),
    # the target and the mode
    ("target-spec-receipt", RECEIPT, _set(P + "inputs.target.spec", "sglang==0.5.20"), [REPORT, RECEIPT]),
    (
        "target-spec-report-md",
        REPORT,
        ("# Evidence: sglang==0.5.19", "# Evidence: sglang==0.5.20"),
        [REPORT, RECEIPT],
    ),
    ("target-version-receipt", RECEIPT, _set(P + "inputs.target.version", "0.5.20"), [RECEIPT]),
    ("mode-receipt", RECEIPT, _set(P + "mode", "upstream-pair"), [RECEIPT]),
]


def _tamper(bundle: Path, name: str, edit, *, careful: bool = True) -> None:
    """Edit one file, then make every digest agree again: SHA256SUMS and, when `careful`, the receipt's
    predicate.files (format 4 records a file's digest there only)."""
    statement = _receipt(bundle)
    if name == RECEIPT:
        edit(statement, bundle) if getattr(edit, "with_bundle", False) else edit(statement)
    else:
        path = bundle / name
        if name == REPORT:
            old, new = edit
            text = path.read_text()
            assert text.count(old) >= 1, old
            path.write_text(text.replace(old, new, 1))
        else:
            document = json.loads(path.read_text())
            edit(document)
            path.write_bytes(evidence.canonical_json(document))
        if careful:
            statement["predicate"]["files"][name] = evidence.sha256_file(path)
    _reseal(bundle, statement)


@pytest.mark.parametrize("name, edit, named", [c[1:] for c in TAMPER_CASES], ids=[c[0] for c in TAMPER_CASES])
def test_a_shared_value_edited_in_one_file_is_named(bundle_dir, name, edit, named, capsys):
    _tamper(bundle_dir, name, edit)
    result = evidence.verify(bundle_dir)
    assert not result.ok
    assert sorted({p.file for p in result.problems}) == sorted(named), result.problems
    assert result.first.file == named[0] and result.first.kind == "inconsistent", result.first
    assert cli.main(["verify", str(bundle_dir)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {named[0]}: inconsistent") and name in out, out


def test_tamper_table_edits_every_file_that_shares_values():
    assert {c[1] for c in TAMPER_CASES} == {RECEIPT, REPORT, APPLY, PATCHED, PRISTINE, REF, UPSTREAM}


@pytest.mark.parametrize("name, edit", [(PATCHED, _set("cases[0].verdict", "unsafe")),
                                        (UPSTREAM, _set("trees[0].tests[0].outcome", "passed"))])
def test_a_forger_who_leaves_the_recorded_digest_is_named_too(bundle_dir, name, edit):
    _tamper(bundle_dir, name, edit, careful=False)
    result = evidence.verify(bundle_dir)
    assert [(p.file, p.kind) for p in result.problems] == [(name, "modified")]


def test_a_file_rewritten_in_another_json_form_is_named(bundle_dir):
    """Same values, other bytes: the receipt's digest covers the canonical form only."""
    path = bundle_dir / APPLY
    path.write_text(json.dumps(json.loads(path.read_text())))
    statement = _receipt(bundle_dir)
    statement["predicate"]["files"][APPLY] = evidence.sha256_file(path)
    _reseal(bundle_dir, statement)
    result = evidence.verify(bundle_dir)
    assert [(p.file, p.kind) for p in result.problems] == [(APPLY, "inconsistent")]
    assert "canonical" in result.first.detail


def _leaves(value, path=()):
    """Every place in a JSON value, first list items only (the others have the same shape)."""
    yield path
    children = value.items() if isinstance(value, dict) else list(enumerate(value))[:1] \
        if isinstance(value, list) else ()
    for key, child in children:
        yield from _leaves(child, (*path, key))


def test_verify_never_raises_on_a_resealed_receipt(bundle_dir):
    """Every value of the receipt replaced by one of another type, resealed: verify answers (no
    exception) and accepts only edits of values that no other file holds."""
    statement = _receipt(bundle_dir)
    original = {name: (bundle_dir / name).read_bytes() for name in ("receipt.json", "SHA256SUMS")}
    unwitnessed = ("timestamps", "environment", "series", "chosen", "git_dirty")
    accepted, checked = [], 0
    same_shape = (
        ("predicate", "probes", "pristine"),
        ("predicate", "probes", "reference"),
        ("predicate", "summary", "per_tree", "pristine"),
        ("predicate", "summary", "per_tree", "reference"),
        ("predicate", "timestamps"),
        ("predicate", "environment", "packages"),
    )
    for path in list(_leaves(statement))[1:]:
        if any(path[:len(prefix)] == prefix for prefix in same_shape):
            continue
        edited = copy.deepcopy(statement)
        target = edited
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = 7 if target[path[-1]] is None else None
        _reseal(bundle_dir, edited)
        if evidence.verify(bundle_dir).ok:
            accepted.append(path)
        checked += 1
    for name, data in original.items():
        (bundle_dir / name).write_bytes(data)
    assert evidence.verify(bundle_dir).ok and checked > 150, checked
    assert all(any(word in path for word in unwitnessed) for path in accepted), accepted


def test_verify_cli(bundle_dir, capsys):
    assert cli.main(["verify", str(bundle_dir), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True and document["first"] is None
    (bundle_dir / "REPORT.md").write_text("tampered\n")
    assert cli.main(["verify", str(bundle_dir)]) == 1
    assert capsys.readouterr().out.startswith("FAIL REPORT.md: modified")
    assert cli.main(["verify", str(bundle_dir / "nope")]) == 2


def test_report_states_its_scope_before_the_result(bundle_dir):
    """REPORT.md's first lines say what ran and what was not proven; then the result, whose counts
    agree with the cases table (the pack's own check counted apart), every mark with a legend."""
    report = (bundle_dir / REPORT).read_text()
    lines = report.splitlines()
    result_at = next(i for i, line in enumerate(lines) if line.startswith("Result: "))
    top = "\n".join(lines[:result_at])
    assert lines[2] == "## Scope" and top.index("What ran:") < top.index("Not proven by this bundle:")
    assert "- CPU probes: " in top and "stand-ins" in top and "`RecordingKVSender`" in top
    assert "- Live tier (real prefill and decode servers): not run" in top
    assert "- Upstream's unit tests: " in top
    for caveat in ("possible exposure", "#38961", "both prefill and decode must run it", "GPU, over RDMA"):
        assert caveat in top, caveat
    cases = [
        line
        for line in lines
        if line.startswith("| ")
        and " / " in line.split("|")[1]
        and "---" not in line
        and not line.startswith("| probe / case")
    ]
    agree = [line.rstrip(" |").rsplit("| ", 1)[-1] for line in cases]
    compared = sum(1 for a in agree if a in ("yes", "**no**"))
    differs = agree.count("**no**")
    assert f"patched differs from the reference in {differs} of {compared} compared cases" in lines[result_at]
    assert set(agree) <= {"yes", "**no**", "own check"}
    assert "`own check` a case of one of this pack's own checks" in report and "`**no**` it differs" in report


def test_a_report_from_other_toolkit_code_names_both_codes_and_still_fails():
    from backport.evidence.environment import code_digests
    from backport.evidence.problem import Problem
    from backport.evidence.rendering import _other_renderer_named

    problem = Problem("REPORT.md", "inconsistent", "line 7 is 'a', the receipt renders 'b'")
    other = {"predicate": {"toolkit": {"code": {"backport_sha256": "ab" * 32}}}}
    same = {"predicate": {"toolkit": {"code": {"backport_sha256": code_digests()["backport_sha256"]}}}}
    [named] = _other_renderer_named(other, [problem])
    assert named.kind == "inconsistent" and "written by toolkit code abababababab" in named.detail
    assert _other_renderer_named(same, [problem]) == [problem]  # same code: a plain mismatch, no excuse
    assert _other_renderer_named(other, []) == []


def test_export_of_a_bundle_without_exports_is_refused_before_verifying(
    bundle_dir, tmp_path, monkeypatch, capsys
):
    """`export BUNDLE` of a bundle made without `run --export`: exit 2 at once (the real bundle's
    verification takes about a minute), one line naming the bundle, nothing created."""
    import time

    def no_work(*_a, **_k):
        raise AssertionError("the bundle was verified before its receipt was read for exports")

    monkeypatch.setattr(evidence, "verify", no_work)
    started = time.monotonic()
    code = cli.main(
        ["export", str(bundle_dir), "--wheel", str(tmp_path / "dist"), "--patches", str(tmp_path / "p")]
    )
    assert code == 2 and time.monotonic() - started < 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bundle_dir) in err and "without exports" in err
    assert not (tmp_path / "dist").exists() and not (tmp_path / "p").exists()


def test_the_last_line_says_what_the_result_covers_and_points_to_audit(tmp_path):
    """REPORT.md's last line and `run`'s: probes, live tier yes/no, upstream tests run/skipped, and
    `audit` for the deployment's own configuration, which no bundle judges."""
    from backport.cli.run import render_summary
    from backport.evidence.scope import covers_line

    bundle = fixture_run(tmp_path / "run")
    line = ("PASS covers: CPU probes (6 cases); live tier: no; upstream tests: run. A deployment's own "
            "configuration is not judged here: check it with `sglang-backport audit`.")
    assert bundle.files["REPORT.md"].decode().rstrip("\n").splitlines()[-1] == line
    assert render_summary(bundle, tmp_path / "bundle").splitlines()[-1] == line
    p = json.loads(bundle.files["receipt.json"])["predicate"]
    p["upstream_tests"] = {"skipped": "--no-upstream-tests", "files": [], "trees": []}
    assert "; upstream tests: skipped." in covers_line(p)
    p["live"], p["summary"]["result"] = {"scenarios": [{}, {}, {}]}, "fail"
    assert covers_line(p).startswith("FAIL covers: CPU probes (6 cases); live tier: yes (3 scenarios);")
