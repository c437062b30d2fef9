"""`export`: the patched wheel and the format-patch series, from a real patched 0.5.19 tree."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backport import cli
from backport.errors import BadInput
from backport.export import build_wheel, read_lineage, write_series
from backport.export.label import installed_digest
from backport.tree import tree_digest
from tests.conftest import WORKSPACE_CACHE

pytestmark = pytest.mark.network  # the real 0.5.19 wheel (cached after the first run)


@pytest.fixture
def shared(monkeypatch):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(WORKSPACE_CACHE))


@pytest.fixture(scope="module")
def exported(patched_tree, tmp_path_factory):
    import os

    old = os.environ.get("SGLANG_BACKPORT_CACHE")
    os.environ["SGLANG_BACKPORT_CACHE"] = str(WORKSPACE_CACHE)
    try:
        tree, _ = patched_tree("0.5.19")
        lineage = read_lineage(tree.path)
        return tree, lineage, build_wheel(lineage, tmp_path_factory.mktemp("wheel"))
    finally:
        if old is None:
            os.environ.pop("SGLANG_BACKPORT_CACHE")
        else:
            os.environ["SGLANG_BACKPORT_CACHE"] = old


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith(f".dist-info/{name}")]
        return archive.read(member).decode()


def test_the_wheel_keeps_upstreams_metadata_under_a_local_label(exported):
    tree, lineage, wheel = exported
    assert wheel.name == f"sglang-0.5.19+{lineage.label}-cp311-cp311-manylinux_2_34_x86_64.whl"
    assert wheel.version.startswith("0.5.19+backport.") and wheel.tree_digest == tree_digest(tree.path)
    original = WORKSPACE_CACHE / "wheels" / wheel.original
    ours, theirs = _dist_info(wheel.path, "METADATA"), _dist_info(original, "METADATA")
    assert f"\nVersion: {wheel.version}\n" in ours
    assert ours.replace(wheel.version, "0.5.19", 1) == theirs  # dependencies and all else unchanged
    assert _dist_info(wheel.path, "entry_points.txt") == _dist_info(original, "entry_points.txt")
    provenance = json.loads(_dist_info(wheel.path, "sglang_backport.json"))
    assert provenance["commits"] == list(lineage.commits) and provenance["tree_digest"] == wheel.tree_digest
    names = zipfile.ZipFile(wheel.path).namelist()
    assert f"sglang-{wheel.version}.dist-info/RECORD" in names
    assert not any(n.startswith("sglang-0.5.19.dist-info/") for n in names)
    # the version module (sglang.__version__, /server_info's version) says the build is patched
    ours, theirs = (zipfile.ZipFile(w).read("sglang/_version.py").decode() for w in (wheel.path, original))
    assert wheel.labelled == ("sglang/_version.py",) and f"__version__ = version = '{wheel.version}'" in ours
    assert ours.replace(wheel.version, "0.5.19") == theirs


def test_the_label_names_the_patch_set(exported, tmp_path, shared):
    _, lineage, wheel = exported
    fewer = dataclasses.replace(lineage, commits=lineage.commits[:-1])
    assert fewer.label != lineage.label and fewer.patch_set_sha256 != lineage.patch_set_sha256
    again = build_wheel(lineage, tmp_path)
    assert (again.name, again.sha256) == (wheel.name, wheel.sha256)  # the same tree, the same bytes


def test_the_wheel_installs_and_its_package_is_the_patched_tree(exported, tmp_path):
    _, _, wheel = exported
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-compile", str(wheel.path)], check=True,
                   capture_output=True)
    shown = subprocess.run([*pip, "show", "sglang"], check=True, capture_output=True, text=True).stdout
    assert f"Version: {wheel.version}" in shown
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    # what `from sglang.version import __version__` reads (importing sglang itself needs torch)
    read = "import runpy, sys; print(runpy.run_path(sys.argv[1])['__version__'])"
    said = subprocess.run([str(venv / "bin" / "python"), "-c", read, str(site / "sglang" / "_version.py")],
                          check=True, capture_output=True, text=True).stdout.strip()
    assert said == wheel.version
    assert (
        installed_digest(site, wheel.version) == wheel.tree_digest != tree_digest(site)
    )  # only the label differs


def test_the_series_rebuilds_the_patched_tree_with_git_am(exported, release_tree, tmp_path):
    tree, lineage, _ = exported
    written = write_series(lineage, tmp_path / "series")
    assert len(written) == len(lineage.commits)
    assert "Backport-Of: pr36988" in written[0].read_text() or "Backport-Of:" in written[0].read_text()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(release_tree("0.5.19").path), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "-c", "user.name=op", "-c", "user.email=op@example.invalid",
                    "am", "-q", *map(str, written)], check=True)
    assert tree_digest(clone) == lineage.tree_digest == tree_digest(tree.path)


def test_bad_inputs_are_refused_and_the_tree_is_untouched(exported, release_tree, tmp_path, capsys, shared):
    tree, lineage, _ = exported
    assert cli.main(["export", str(tree.path)]) == 2
    assert cli.main(["export", str(release_tree("0.5.19").path), "--wheel", str(tmp_path / "w")]) == 2
    assert "no backport commits" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me\n")
    assert cli.main(["export", str(tree.path), "--patches", str(tmp_path / "full")]) == 2
    assert (tmp_path / "full" / "x").read_text() == "keep me\n"

    edited = tree.path / "sglang" / "version.py"
    before = edited.read_bytes() if edited.exists() else None
    edited.write_text("# an operator's uncommitted edit\n")
    try:
        assert cli.main(["export", str(tree.path), "--wheel", str(tmp_path / "w2"), "--json"]) == 2
        error = json.loads(capsys.readouterr().out)["error"]
        assert "uncommitted" in error["message"] and not (tmp_path / "w2").exists()
    finally:
        edited.unlink() if before is None else edited.write_bytes(before)

    bogus = tmp_path / "bogus.whl"
    bogus.write_bytes(b"not the upstream wheel")
    with pytest.raises(BadInput, match="does not match the Artifact-SHA256"):
        build_wheel(lineage, tmp_path / "w3", original=bogus)


def test_export_command_writes_both(exported, tmp_path, capsys, shared):
    tree, lineage, wheel = exported
    code = cli.main(
        ["export", str(tree.path), "--wheel", str(tmp_path / "w"), "--patches", str(tmp_path / "p"), "--json"]
    )
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert document["wheel"]["sha256"] == wheel.sha256 and len(document["patches"]) == len(lineage.commits)


def _readme_rollback() -> str:
    """The rollback command README's "Rollout and rollback" section tells an operator to run."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Rollout and rollback", 1)[1].split("\n## ", 1)[0]
    (command,) = [
        line.strip() for line in section.splitlines() if line.strip().startswith("pip install --force")
    ]
    return command


def test_the_readme_rollback_leaves_upstream_installed(exported, release_tree, tmp_path, capsys, shared):
    """An exported wheel installed, `status installed` says the role order and the rollback; README's
    rollback command (run as written, by the environment's pip) then leaves upstream's 0.5.19 installed:
    its version and the pristine tree's digest, no +backport build and no record."""
    import shlex

    _, _, wheel = exported
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-compile", str(wheel.path)], check=True,
                   capture_output=True)
    code = cli.main(["status", "installed", "--python", python, "--require-patched", "--json"])
    installed = json.loads(capsys.readouterr().out)["installed"]
    rollout = installed["rollout"]
    assert code == 0 and installed["patched"] and installed["package_version"] == wheel.version
    assert rollout["patched"] and rollout["peer_must_be_patched"] is True
    assert "as prefill" in rollout["order"] and "roll back decode first" in rollout["order"]
    command = _readme_rollback()
    assert rollout["rollback"] == command
    argv = shlex.split(command)
    assert argv[:2] == ["pip", "install"]
    done = subprocess.run([*pip, *argv[1:]], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = subprocess.run([*pip, "show", "sglang"], check=True, capture_output=True, text=True).stdout
    assert "Version: 0.5.19\n" in shown
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    assert tree_digest(site) == tree_digest(release_tree("0.5.19").package_root)
    assert not list(site.glob("sglang-*+backport*.dist-info"))
    code = cli.main(["status", "installed", "--python", python, "--require-patched", "--json"])
    installed = json.loads(capsys.readouterr().out)["installed"]
    assert code == 1  # the rollout gate: a rolled-back node is pristine
    assert installed["backport"] is None and installed["rollout"]["patched"] is False
    assert installed["package_version"] == "0.5.19" and installed["patched"] is False
