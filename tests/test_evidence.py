"""Evidence: pair verdicts, receipts, bundles and `verify`, on fixtures of the probe/apply JSON.

The fixtures have the shapes `probes.harness`, `ApplyReport.to_json()` and
`run_upstream_tests` print, with absolute temporary paths in them as a real run has, so
normalisation and determinism are tested on their own. One end-to-end test runs the real
`run sglang==0.5.19` (marked probe_env; needs SGLANG_BACKPORT_PROBE_PYTHON).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backport import cli, cli_run, evidence
from backport.evidence import TreeInput

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((REPO / "evidence" / "receipt.schema.json").read_text())

D = {n: f"{n:x}" * 64 for n in range(1, 10)}  # fake sha256 digests
C = {n: f"{n:x}" * 40 for n in range(1, 10)}  # fake commits


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


def probe_doc(root: Path, role_index: int, cases, *, import_seconds=8.5) -> dict:
    return {
        "tree": str(root),
        "version": "0.5.19" if role_index < 2 else "0.5.22",
        "sglang_file": str(root / "sglang" / "__init__.py"),
        "python": "3.11.7",
        "torch": "2.13.0+cpu",
        "import_seconds": import_seconds,
        "cases": [case(p, n, verdicts[role_index], mp,
                       traceback=f"File \"{root}/sglang/srt/disaggregation/prefill.py\", line 1",
                       link="/tmp/sglang-backport-probes-ab12_cd/probes/admission.py")
                  for p, n, mp, *verdicts in cases],
    }


def fixture_run(tmp: Path, *, cases=PASSING_CASES, started="2026-11-30T10:00:00+00:00",
                import_seconds=8.5, reference=True) -> evidence.Bundle:
    """A run's raw outputs as the real parts print them, with this run's temporary paths."""
    pristine = tmp / "cache" / "trees" / f"wheel-{D[1]}" / "tree"
    patched = tmp / "cache" / "work" / "sglang-0.5.19-x1y2z3"
    ref = tmp / "cache" / "trees" / f"wheel-{D[2]}" / "tree"
    series = tmp / "toolkit" / "patches"
    trees = {
        "pristine": TreeInput("pristine", "sglang==0.5.19", "0.5.19", D[3], C[1], D[1], False, pristine, pristine),
        "patched": TreeInput("patched", "sglang==0.5.19", "0.5.19", D[4], C[2], D[1], False, patched, patched),
    }
    roots = [pristine, patched]
    if reference:
        trees["reference"] = TreeInput("reference", "sglang==0.5.22", "0.5.22", D[5], C[3], D[2], False, ref, ref)
        roots.append(ref)
    probe_docs = {role: probe_doc(root, i, cases, import_seconds=import_seconds + i)
                  for i, (role, root) in enumerate(zip(trees, roots))}
    apply_report = {
        "schema": 1, "tree": str(patched), "version": "0.5.19", "package_prefix": "", "check": False,
        "base_commit": C[1], "head_commit": C[2], "status": "applied",
        "patches": [
            {"fix": "pr36988", "variant": "pr36988-0.5.19.patch", "variant_sha256": D[6], "status": "applied",
             "reason": "", "commit": C[4], "hunks": [{"file": "sglang/srt/disaggregation/prefill.py",
                                                      "status": "offset", "offset": 3, "fuzz": 0, "line": 700}]},
            {"fix": "pr38935", "variant": "pr38935-0.5.19.patch", "variant_sha256": D[7], "status": "applied",
             "reason": "", "commit": C[2], "hunks": [{"file": "sglang/srt/disaggregation/utils.py",
                                                      "status": "exact", "offset": 0, "fuzz": 0, "line": 10}]},
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
    patches = [{"fix": p["fix"], "variant": p["variant"], "path": f"{p['fix']}/{p['variant']}",
                "sha256": p["variant_sha256"], "status": p["status"]} for p in apply_report["patches"]]
    timestamps = {"started": started, "finished": started, "duration_seconds": 61.5,
                  "steps": [{"step": "probe-pristine", "seconds": 20.1}],
                  "paths": {"bundle": str(tmp / "bundle"), "patched_tree": str(patched)}}
    environment = {"python": "3.11.7", "implementation": "CPython", "platform": "Linux-x86_64", "machine": "x86_64",
                   "torch": "2.13.0+cpu", "packages": {"torch": "2.13.0+cpu", "transformers": "5.12.1"},
                   "toolkit_python": "3.11.7", "toolkit_packages": {"gitpython": "3.1.45"}}
    return evidence.assemble(
        mode="backport",
        target={"spec": "sglang==0.5.19", "kind": "wheel", "version": "0.5.19", "artifact_sha256": D[1],
                "commit": None, "unpinned": False, "head": None},
        trees=trees, probe_docs=probe_docs, apply_report=apply_report, patches=patches,
        series_files=[{"path": "fixes.toml", "sha256": D[9]}], upstream_tests=upstream,
        environment=environment, toolkit={"name": "sglang-backport", "version": "0.1.0", "git_commit": None,
                                          "git_dirty": None},
        timestamps=timestamps, reference_choice="default",
        extra_paths=[(series, ""), (tmp / "cache", "<cache>")])


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "run"))


def _files(bundle: Path) -> list[str]:
    return sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())


def _validate(statement: dict) -> None:
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(statement)


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
    for ok in ("fixed", "held", "added", "not-applicable"):
        assert not evidence.is_finding(ok, False)


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
    assert s["upstream_tests"] == {"patched": {"passed": 1}, "pristine": {"failed": 1}, "reference": {"passed": 1}}


@pytest.mark.parametrize("extra, finding", [
    (("handoff", "stale_pages_read", False, "unsafe", "unsafe", "safe"), "still-unsafe"),
    (("admission", "preempted_request_reenters", True, "safe", "unsafe", "safe"), "regressed"),
    (("handoff", "decode_release", False, "unsafe", "error", "safe"), "error"),
])
def test_failing_runs(tmp_path, extra, finding):
    bundle = fixture_run(tmp_path, cases=[*PASSING_CASES, extra])
    s = bundle.summary
    assert s["result"] == "fail"
    assert s["findings"] == [{"probe": extra[0], "case": extra[1], "pair": finding, "must_preserve": extra[2]}]
    _validate(bundle.statement)
    assert "**" + finding + "**" in bundle.files["REPORT.md"].decode()


def test_must_preserve_still_unsafe_is_not_a_finding(tmp_path):
    s = fixture_run(tmp_path, cases=[*PASSING_CASES,
                                     ("admission", "odd_valid", True, "unsafe", "unsafe", "unsafe")]).summary
    assert s["result"] == "pass" and s["pair_verdicts"]["still-unsafe"] == 1


# ---- the receipt ----------------------------------------------------------------------------------


def test_receipt_is_an_in_toto_statement_and_validates(bundle_dir):
    statement = json.loads((bundle_dir / "receipt.json").read_text())
    _validate(statement)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["predicateType"] == "https://sglang-backport.dev/receipt/v1"
    names = [s["name"] for s in statement["subject"]]
    assert names == sorted(set(_files(bundle_dir)) - {"receipt.json", "SHA256SUMS"})
    for subject in statement["subject"]:
        assert evidence.sha256_file(bundle_dir / subject["name"]) == subject["digest"]["sha256"]
    p = statement["predicate"]
    assert p["inputs"]["patches"][0] == {"fix": "pr36988", "variant": "pr36988-0.5.19.patch",
                                         "path": "pr36988/pr36988-0.5.19.patch", "sha256": D[6],
                                         "status": "applied"}
    assert p["inputs"]["trees"]["pristine"]["tree_digest"] == D[3]
    assert p["inputs"]["reference"]["spec"] == "sglang==0.5.22"
    assert p["inputs"]["reference"]["chosen"] == "default"


def test_probe_outputs_are_normalised(bundle_dir, tmp_path):
    p = json.loads((bundle_dir / "receipt.json").read_text())["predicate"]
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
    # No temporary path survives anywhere outside `timestamps`.
    for name in _files(bundle_dir):
        text = (bundle_dir / name).read_text()
        if name == "receipt.json":
            body = json.loads(text)
            body["predicate"].pop("timestamps")
            text = json.dumps(body)
        assert str(tmp_path) not in text, name


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
    a = evidence.write_bundle(tmp_path / "a", fixture_run(tmp_path / "r1", started="2026-01-01T00:00:00+00:00"))
    b = evidence.write_bundle(tmp_path / "b", fixture_run(tmp_path / "r2", started="2026-01-02T00:00:00+00:00"))
    assert _files(a) == _files(b)
    differing = [n for n in _files(a) if (a / n).read_bytes() != (b / n).read_bytes()]
    assert differing == ["SHA256SUMS", "receipt.json"]


# ---- the bundle -----------------------------------------------------------------------------------


def test_bundle_layout(bundle_dir):
    assert _files(bundle_dir) == ["REPORT.md", "SHA256SUMS", "apply-report.json", "probes/patched.json",
                                  "probes/pristine.json", "probes/reference.json", "receipt.json",
                                  "upstream-tests.json"]
    listed = [line.split("  ", 1)[1] for line in (bundle_dir / "SHA256SUMS").read_text().splitlines()]
    assert listed == sorted(set(_files(bundle_dir)) - {"SHA256SUMS"})


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
    assert "| admission / rejected_request_not_enqueued_prefill | unsafe | safe | safe | fixed | yes |" in report
    assert "| admission / valid_request_admitted * | safe | safe | safe | held | yes |" in report
    assert ("| page_lifetime / prefill_source_pages_held | not-applicable | not-applicable | unsafe "
            "| not-applicable | **no** |") in report
    assert ("| `test/registered/unit/disaggregation/test_admission_abort_not_enqueued.py::T::test_rejected` "
            "| failed | passed | passed |") in report


def test_write_bundle_replaces_only_bundles(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    with pytest.raises(evidence.BadInput):
        evidence.write_bundle(out, fixture_run(tmp_path / "r"))
    assert (out / "precious.txt").read_text() == "mine"
    bundle = tmp_path / "bundle"
    evidence.write_bundle(bundle, fixture_run(tmp_path / "r", started="2026-01-01T00:00:00+00:00"))
    (bundle / "stale.txt").write_text("left over")
    evidence.write_bundle(bundle, fixture_run(tmp_path / "r", started="2026-01-02T00:00:00+00:00"))
    assert not (bundle / "stale.txt").exists()
    assert evidence.verify(bundle).ok
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


# ---- verify ---------------------------------------------------------------------------------------


def test_verify_passes(bundle_dir):
    result = evidence.verify(bundle_dir)
    assert result.ok, result.problems
    assert len(result.files) == 7 and result.summary["result"] == "pass"


def _positions(size: int) -> list[int]:
    return sorted({0, 1, size // 3, size // 2, (2 * size) // 3, size - 2, size - 1} - {-1})


def test_any_single_byte_change_is_named(bundle_dir, tmp_path):
    """Every file, several positions each (start, middle, end): verify names exactly that file."""
    checked = 0
    for name in _files(bundle_dir):
        original = (bundle_dir / name).read_bytes()
        for pos in _positions(len(original)):
            for replacement in {original[pos] ^ 0x01, ord("x") if original[pos] != ord("x") else ord("y")}:
                copy_dir = tmp_path / f"c{checked}"
                shutil.copytree(bundle_dir, copy_dir)
                changed = bytearray(original)
                changed[pos] = replacement
                (copy_dir / name).write_bytes(bytes(changed))
                result = evidence.verify(copy_dir)
                assert not result.ok, (name, pos)
                assert result.first.file == name, (name, pos, result.first)
                assert result.first.kind == "modified", (name, pos, result.first)
                shutil.rmtree(copy_dir)
                checked += 1
    assert checked > 50


def test_every_byte_of_sha256sums(bundle_dir, tmp_path):
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


def test_renamed_file_is_named(bundle_dir):
    (bundle_dir / "REPORT.md").rename(bundle_dir / "REPORT.txt")
    result = evidence.verify(bundle_dir)
    assert [(p.file, p.kind) for p in result.problems] == [("REPORT.md", "missing"), ("REPORT.txt", "unexpected")]


def _rewrite(bundle: Path, edit) -> None:
    """Edit the receipt and re-seal SHA256SUMS, as someone hiding a change would."""
    statement = json.loads((bundle / "receipt.json").read_text())
    edit(statement)
    (bundle / "receipt.json").write_bytes(evidence.canonical_json(statement))
    digests = {n: evidence.sha256_file(bundle / n) for n in _files(bundle) if n != "SHA256SUMS"}
    (bundle / "SHA256SUMS").write_text(evidence.sums_text(digests))


def test_resealed_file_is_caught_by_the_receipt(bundle_dir):
    (bundle_dir / "probes" / "patched.json").write_text("{}\n")
    digests = {n: evidence.sha256_file(bundle_dir / n) for n in _files(bundle_dir) if n != "SHA256SUMS"}
    (bundle_dir / "SHA256SUMS").write_text(evidence.sums_text(digests))
    result = evidence.verify(bundle_dir)
    assert (result.first.file, result.first.kind) == ("probes/patched.json", "modified")


def test_summary_must_agree_with_cases(bundle_dir):
    _rewrite(bundle_dir, lambda s: s["predicate"]["summary"]["pair_verdicts"].update(fixed=3))
    result = evidence.verify(bundle_dir)
    assert result.first.file == "receipt.json" and result.first.kind == "inconsistent"
    assert "summary.pair_verdicts" in result.first.detail


def test_pair_verdicts_must_follow_from_tree_verdicts(bundle_dir):
    def edit(s):
        s["predicate"]["cases"][0]["pair"] = "held"
        s["predicate"]["summary"]["pair_verdicts"].update(fixed=1, held=3)

    _rewrite(bundle_dir, edit)
    result = evidence.verify(bundle_dir)
    assert result.first.file == "receipt.json" and "pair verdict 'held' does not follow" in result.first.detail


def test_receipt_must_match_embedded_files(bundle_dir):
    def edit(s):
        s["predicate"]["probes"]["patched"]["cases"][0]["observed"] = "something else"

    _rewrite(bundle_dir, edit)
    result = evidence.verify(bundle_dir)
    assert (result.first.file, result.first.kind) == ("probes/patched.json", "inconsistent")


def test_verify_cli(bundle_dir, capsys):
    assert cli.main(["verify", str(bundle_dir), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True and document["first"] is None
    (bundle_dir / "REPORT.md").write_text("tampered\n")
    assert cli.main(["verify", str(bundle_dir)]) == 1
    assert capsys.readouterr().out.startswith("FAIL REPORT.md: modified")
    assert cli.main(["verify", str(bundle_dir / "nope")]) == 2


def test_schema_rejects_broken_receipts(bundle_dir):
    import jsonschema

    statement = json.loads((bundle_dir / "receipt.json").read_text())
    _validate(statement)
    for breaking in (lambda s: s.pop("subject"),
                     lambda s: s["predicate"]["cases"][0].update(pair="fine"),
                     lambda s: s["predicate"]["probes"]["patched"].update(import_seconds=1.0),
                     lambda s: s["predicate"].pop("timestamps"),
                     lambda s: s["subject"][0]["digest"].update(sha256="abc")):
        broken = copy.deepcopy(statement)
        breaking(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.Draft202012Validator(SCHEMA).validate(broken)


# ---- run's own inputs -----------------------------------------------------------------------------


def test_default_reference_is_newest_pinned_release_with_every_fix():
    from backport.series import load_pack

    pack = load_pack(REPO / "patches")
    spec = cli_run.default_reference(pack)
    version = spec.removeprefix("sglang==")
    assert all(fix.is_fixed_in(version) for fix in pack.fixes.values())
    from backport.sources import load_pins

    newer = [v for v in load_pins() if v > version and all(f.is_fixed_in(v) for f in pack.fixes.values())]
    assert newer == []


def test_pairs_toml_lists_releases_and_upstream_pairs():
    import tomllib

    pairs = tomllib.loads((REPO / "patches" / "pairs.toml").read_text())["pair"]
    names = [p["name"] for p in pairs]
    assert names[:4] == ["0.5.17", "0.5.18", "0.5.19", "0.5.20"]
    for p in pairs[:4]:
        assert p["base"] == f"sglang=={p['name']}" and p["head"] == "backport"
    upstream = {p["name"]: p for p in pairs if p["head"] != "backport"}
    assert upstream["pr38935"]["base"].endswith("@17ba2c2e7c7b81f31a8a9e693e7435ab262c16b4")
    assert upstream["pr38935"]["head"].endswith("@8f3d6944b76c428d884582cb6c82a39db1465360")
    assert upstream["pr36988"]["base"].endswith("@9c254df8cdbe99ef5f58e7fcd932da052f258538")
    assert upstream["pr36988"]["head"].endswith("@2ee5742af92db2727236460473554c2ee8c4ddaa")


def test_nox_lists_one_pair_session_per_pair():
    if shutil.which("nox") is None and not (Path(sys.executable).parent / "nox").exists():
        pytest.skip("nox is not installed")
    nox = shutil.which("nox") or str(Path(sys.executable).parent / "nox")
    proc = subprocess.run([nox, "-l", "-f", str(REPO / "noxfile.py")], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    for name in ("tests", "lint", "bench", "pair(name='0.5.17')", "pair(name='0.5.19')", "pair(name='0.5.20')",
                 "pair(name='pr38935')", "pair(name='pr36988')"):
        assert name in proc.stdout, (name, proc.stdout)


# ---- `run` on the real 0.5.19 tree, probes stubbed ------------------------------------------------


@pytest.fixture
def stub_probes(monkeypatch):
    """Stand in for the probe subprocess (the real one takes ~20 s per tree): fixture verdicts per role."""
    import backport.probeenv
    import backport.probing

    calls = []

    def fake_harness(python, package_root, probes=None, label=None):
        role = label.split(" ")[0]
        calls.append((role, Path(package_root)))
        return probe_doc(Path(package_root), ("pristine", "patched", "reference").index(role), PASSING_CASES)

    monkeypatch.setattr(backport.probing, "run_harness", fake_harness)
    monkeypatch.setattr(backport.probeenv, "ensure_env", lambda python=None, **_: Path(sys.executable))
    return calls


@pytest.fixture
def real_cache(shared_cache, monkeypatch):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    return shared_cache


def test_run_writes_a_bundle_that_verifies(real_cache, stub_probes, tmp_path, capsys):
    out = tmp_path / "bundle"
    code = cli.main(["run", "sglang==0.5.19", "--out", str(out), "--no-upstream-tests", "--json"])
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # exactly one JSON document on stdout
    assert code == 0 and document["result"] == "pass" and document["bundle"] == str(out.absolute())
    assert "[1/" in captured.err and "probing the patched tree" in captured.err
    assert evidence.verify(out).ok
    p = json.loads((out / "receipt.json").read_text())["predicate"]
    _validate(json.loads((out / "receipt.json").read_text()))
    assert [role for role, _ in stub_probes] == ["pristine", "patched", "reference"]
    assert p["inputs"]["reference"]["spec"] == cli_run.default_reference(__import__("backport.series").series
                                                                         .load_pack(REPO / "patches"))
    trees = p["inputs"]["trees"]
    assert trees["pristine"]["tree_digest"] != trees["patched"]["tree_digest"]
    assert trees["patched"]["commit"] == p["apply"]["head_commit"]
    assert p["apply"]["status"] == "applied" and p["apply"]["tree"] == "patched"
    for patch in p["inputs"]["patches"]:
        assert patch["sha256"] == evidence.sha256_file(REPO / "patches" / patch["path"])
    assert not Path(p["timestamps"]["paths"]["patched"]).exists()  # the work clone is removed
    assert p["upstream_tests"]["skipped"] == "disabled with --no-upstream-tests"


def test_run_records_upstream_tests(real_cache, stub_probes, tmp_path, monkeypatch, capsys):
    import backport.upstream_tests

    seen = {}

    def fake_tests(trees, refs, *, python, base_url=None, **_):
        seen.update(trees=[label for label, _ in trees], refs=refs, base_url=base_url)
        return {"skipped": None, "files": [], "trees": [
            {"tree": label, "tests": [{"file": refs[0].path, "rev": refs[0].rev, "sha256": D[8],
                                       "nodeid": refs[0].path + "::test_x",
                                       "outcome": "failed" if label == "pristine" else "passed",
                                       "reason": f"in {root}" if label == "pristine" else None}]}
            for label, root in trees]}

    monkeypatch.setattr(backport.upstream_tests, "run_upstream_tests", fake_tests)
    out = tmp_path / "bundle"
    assert cli.main(["run", "sglang==0.5.19", "--out", str(out), "--upstream-base-url", "http://mirror.invalid",
                     "--reference", "none"]) == 0
    assert seen["trees"] == ["pristine", "patched"] and seen["base_url"] == "http://mirror.invalid"
    upstream = json.loads((out / "upstream-tests.json").read_text())
    assert upstream["trees"][0]["tests"][0]["reason"] == "in pristine"
    assert "| failed | passed |" in (out / "REPORT.md").read_text()
    assert json.loads((out / "receipt.json").read_text())["predicate"]["inputs"]["reference"] is None
    assert evidence.verify(out).ok
    assert "PASS" in capsys.readouterr().out


def test_run_when_the_series_does_not_apply(real_cache, stub_probes, tmp_path, capsys):
    series = tmp_path / "patches"
    shutil.copytree(REPO / "patches", series)
    patch = series / "pr36988" / "pr36988-0.5.19.patch"
    text = patch.read_text()
    patch.write_text(text.replace("\n         logprob_pt = 0\n", "\n         logprob_pt = 12345\n", 1))
    out = tmp_path / "bundle"
    code = cli.main(["run", "sglang==0.5.19", "--series", str(series), "--out", str(out), "--no-upstream-tests"])
    assert code == 1
    assert "does not apply" in capsys.readouterr().err
    assert not out.exists() and stub_probes == []


def test_run_head_mode_probes_two_given_trees(real_cache, release_tree, stub_probes, tmp_path, capsys):
    """`run BASE --head HEAD` (upstream's own before/after pairs): nothing applied, both trees probed."""
    base, head = release_tree("0.5.19"), release_tree("0.5.22")
    out = tmp_path / "pair"
    code = cli.main(["run", str(base.path), "--head", str(head.path), "--reference", "none", "--out", str(out),
                     "--no-upstream-tests", "--json"])
    assert code == 0, capsys.readouterr().err
    statement = json.loads((out / "receipt.json").read_text())
    _validate(statement)
    p = statement["predicate"]
    assert p["mode"] == "upstream-pair" and p["apply"] is None and p["inputs"]["patches"] == []
    assert p["inputs"]["trees"]["patched"]["version"] == "0.5.22"
    assert p["inputs"]["trees"]["pristine"]["tree_digest"] == base.tree_digest
    assert [role for role, _ in stub_probes] == ["pristine", "patched"]
    assert not (out / "apply-report.json").exists()
    assert evidence.verify(out).ok


@pytest.mark.parametrize("argv, message", [
    (["run", "sglang==9.9.9"], "not pinned"),
    (["run", "sglang==0.5.19", "--series", "/nonexistent/series"], "no such patch series"),
])
def test_run_bad_input(argv, message, real_cache, stub_probes, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_run_refuses_to_overwrite_a_directory_that_is_not_a_bundle(real_cache, stub_probes, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["run", "sglang==0.5.19", "--out", str(tmp_path), "--no-upstream-tests"]) == 2
    assert "not an evidence bundle" in capsys.readouterr().err
    assert stub_probes == [] and (tmp_path / "notes.txt").read_text() == "mine"


# ---- end to end -----------------------------------------------------------------------------------


@pytest.mark.probe_env
def test_run_sglang_0_5_19_end_to_end(real_cache, probe_python, tmp_path, capsys):
    """The README's first command, for real: exit 0, a bundle that verifies, sha256sum -c passes,
    and a second run gives files that differ only in the receipt's timestamps."""
    python = probe_python
    out = tmp_path / "bundle"
    code = cli.main(["run", "sglang==0.5.19", "--out", str(out), "--python", python, "--no-upstream-tests",
                     "--json"])
    document = json.loads(capsys.readouterr().out)
    assert document["bundle"] == str(out.absolute())
    statement = json.loads((out / "receipt.json").read_text())
    _validate(statement)
    assert evidence.verify(out).ok
    proc = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, check=False)
    assert proc.returncode == 0
    p = statement["predicate"]
    assert p["inputs"]["target"]["artifact_sha256"] == \
        "425e87377e725d03db8262382008f3fd9561a6cf5d82f485f8b9929f02ffe12b"
    assert p["apply"]["status"] == "applied"
    assert {"pristine", "patched", "reference"} <= set(p["probes"])
    assert code == (0 if p["summary"]["result"] == "pass" else 1)
    assert code == 0, p["summary"]["findings"]
    again = tmp_path / "again"
    assert cli.main(["run", "sglang==0.5.19", "--out", str(again), "--python", python, "--no-upstream-tests",
                     "--json"]) == 0
    capsys.readouterr()
    for name in ("apply-report.json", "probes/pristine.json", "probes/patched.json", "probes/reference.json",
                 "REPORT.md", "upstream-tests.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
    second = json.loads((again / "receipt.json").read_text())
    statement["predicate"].pop("timestamps"), second["predicate"].pop("timestamps")
    assert statement == second
