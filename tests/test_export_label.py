"""The patched build says it is patched (issue 43 row 15), on small synthetic wheels: the exported
wheel's `sglang.__version__` carries `X+backport.N`, its RECORD checks, the label comes back out to
the patched tree's digest, and `status installed --require-patched` gates a rollout on it."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from installer.sources import WheelFile as CheckedWheel

from backport import cli
from backport.errors import BadInput
from backport.evidence.artifacts import read_wheel
from backport.export import build_wheel
from backport.export.label import backport_label, same_build
from backport.export.lineage import Lineage
from backport.tree import tree_digest
from tests.synthetic import build_wheel as upstream_wheel
from tests.synthetic import package_files, sha256_of, write_tree

FIXED = b"def is_mla_backend():\n    return False\n\n\ndef patched():\n    return True\n"


def _lineage(tmp_path: Path, files: dict[str, bytes] | None = None) -> tuple[Lineage, Path]:
    original = upstream_wheel(tmp_path / "upstream", "0.5.19", files=files)
    tree = tmp_path / "tree"
    for name, data in {
        **(files or package_files("0.5.19")),
        "sglang/srt/disaggregation/utils.py": FIXED,
    }.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    return Lineage(
        root=tree,
        spec="sglang==0.5.19",
        version="0.5.19",
        artifact_sha256=sha256_of(original),
        pristine_commit="0" * 40,
        commits=("a" * 40, "b" * 40),
        tree_digest=tree_digest(tree),
    ), original


def _install(wheel: Path, site: Path) -> Path:
    """What pip puts in site-packages: the wheel's members, as they are (the layout is purelib)."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


@pytest.fixture
def exported(tmp_path):
    lineage, original = _lineage(tmp_path)
    return lineage, original, build_wheel(lineage, tmp_path / "out", original=original)


def test_the_wheels_version_module_says_the_local_version_and_its_record_checks(exported, tmp_path):
    lineage, _, wheel = exported
    assert wheel.version == f"0.5.19+{lineage.label}" and wheel.labelled == ("sglang/_version.py",)
    with zipfile.ZipFile(wheel.path) as archive:
        module = archive.read("sglang/_version.py").decode()
    assert f"__version__ = version = '{wheel.version}'" in module
    with CheckedWheel.open(wheel.path) as checked:  # RECORD carries the rewritten module's digest
        checked.validate_record(validate_contents=True)
    digest, provenance = read_wheel(wheel.path.read_bytes())
    assert digest == lineage.tree_digest == wheel.tree_digest  # the label comes back out exactly
    assert provenance["labelled"] == ["sglang/_version.py"] and provenance["version"] == wheel.version
    site = _install(wheel.path, tmp_path / "site")
    said = subprocess.run([sys.executable, "-c", "import sglang; print(sglang.__version__)"], check=True,
                          capture_output=True, text=True, env={"PYTHONPATH": str(site)}).stdout.strip()
    assert said == wheel.version and backport_label(said) == lineage.label


def test_a_release_whose_version_lives_in_version_py_is_labelled_there(tmp_path):
    files = {name: data for name, data in package_files("0.5.19").items() if name != "sglang/_version.py"}
    files["sglang/version.py"] = b'__version__ = "0.5.19"\n'
    lineage, original = _lineage(tmp_path, files)
    wheel = build_wheel(lineage, tmp_path / "out", original=original)
    with zipfile.ZipFile(wheel.path) as archive:
        assert archive.read("sglang/version.py") == f'__version__ = "{wheel.version}"\n'.encode()
    assert read_wheel(wheel.path.read_bytes())[0] == lineage.tree_digest


def test_a_package_with_no_version_literal_is_refused_with_no_wheel_left(tmp_path):
    files = {name: data for name, data in package_files("0.5.19").items() if name != "sglang/_version.py"}
    lineage, original = _lineage(tmp_path, files)
    with pytest.raises(BadInput, match="could not say it is patched"):
        build_wheel(lineage, tmp_path / "out", original=original)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_wheel_whose_package_is_not_the_recorded_tree_is_refused(tmp_path):
    import dataclasses

    lineage, original = _lineage(tmp_path)
    with pytest.raises(BadInput, match="is not the patched tree"):
        build_wheel(dataclasses.replace(lineage, tree_digest="0" * 64), tmp_path / "out", original=original)
    assert list((tmp_path / "out").iterdir()) == []


def _status(capsys, monkeypatch, site: Path, *extra: str) -> tuple[int, dict]:
    monkeypatch.setenv("PYTHONPATH", str(site))
    code = cli.main(
        ["status", "installed", "--python", sys.executable, "--require-patched", "--json", *extra]
    )
    return code, json.loads(capsys.readouterr().out)


def test_require_patched_passes_a_patched_node_and_fails_a_rolled_back_or_edited_one(
    exported, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(tmp_path / "cache"))
    lineage, original, wheel = exported
    site = _install(wheel.path, tmp_path / "site")
    code, document = _status(capsys, monkeypatch, site)
    installed = document["installed"]
    assert code == 0 and installed["patched"] is True and installed["package_version"] == wheel.version
    assert installed["tree_digest"] == lineage.tree_digest and installed["digest_matches_record"] is True

    # the label edited away by hand: the record and the tree disagree with what the node reports
    module = site / "sglang" / "_version.py"
    module.write_text(module.read_text().replace(wheel.version, "0.5.19"))
    code, document = _status(capsys, monkeypatch, site)
    assert code == 1 and document["installed"]["patched"] is False

    rolled_back = _install(original, tmp_path / "rolled-back")  # upstream's wheel: no record, no label
    code, document = _status(capsys, monkeypatch, rolled_back)
    assert code == 1 and document["installed"]["patched"] is False
    assert document["installed"]["package_version"] == "0.5.19" and document["installed"]["backport"] is None
    monkeypatch.setenv("PYTHONPATH", str(rolled_back))
    assert cli.main(["status", "installed", "--python", sys.executable]) == 0  # without the gate: a report
    assert "NOT patched" in capsys.readouterr().out


def test_require_patched_is_only_for_installed(tmp_path, capsys):
    tree = write_tree(tmp_path / "tree", "0.5.19")
    assert cli.main(["status", str(tree), "--require-patched", "--json"]) == 2
    assert "--require-patched" in json.loads(capsys.readouterr().out)["error"]["message"]


@pytest.mark.parametrize(("code", "server", "fits"), [
    ("0.5.19+backport.7", "0.5.19+backport.7", True),
    ("0.5.19+backport.7", "0.5.19", False),             # a pristine or rolled-back node
    ("0.5.19+backport.7", "0.5.19+backport.8", False),  # another patch set
    ("0.5.19", "0.5.19+backport.7", True),              # a patched git tree has no label to compare
    ("0.5.19", "0.5.20", False),
])
def test_audit_tells_a_patched_build_from_a_pristine_one(code, server, fits):
    assert same_build(code, server) is fits
