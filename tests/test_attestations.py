"""Standard attestations: `sign` writes `<wheel>.intoto.jsonl` (SLSA provenance, a test result per
probed tree, the OpenVEX document) and `receipt.intoto.jsonl`, one DSSE envelope a line;
`verify --key` checks every envelope and every subject digest (tree subjects by dirHash1). The
bundle is test_run_export.py's real `run sglang==0.5.19 --export` (real wheel, stub probes).
Also: the tree digest is in-toto's dirHash1, computed by the shell pipeline on a real tree."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from backport import cli, evidence
from backport.evidence import attestations as att
from backport.evidence.artifacts import read_wheel
from backport.tree import tree_digest
from tests.test_evidence import _receipt
from tests.test_run_export import exported_run  # noqa: F401 - fixture
from tests.test_sign import keys  # noqa: F401 - fixture


@pytest.fixture
def bundle(exported_run, tmp_path) -> Path:  # noqa: F811
    return Path(shutil.copytree(exported_run, tmp_path / "bundle"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _payload(envelope: dict) -> dict:
    return json.loads(base64.b64decode(envelope["payload"]))


@pytest.mark.network
def test_the_export_bundle_says_fixed_for_the_exact_wheel(bundle):
    receipt = _receipt(bundle)
    wheel = receipt["predicate"]["export"]["wheel"]
    document = json.loads((bundle / "vex.openvex.json").read_text())
    purl = "pkg:pypi/sglang@" + wheel["version"].replace("+", "%2B")
    assert purl.startswith("pkg:pypi/sglang@0.5.19%2Bbackport.")
    fixed = [s for s in document["statements"] if s["status"] == "fixed"]
    assert fixed, document["statements"]
    for statement in fixed:
        product = statement["products"][0]
        assert product == {"@id": purl, "identifiers": {"purl": purl}, "hashes": {"sha-256": wheel["sha256"]}}
        assert wheel["sha256"] == evidence.sha256_file(bundle / wheel["file"])
    bom = json.loads((bundle / "sbom.cdx.json").read_text())
    assert bom["metadata"]["component"]["purl"] == purl
    assert evidence.verify(bundle).ok


@pytest.mark.network
def test_sign_writes_the_attestations_and_verify_key_checks_them(bundle, keys, capsys):  # noqa: F811
    private, public, other_public = keys
    assert cli.main(["sign", str(bundle), "--key", str(private)]) == 0
    receipt = _receipt(bundle)
    wheel = receipt["predicate"]["export"]["wheel"]
    lines = _lines(bundle / f"{wheel['file']}.intoto.jsonl")
    statements = [_payload(e) for e in lines]
    assert [s["predicateType"] for s in statements] == [att.SLSA_PROVENANCE] + [att.TEST_RESULT] * 3 + [
        att.OPENVEX
    ]
    slsa = statements[0]
    assert slsa["subject"] == [{"name": wheel["name"], "digest": {"sha256": wheel["sha256"]}}]
    deps = slsa["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert (
        deps[0]["digest"]["sha256"] == receipt["predicate"]["inputs"]["trees"]["pristine"]["artifact_sha256"]
    )
    applied = [p for p in receipt["predicate"]["inputs"]["patches"] if p["status"] == "applied"]
    assert [d["digest"]["sha256"] for d in deps[1:]] == [p["sha256"] for p in applied]
    assert (
        slsa["predicate"]["runDetails"]["builder"]["version"]["sglang-backport"]
        == receipt["predicate"]["toolkit"]["version"]
    )
    trees = receipt["predicate"]["inputs"]["trees"]
    for statement, role in zip(statements[1:4], ("pristine", "patched", "reference")):
        subject = statement["subject"][0]
        assert (
            subject["name"] == f"{role}-tree/sglang"
            and subject["digest"]["dirHash1"] == trees[role]["tree_digest"]
        )
        assert len(subject["digest"]["gitTree"]) == 40
        assert statement["predicate"]["configuration"][0]["name"] == f"probes/{role}.json"
    assert statements[1]["predicate"]["result"] == "FAILED"  # the pristine tree is unsafe on the fixed cases
    assert (
        statements[2]["predicate"]["result"] in ("PASSED", "WARNED")
        and not statements[2]["predicate"]["failedTests"]
    )
    assert statements[4]["predicate"] == json.loads((bundle / "vex.openvex.json").read_text())
    # the patched tree subject is the tree the wheel installs
    assert (
        read_wheel((bundle / wheel["file"]).read_bytes())[0]
        == statements[2]["subject"][0]["digest"]["dirHash1"]
    )
    receipt_lines = _lines(bundle / "receipt.intoto.jsonl")
    assert (
        len(receipt_lines) == 1
        and base64.b64decode(receipt_lines[0]["payload"]) == (bundle / "receipt.json").read_bytes()
    )
    for statement in statements:
        assert att.model_problems(statement) == []
    capsys.readouterr()
    assert cli.main(["verify", str(bundle), "--key", str(public)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("signature verified")
    assert cli.main(["verify", str(bundle), "--key", str(other_public), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first"]
    assert "no signature verifies" in first["detail"]


@pytest.mark.network
@pytest.mark.parametrize("damage", ["drop-line", "swap-lines", "edit-payload", "missing"])
def test_a_damaged_attestation_file_is_named(bundle, keys, damage, capsys):  # noqa: F811
    private, public, _ = keys
    assert cli.main(["sign", str(bundle), "--key", str(private)]) == 0
    name = f"{_receipt(bundle)['predicate']['export']['wheel']['file']}.intoto.jsonl"
    path = bundle / name
    lines = path.read_text().splitlines(keepends=True)
    if damage == "drop-line":
        path.write_text("".join(lines[:-1]))
    elif damage == "swap-lines":
        path.write_text("".join([lines[1], lines[0], *lines[2:]]))
    elif damage == "edit-payload":
        envelope = json.loads(lines[0])
        statement = _payload(envelope)
        statement["subject"][0]["digest"]["sha256"] = "0" * 64
        envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
        path.write_text(
            json.dumps(envelope, sort_keys=True, separators=(",", ":")) + "\n" + "".join(lines[1:])
        )
    else:
        path.unlink()
    capsys.readouterr()
    assert cli.main(["verify", str(bundle), "--key", str(public), "--json"]) == 1
    first = json.loads(capsys.readouterr().out)["first"]
    assert first["file"] == name, first


@pytest.mark.network
def test_a_subject_digest_that_matches_no_file_is_named(bundle):
    receipt = _receipt(bundle)
    statement = att.provenance(receipt)
    assert att.subject_problems(bundle, statement) == []
    statement["subject"][0]["digest"]["sha256"] = "1" * 64
    assert "is not the file's" in att.subject_problems(bundle, statement)[0]
    tree = {"subject": [{"name": "patched-tree/sglang", "digest": {"dirHash1": "2" * 64}}]}
    assert "tree digest" in att.subject_problems(bundle, tree)[0]


def _dir_hash1(root: Path) -> str:
    """in-toto's dirHash1, by its shell definition; the NUL-separated form, because real SGLang
    trees have file names with spaces (`block_shape=[128, 128].json`) that split the plain
    `xargs sha256sum` of the definition."""
    script = "find . -type f -print0 | cut -z -c3- | LC_ALL=C sort -z | xargs -0 -r sha256sum | sha256sum"
    return subprocess.run(["bash", "-c", script], cwd=root, check=True, capture_output=True,
                          text=True).stdout.split()[0]


def test_the_tree_digest_is_dirhash1(tmp_path):
    root = tmp_path / "tree"
    for name, data in [
        ("sglang/__init__.py", "x"),
        ("sglang/srt/a b [1, 2].json", "{}"),
        ("sglang/srt/disaggregation/decode.py", "y\n"),
        ("sglang/Z.py", ""),
        ("sglang/_a.py", "z"),
    ]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(data)
    assert tree_digest(root) == _dir_hash1(root)
    plain = "find . -type f | cut -c3- | LC_ALL=C sort | xargs -r sha256sum | sha256sum"
    (root / "sglang/srt/a b [1, 2].json").unlink()
    literal = subprocess.run(
        ["bash", "-c", plain], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    assert tree_digest(root) == literal.split()[0]  # without spaces the definition's own pipeline agrees
    # our rules: __pycache__ and .pyc are not source (dirHash1 would count them), a symlink is
    # counted by its target text (find -type f skips it)
    (root / "sglang/__pycache__").mkdir()
    (root / "sglang/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")
    assert tree_digest(root) != _dir_hash1(root)
    shutil.rmtree(root / "sglang/__pycache__")
    (root / "sglang/link.py").symlink_to("Z.py")
    assert tree_digest(root) != _dir_hash1(root)


@pytest.mark.network  # the real 0.5.19 wheel (cached after the first run)
def test_the_tree_digest_is_dirhash1_on_a_real_tree(release_tree, tmp_path):
    tree = release_tree("0.5.19")
    copy = tmp_path / "copy"
    copy.mkdir()
    archive = subprocess.run(["git", "-C", str(tree.path), "archive", "HEAD", "sglang"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive, check=True)
    assert tree_digest(copy) == _dir_hash1(copy) == tree.tree_digest
