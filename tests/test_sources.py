"""Fetching targets into the content-addressed cache: real wheels, synthetic broken wheels, git, paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest

from backport.cli import main
from tests.synthetic import build_wheel, sha256_of, write_pins, write_tree

SYNTH = "9.9.1"


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def local_index(tmp_path, monkeypatch, cache_dir):
    """pip configured (through its own environment variables) to find wheels only in a local folder."""
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


def error_line(err: str) -> str:
    """The single error line (progress lines may precede it on stderr)."""
    errors = [line for line in err.splitlines() if line.startswith("sglang-backport: error:")]
    assert len(errors) == 1 and err.rstrip("\n").splitlines()[-1] == errors[0], err
    return errors[0]


def pin(tmp_path, monkeypatch, wheels):
    monkeypatch.setenv("SGLANG_BACKPORT_RELEASES", str(write_pins(tmp_path / "releases.toml", wheels)))


def assert_no_entry(cache_dir: Path):
    trees = cache_dir / "trees"
    leftovers = [p.name for p in trees.iterdir()] if trees.exists() else []
    assert leftovers == [], f"cache entries left behind: {leftovers}"


# ---- real wheel --------------------------------------------------------------------------------


@pytest.mark.network
def test_fetch_real_wheel_then_cache_hit(shared_cache, monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    code, out, _ = run_cli(capsys, "fetch", "sglang==0.5.19", "--json")
    assert code == 0
    first = json.loads(out)
    assert first["version"] == "0.5.19"
    assert first["artifact_sha256"] == "425e87377e725d03db8262382008f3fd9561a6cf5d82f485f8b9929f02ffe12b"
    assert Path(first["tree"]).is_absolute() and (Path(first["tree"]) / "sglang" / "srt").is_dir()
    repo = git.Repo(first["tree"])
    message = repo.head.commit.message
    assert "Spec: sglang==0.5.19" in message and first["tree_digest"] in message
    assert len(list(repo.iter_commits())) == 1 and not repo.is_dirty(untracked_files=True)
    started = time.perf_counter()
    code, out, _ = run_cli(capsys, "fetch", "sglang==0.5.19", "--json")
    elapsed = time.perf_counter() - started
    second = json.loads(out)
    assert code == 0 and second["cached"] is True
    assert {k: v for k, v in second.items() if k != "cached"} == {
        k: v for k, v in first.items() if k != "cached"
    }
    assert elapsed < 1.0
    # only the package is extracted: no dist-info, no other top-level packages
    assert sorted(p.name for p in Path(first["tree"]).iterdir()) == [".git", "sglang"]


# ---- synthetic wheels through pip --------------------------------------------------------------


def test_fetch_pinned_synthetic_wheel(tmp_path, monkeypatch, local_index, cache_dir, capsys):
    wheel = build_wheel(local_index, SYNTH)
    pin(tmp_path, monkeypatch, {SYNTH: (wheel.name, sha256_of(wheel))})
    code, out, _ = run_cli(capsys, "fetch", f"sglang=={SYNTH}", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["cached"] is False and doc["version"] == SYNTH and doc["unpinned"] is False
    sidecar = json.loads((Path(doc["tree"]).parent / "target.json").read_text())
    assert sidecar["artifact_sha256"] == sha256_of(wheel) and sidecar["spec"] == f"sglang=={SYNTH}"
    wheel.unlink()  # a hit must not need the index
    code, out, _ = run_cli(capsys, "fetch", f"sglang=={SYNTH}", "--json")
    assert code == 0 and json.loads(out)["cached"] is True


def test_unpinned_version_is_refused_then_recorded(tmp_path, monkeypatch, local_index, cache_dir, capsys):
    build_wheel(local_index, SYNTH)
    pin(tmp_path, monkeypatch, {})
    code, out, err = run_cli(capsys, "fetch", f"sglang=={SYNTH}")
    assert code == 2 and out == ""
    assert f"sglang=={SYNTH}" in error_line(err) and "not pinned" in err
    assert_no_entry(cache_dir)
    code, out, _ = run_cli(capsys, "fetch", f"sglang=={SYNTH}", "--allow-unpinned", "--json")
    assert code == 0 and json.loads(out)["unpinned"] is True


@pytest.mark.parametrize(
    "case", ["sha-mismatch", "truncated", "record-mismatch", "unrecorded-file", "not-a-zip"]
)
def test_broken_wheels_exit_2_and_leave_no_entry(case, tmp_path, monkeypatch, local_index, cache_dir, capsys):
    if case == "record-mismatch":
        wheel = build_wheel(local_index, SYNTH, record_overrides={"sglang/version.py": "sha256=AAAA,3"})
    elif case == "unrecorded-file":
        wheel = build_wheel(local_index, SYNTH, extra_unrecorded={"sglang/evil.py": b"print('x')\n"})
    else:
        wheel = build_wheel(local_index, SYNTH)
    digest = sha256_of(wheel)
    if case in ("truncated", "not-a-zip"):
        # pip rejects such files itself; a corrupt file kept in the wheel cache (or served by a
        # mirror and pinned by mistake) must be caught by our own extraction.
        kept = cache_dir / "wheels" / wheel.name
        kept.parent.mkdir(parents=True)
        data = wheel.read_bytes()[: wheel.stat().st_size // 2] if case == "truncated" else b"not a zip\n"
        kept.write_bytes(data)
        digest = sha256_of(kept)
    elif case == "sha-mismatch":
        digest = "0" * 64
    pin(tmp_path, monkeypatch, {SYNTH: (wheel.name, digest)})
    code, _, err = run_cli(capsys, "fetch", f"sglang=={SYNTH}")
    assert code == 2, err
    assert error_line(err).startswith("sglang-backport: error: sglang==9.9.1")
    expected_word = {"sha-mismatch": "does not match the pin", "truncated": "not a readable wheel",
                     "record-mismatch": "RECORD", "unrecorded-file": "not mentioned in RECORD",
                     "not-a-zip": "not a readable wheel"}[case]
    assert expected_word in err
    assert_no_entry(cache_dir)
    assert not list((cache_dir / "trees").glob(".*partial")) if (cache_dir / "trees").exists() else True


def test_unknown_version_on_the_index_exits_2(tmp_path, monkeypatch, local_index, cache_dir, capsys):
    pin(tmp_path, monkeypatch, {"9.9.7": ("sglang-9.9.7-cp311-cp311-manylinux_2_34_x86_64.whl", "0" * 64)})
    code, _, err = run_cli(capsys, "fetch", "sglang==9.9.7")
    assert code == 2 and "pip download failed" in err and error_line(err)
    assert_no_entry(cache_dir)


def test_concurrent_fetches_both_succeed_with_one_entry(tmp_path, monkeypatch, local_index, cache_dir):
    wheel = build_wheel(local_index, SYNTH)
    pin(tmp_path, monkeypatch, {SYNTH: (wheel.name, sha256_of(wheel))})
    cmd = [sys.executable, "-m", "backport.cli", "fetch", f"sglang=={SYNTH}", "--json"]
    procs = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy()
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    trees = {json.loads(out)["tree"] for out, _ in results}
    assert len(trees) == 1
    entries = [p.name for p in (cache_dir / "trees").iterdir()]
    assert len(entries) == 1 and not entries[0].startswith(".")


# ---- git targets ------------------------------------------------------------------------------


@pytest.fixture
def upstream_bare(tmp_path):
    """A local bare repository laid out like upstream (python/sglang), with a release tag."""
    work = tmp_path / "upstream-work"
    write_tree(work / "python", "0.0.0.dev0")
    (work / "python" / "sglang" / "_version.py").unlink()  # upstream does not track _version.py
    (work / "test").mkdir()
    (work / "test" / "README").write_text("tests live here\n")
    repo = git.Repo.init(work)
    repo.git.add("-A")
    repo.git.commit("-qm", "release", author="Up Stream <up@example.com>")
    repo.create_tag("v9.9.1")
    (work / "python" / "sglang" / "srt" / "new.py").write_text("X = 1\n")
    repo.git.add("-A")
    repo.git.commit("-qm", "after the release", author="Up Stream <up@example.com>")
    bare = tmp_path / "upstream.git"
    git.Repo.clone_from(str(work), str(bare), bare=True)
    return bare, repo


def test_fetch_git_target_at_exact_commit(upstream_bare, cache_dir, capsys):
    bare, repo = upstream_bare
    head = repo.head.commit.hexsha
    first = repo.head.commit.parents[0].hexsha
    code, out, err = run_cli(capsys, "fetch", f"git+file://{bare}@{first}", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["base_commit"] == first and doc["version"] == "9.9.1" and doc["package_prefix"] == "python/"
    assert git.Repo(doc["tree"]).head.commit.hexsha == first
    assert not (Path(doc["tree"]) / "python" / "sglang" / "srt" / "new.py").exists()
    code, out, _ = run_cli(capsys, "fetch", f"git+file://{bare}@{head}", "--json")
    assert json.loads(out)["version"] == "9.9.1.post0.dev1"


def test_git_errors_exit_2(upstream_bare, tmp_path, cache_dir, capsys):
    bare, _ = upstream_bare
    code, _, err = run_cli(capsys, "fetch", f"git+file://{bare}@{'1' * 40}")
    assert code == 2 and "does not exist" in err and error_line(err)
    code, _, err = run_cli(capsys, "fetch", f"git+file://{tmp_path}/missing.git@{'1' * 40}")
    assert code == 2 and "cannot clone" in err and error_line(err)
    code, _, err = run_cli(capsys, "fetch", f"git+file://{bare}@main")
    assert code == 2 and "not a commit id" in err
    assert_no_entry(cache_dir)


# ---- paths and installed packages -------------------------------------------------------------


def test_path_checkout_is_used_as_is(tmp_path, cache_dir, capsys):
    checkout = write_tree(tmp_path / "checkout", "9.9.2")
    repo = git.Repo.init(checkout)
    repo.git.add("-A")
    repo.git.commit("-qm", "mine", author="Me <me@example.com>")
    (checkout / "sglang" / "srt" / "wip.py").write_text("# uncommitted work\n")
    before = (repo.head.commit.hexsha, repo.git.status("--porcelain"))
    code, out, _ = run_cli(capsys, "fetch", str(checkout), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["tree"] == str(checkout.resolve()) and doc["cached"] is False
    assert (repo.head.commit.hexsha, repo.git.status("--porcelain")) == before
    assert not (cache_dir / "trees").exists()


def test_plain_directory_is_snapshotted(tmp_path, cache_dir, capsys):
    plain = write_tree(tmp_path / "plain", "9.9.3")
    code, out, _ = run_cli(capsys, "fetch", str(plain), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["version"] == "9.9.3" and Path(doc["tree"]).is_relative_to(cache_dir)
    assert doc["artifact_sha256"] is None and len(doc["tree_digest"]) == 64


def test_not_an_sglang_tree_exits_2(tmp_path, cache_dir, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "fetch", str(tmp_path / "empty"))
    assert code == 2 and "not an SGLang tree" in err and error_line(err)
    code, _, err = run_cli(capsys, "fetch", str(tmp_path / "nope"))
    assert code == 2 and "no such path" in err


def test_installed_package_of_another_interpreter(tmp_path, cache_dir, monkeypatch, capsys):
    site = write_tree(tmp_path / "site", "9.9.4")
    monkeypatch.setenv("PYTHONPATH", str(site))
    code, out, err = run_cli(capsys, "fetch", "installed", "--python", sys.executable, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["version"] == "9.9.4" and doc["spec"] == "installed"
    code, _, err = run_cli(capsys, "fetch", "installed", "--python", str(tmp_path / "no-python"))
    assert code == 2 and "cannot run" in err


def test_status_installed_recognises_an_exported_wheel(tmp_path, cache_dir, monkeypatch, capsys):
    """What an exported wheel leaves in site-packages: `sglang-X+backport.N.dist-info` with
    `sglang_backport.json`. The installed package's digest is measured, never taken from the record."""
    from backport.tree import tree_digest

    site = write_tree(tmp_path / "site", "9.9.6")
    digest = tree_digest(site)
    info = site / "sglang-9.9.6+backport.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.6+backport.7\n")
    record = {"spec": "sglang==9.9.6", "tree_digest": digest, "patch_set_sha256": "ab" * 32,
              "commits": ["c" * 40], "version": "9.9.6+backport.7"}
    (info / "sglang_backport.json").write_text(json.dumps(record))
    monkeypatch.setenv("PYTHONPATH", str(site))
    code, out, err = run_cli(capsys, "status", "installed", "--python", sys.executable, "--json")
    assert code == 0, err
    installed = json.loads(out)["installed"]
    assert installed["version"] == "9.9.6+backport.7" and installed["backport"] == record
    assert installed["tree_digest"] == digest and installed["digest_matches_record"] is True
    # the package changed after install: the record no longer describes it
    (site / "sglang" / "extra.py").write_text("x = 1\n")
    code, out, _ = run_cli(capsys, "status", "installed", "--python", sys.executable)
    assert code == 0 and "is NOT the tree its record names" in out
    code, _, err = run_cli(capsys, "status", str(site), "--bundle", str(tmp_path))
    assert code == 2 and "--bundle" in err


def test_status_reports_version_and_digest(tmp_path, cache_dir, capsys):
    plain = write_tree(tmp_path / "plain", "9.9.5")
    code, out, _ = run_cli(capsys, "status", str(plain), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["version"] == "9.9.5" and len(doc["tree_digest"]) == 64
    assert {f["fix"] for f in doc["fixes"]} >= {"pr36988", "pr38935"}
    assert all(f["present"] is False for f in doc["fixes"])
