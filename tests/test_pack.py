"""The real patch pack against the real release wheels 0.5.17 - 0.5.22.

Each release is fetched from PyPI (verified against its pin), cloned, and given the whole
series by the engine. The expected per-fix outcome follows shared/upstream/RELEASES.md: what a
release already has is `not-applicable`; the page-lifetime chain is outside the pack's scope
below 0.5.19 (README, "Page lifetime").
"""

from __future__ import annotations

import json
import py_compile
import subprocess
from pathlib import Path

import git
import pytest

from backport.cli import main
from backport.detect import detect
from backport.series import load_pack
from tests.conftest import REPO

A, NA = "applied", "not-applicable"
PAGE_LIFETIME = ("pr35049", "pr37454", "pr40645", "pr41023", "pr41402", "pr41404")
EXPECTED = {
    "0.5.17": {"pr36988": A, "pr38935": A, **{f: NA for f in PAGE_LIFETIME}},
    "0.5.18": {"pr36988": A, "pr38935": A, **{f: NA for f in PAGE_LIFETIME}},
    "0.5.19": {"pr36988": A, "pr38935": A, "pr35049": NA, "pr37454": A, "pr40645": A, "pr41023": A,
               "pr41402": A, "pr41404": A},
    "0.5.20": {"pr36988": NA, "pr38935": A, "pr35049": NA, "pr37454": NA, "pr40645": A, "pr41023": A,
               "pr41402": A, "pr41404": A},
    "0.5.21": {"pr36988": NA, "pr38935": NA, "pr35049": NA, "pr37454": NA, "pr40645": NA, "pr41023": NA,
               "pr41402": A, "pr41404": NA},
    "0.5.22": {f: NA for f in ("pr36988", "pr38935", *PAGE_LIFETIME)},
}
IMPORTS = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
           "sglang.srt.disaggregation.common.conn", "sglang.srt.disaggregation.mooncake.conn",
           "sglang.srt.disaggregation.nixl.conn", "sglang.srt.disaggregation.fake.conn",
           "sglang.srt.managers.scheduler")

pytestmark = [pytest.mark.probe_env, pytest.mark.network]


def test_series_names_every_fix():
    pack = load_pack(REPO / "patches")
    assert set(pack.series) == set(EXPECTED["0.5.19"]), "series and the expectations here must agree"


@pytest.mark.parametrize("version", list(EXPECTED))
def test_whole_pack_on_release(version, patched_tree):
    tree, report = patched_tree(version)
    got = {p.fix: p.status for p in report.patches}
    assert got == EXPECTED[version], report.to_json()
    applied = [p for p in report.patches if p.status == A]
    assert report.status == ("applied" if applied else "nothing-to-do")
    for patch in report.patches:
        if patch.status == NA and version in ("0.5.17", "0.5.18") and patch.fix in PAGE_LIFETIME:
            assert "no backport" in (patch.reason or ""), patch  # said out loud, not silently skipped
    repo = git.Repo(tree.path)
    commits = list(repo.iter_commits(f"{tree.base_commit}..HEAD"))
    assert len(commits) == len(applied)
    for commit, patch in zip(reversed(commits), applied):
        assert f"Backport-Of: sgl-project/sglang#{patch.fix[2:]}" in commit.message
        assert "Upstream-Commit:" in commit.message and f"Backport-Variant: {patch.variant}" in commit.message
    assert not repo.is_dirty(untracked_files=True)
    # every file the pack touched compiles
    touched = {f for c in commits for f in c.stats.files}
    for rel in sorted(touched):
        py_compile.compile(str(tree.path / rel), doraise=True, cfile=str(tree.path / ".pyc-check"))
    (tree.path / ".pyc-check").unlink(missing_ok=True)


@pytest.mark.parametrize("version", ["0.5.17", "0.5.18", "0.5.19", "0.5.20"])
def test_patched_release_imports_on_cpu(version, patched_tree, probe_python, tmp_path):
    from backport.probing import probe_environ

    tree, _ = patched_tree(version)
    code = f"import importlib\nfor m in {IMPORTS!r}: importlib.import_module(m)\nprint('ok')"
    proc = subprocess.run([probe_python, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=probe_environ(probe_python, tree.package_root, tmp_path), timeout=600,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("version", ["0.5.19", "0.5.20"])
def test_reapply_is_nothing_to_do_and_status_sees_every_fix(version, patched_tree):
    from backport.apply import apply_series

    tree, _ = patched_tree(version)
    head = git.Repo(tree.path).head.commit.hexsha
    again = apply_series(tree.path, load_pack(REPO / "patches"), version)
    assert again.status == "nothing-to-do"
    assert {p.status for p in again.patches} <= {"already-present", NA}
    assert git.Repo(tree.path).head.commit.hexsha == head
    found = {d.fix: d.present for d in detect(tree.package_root, load_pack(REPO / "patches"))}
    assert all(found.values()), found


@pytest.mark.parametrize("version", ["0.5.17", "0.5.19"])
def test_pristine_release_lacks_the_incident_fixes(version, release_tree):
    found = {d.fix: d.present for d in detect(release_tree(version).package_root, load_pack(REPO / "patches"))}
    assert found["pr36988"] is False and found["pr38935"] is False


def test_cli_apply_on_a_spec_works_on_a_fresh_clone(shared_cache, release_tree, monkeypatch, tmp_path, capsys):
    cached = release_tree("0.5.19")
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    out = tmp_path / "work"
    assert main(["apply", "sglang==0.5.19", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "applied" and Path(doc["tree"]) == out.resolve()
    assert doc["base_commit"] == cached.base_commit != doc["head_commit"]
    # the cache entry itself is untouched
    assert git.Repo(cached.path).head.commit.hexsha == cached.base_commit
    assert not git.Repo(cached.path).is_dirty(untracked_files=True)
    # --check on the spec computes the report and changes nothing
    assert main(["apply", "sglang==0.5.19", "--check", "--json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert [p["status"] for p in checked["patches"]] == [p["status"] for p in doc["patches"]]
    assert git.Repo(cached.path).head.commit.hexsha == cached.base_commit
