"""Bundle formats 3 and 4: format 4's receipt points at the files, format 3 bundles keep verifying.

tests/fixtures/bundle-format-3/ is a bundle the toolkit wrote before format 4 (commit df71640,
tests.test_evidence.fixture_run, written as is): its receipt copies the probe, apply and
upstream-test documents.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from backport import cli, evidence
from backport.evidence import formats, sign
from backport.evidence.table import attached_from
from backport.evidence.verify import verify_signed
from tests.test_evidence import _files, _reseal, fixture_run
from tests.test_sign import keys  # noqa: F401 - fixture

FORMAT_3 = Path(__file__).resolve().parent / "fixtures" / "bundle-format-3"


@pytest.fixture
def v3(tmp_path) -> Path:
    return Path(shutil.copytree(FORMAT_3, tmp_path / "v3"))


def test_a_format_3_bundle_verifies(v3, capsys):
    assert formats.format_of(v3)[0] == 3 and 3 in formats.readable() and formats.current() == 4
    result = evidence.verify(v3)
    assert result.ok, result.problems
    assert result.summary["result"] == "pass" and result.summary["cases"] == 6
    assert cli.main(["verify", str(v3)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {v3}")


def test_a_format_3_bundle_edited_is_named(v3):
    """Format 3's own check stays: a file whose copy in the receipt disagrees is named (the file and its
    digest in predicate.files both rewritten)."""
    path = v3 / "probes" / "patched.json"
    document = json.loads(path.read_text())
    document["cases"][0]["verdict"] = "unsafe"
    path.write_bytes(evidence.canonical_json(document))
    statement = json.loads((v3 / "receipt.json").read_text())
    statement["predicate"]["files"]["probes/patched.json"] = evidence.sha256_file(path)
    _reseal(v3, statement)
    result = evidence.verify(v3)
    assert [(p.file, p.kind) for p in result.problems][:1] == [("probes/patched.json", "inconsistent")]


def test_a_format_3_receipt_takes_no_format_4_subject(v3):
    statement = json.loads((v3 / "receipt.json").read_text())
    digest = statement["subject"][0]["digest"]
    statement["subject"][0]["digest"] = {"dirHash1": digest["sha256"]}
    _reseal(v3, statement)
    result = evidence.verify(v3)
    assert result.first.file == "receipt.json" and "receipt schema" in result.first.detail


def test_merge_reads_both_formats(v3, tmp_path, capsys):
    v4 = evidence.write_bundle(tmp_path / "v4", fixture_run(tmp_path / "run"))
    from backport.evidence.merge import _row

    rows = [_row(v3), _row(v4)]
    for key in ("result", "fixes", "upstream_tests", "cases"):
        assert rows[0][key] == rows[1][key], key


def test_format_4_copies_no_file_and_attaching_gives_format_3s_shape(v3, tmp_path):
    v4 = evidence.write_bundle(tmp_path / "v4", fixture_run(tmp_path / "run"))
    old = json.loads((v3 / "receipt.json").read_text())["predicate"]
    new = json.loads((v4 / "receipt.json").read_text())["predicate"]
    assert not {"probes", "apply", "upstream_tests"} & set(new)
    assert (v4 / "receipt.json").stat().st_size * 2 < (v3 / "receipt.json").stat().st_size
    held = attached_from(v4, json.loads((v4 / "receipt.json").read_text()))["predicate"]
    for key in ("probes", "apply", "upstream_tests", "cases", "summary", "reference_differences"):
        assert held[key] == old[key], key


def _reseal_signed(bundle: Path) -> None:
    """SHA256SUMS over the files it lists in a signed bundle (the envelopes are not listed)."""
    from backport.evidence.integrity import bundle_files, digests

    names = digests(bundle_files(bundle))
    names.pop("SHA256SUMS", None)
    (bundle / "SHA256SUMS").write_text(evidence.sums_text(names))


def test_a_value_only_a_file_holds_is_pinned_by_its_digest_and_the_signature(tmp_path, keys):  # noqa: F811
    """A probe case's `observed` text is in its file only. Edited with SHA256SUMS resealed, the
    receipt's digest names the file; edited with the receipt's predicate.files rewritten too (a
    new receipt), the signature over the receipt names it."""
    private, _public, _ = keys
    bundle = evidence.write_bundle(tmp_path / "b", fixture_run(tmp_path / "run"))
    sign.sign_bundle(bundle, private)
    path = bundle / "probes" / "patched.json"
    document = json.loads(path.read_text())
    document["cases"][0]["observed"] = "all is well"
    path.write_bytes(evidence.canonical_json(document))
    _reseal_signed(bundle)
    result = evidence.verify(bundle)
    assert (result.first.file, result.first.kind) == ("probes/patched.json", "modified")
    statement = json.loads((bundle / "receipt.json").read_text())
    statement["predicate"]["files"]["probes/patched.json"] = evidence.sha256_file(path)
    (bundle / "receipt.json").write_bytes(evidence.canonical_json(statement))
    _reseal_signed(bundle)
    assert evidence.verify(bundle).ok  # a consistent new receipt: only its signature can tell
    result, _state = verify_signed(bundle)
    assert not result.ok and result.first.file == "receipt.dsse.json", result.problems


def test_sha256sum_and_the_receipt_list_the_same_files(tmp_path):
    bundle = evidence.write_bundle(tmp_path / "b", fixture_run(tmp_path / "run"))
    listed = json.loads((bundle / "receipt.json").read_text())["predicate"]["files"]
    assert sorted(listed) == sorted(set(_files(bundle)) - {"receipt.json", "SHA256SUMS"})
    if shutil.which("sha256sum"):
        proc = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=bundle, capture_output=True,
                              check=False)
        assert proc.returncode == 0
