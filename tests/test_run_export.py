"""`run --export`: the patched wheel and the patch series in the bundle, as the receipt's subjects.

The probe matrix is stubbed here (fixture verdicts, as in test_job.py); the wheel, the series and
the bundle are real. The whole path with real probes, from the installed toolkit, is in
test_shipping.py.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from backport import cli, evidence
from backport.evidence.artifacts import TREE_SUBJECT, read_wheel, tree_digest
from tests.conftest import WORKSPACE_CACHE
from tests.test_evidence import _receipt, _reseal, _validate
from tests.test_job import PASSING_CASES, probe_doc, real_cache  # noqa: F401 - real_cache: a fixture
from tests.test_sign import keys  # noqa: F401 - fixture

pytestmark = pytest.mark.network  # the real 0.5.19 wheel (cached after the first run)


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory):
    """One `run sglang==0.5.19 --export` (stub probes), copied afresh for each test that edits it."""
    mp = pytest.MonkeyPatch()
    job_run = importlib.import_module("backport.job.run")  # the package re-exports `run`, the function
    mp.setenv("SGLANG_BACKPORT_CACHE", str(WORKSPACE_CACHE))
    mp.setattr(
        job_run,
        "run_matrix",
        lambda python, roots, probes=None, *, jobs=None, labels=None, coverage=None, **_: [
            probe_doc(
                Path(root), ("pristine", "patched", "reference").index(label.split(" ")[0]), PASSING_CASES
            )
            for root, label in zip(roots, labels, strict=True)
        ],
    )
    mp.setattr(job_run, "ensure_env", lambda python=None, **_: Path(sys.executable))
    out = tmp_path_factory.mktemp("export") / "bundle"
    try:
        code = cli.main(
            ["run", "sglang==0.5.19", "--out", str(out), "--no-upstream-tests", "--export", "--json"]
        )
    finally:
        mp.undo()
    assert code == 0
    return out


@pytest.fixture
def bundle(exported_run, tmp_path) -> Path:
    return Path(shutil.copytree(exported_run, tmp_path / "bundle"))


def test_the_subjects_are_the_patched_tree_the_wheel_and_the_series(bundle):
    statement = _receipt(bundle)
    _validate(statement)
    p = statement["predicate"]
    export = p["export"]
    wheel = export["wheel"]
    assert wheel["file"] == f"export/{wheel['name']}" and (bundle / wheel["file"]).is_file()
    assert (
        wheel["name"].startswith(f"sglang-0.5.19+{export['label']}-")
        and wheel["version"] == f"0.5.19+{export['label']}"
    )
    applied = [x for x in p["inputs"]["patches"] if x["status"] == "applied"]
    assert len(export["patches"]) == len(applied) > 0
    subjects = {s["name"]: tree_digest(s) for s in statement["subject"]}  # a tree by dirHash1, files sha256
    assert subjects == {TREE_SUBJECT: p["inputs"]["trees"]["patched"]["tree_digest"],
                        wheel["file"]: evidence.sha256_file(bundle / wheel["file"]),
                        **{x["file"]: evidence.sha256_file(bundle / x["file"]) for x in export["patches"]}}
    # the wheel installs exactly the patched tree the probes judged
    assert (
        read_wheel((bundle / wheel["file"]).read_bytes())[0] == p["inputs"]["trees"]["patched"]["tree_digest"]
    )
    assert "Backport-Of:" in (bundle / export["patches"][0]["file"]).read_text()
    assert "## Subjects" in (bundle / "REPORT.md").read_text()
    assert evidence.verify(bundle).ok


def test_an_edited_byte_of_the_wheel_is_named(bundle):
    wheel = _receipt(bundle)["predicate"]["export"]["wheel"]["file"]
    data = bytearray((bundle / wheel).read_bytes())
    data[len(data) // 2] ^= 1
    (bundle / wheel).write_bytes(bytes(data))
    result = evidence.verify(bundle)
    assert not result.ok and result.first.file == wheel


def test_a_wheel_swapped_and_resealed_everywhere_is_named_by_its_content(bundle, tmp_path):
    """A forger swaps in another wheel and updates every digest (SHA256SUMS, predicate.files, the
    subject, export.wheel.sha256): the wheel's own sglang/ is not the patched tree the receipt names."""
    statement = _receipt(bundle)
    wheel = statement["predicate"]["export"]["wheel"]["file"]
    path = bundle / wheel
    rebuilt = tmp_path / "other.whl"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(rebuilt, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == "sglang/srt/disaggregation/utils.py":
                data += b"\n# not the reviewed tree\n"
            target.writestr(info, data)
    shutil.move(rebuilt, path)
    digest = evidence.sha256_file(path)
    statement["predicate"]["files"][wheel] = digest
    statement["predicate"]["export"]["wheel"]["sha256"] = digest
    for s in statement["subject"]:
        if s["name"] == wheel:
            s["digest"]["sha256"] = digest
    _reseal(bundle, statement)
    result = evidence.verify(bundle)
    assert [(p.file, p.kind) for p in result.problems][:1] == [(wheel, "modified")]
    assert "tree digest" in result.first.detail


def test_signed_bundle_with_its_wheel_then_an_edited_wheel_fails(bundle, keys, capsys):  # noqa: F811
    private, public, _ = keys
    assert cli.main(["sign", str(bundle), "--key", str(private)]) == 0
    assert cli.main(["verify", str(bundle), "--key", str(public)]) == 0
    wheel = _receipt(bundle)["predicate"]["export"]["wheel"]["file"]
    data = bytearray((bundle / wheel).read_bytes())
    data[-100] ^= 0x40
    (bundle / wheel).write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(bundle), "--key", str(public)]) == 1
    assert wheel in capsys.readouterr().out


def test_export_needs_a_wheel_target(real_cache, release_tree, tmp_path, capsys):  # noqa: F811
    tree = release_tree("0.5.19").path  # a local path: there is no upstream wheel to rebuild
    code = cli.main(["run", str(tree), "--export", "--no-upstream-tests", "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 2 and "--export" in json.dumps(document) and "path target" in json.dumps(document)
    code = cli.main(["run", "sglang==0.5.19", "--head", "sglang==0.5.20", "--export", "--no-upstream-tests"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--export" in err and "--head" in err and len(err.splitlines()) == 1


def test_export_of_a_bundle_copies_its_verified_files(bundle, tmp_path, capsys):
    export = _receipt(bundle)["predicate"]["export"]
    assert cli.main(["export", str(bundle), "--wheel", str(tmp_path / "dist"), "--patches",
                     str(tmp_path / "series"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert evidence.sha256_file(Path(document["wheel"]["path"])) == export["wheel"]["sha256"]
    assert sorted(Path(p).name for p in document["patches"]) == sorted(
        Path(p["file"]).name for p in export["patches"]
    )
    # a bundle that does not verify gives nothing; one made without --export has nothing to give
    (bundle / "REPORT.md").write_text("edited\n")
    assert cli.main(["export", str(bundle), "--wheel", str(tmp_path / "dist2")]) == 1
    assert not (tmp_path / "dist2").exists()
    from tests.test_evidence import fixture_run
    plain = evidence.write_bundle(tmp_path / "plain", fixture_run(tmp_path / "run"))
    capsys.readouterr()
    assert cli.main(["export", str(plain), "--wheel", str(tmp_path / "dist3")]) == 2
    assert "without exports" in capsys.readouterr().err
