"""The cache checks what it serves: damaged entries are rebuilt, leftovers cleaned, pins never lose a wheel.

Every case uses a synthetic wheel served to pip from a local folder, so it runs offline and fast.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import git
import pytest

from tests.synthetic import build_wheel, sha256_of
from tests.test_sources import SYNTH, error_line, local_index, pin, run_cli  # noqa: F401 - fixtures

SPEC = f"sglang=={SYNTH}"


@pytest.fixture
def fetched(tmp_path, monkeypatch, local_index, cache_dir, capsys):  # noqa: F811
    wheel = build_wheel(local_index, SYNTH)
    pin(tmp_path, monkeypatch, {SYNTH: (wheel.name, sha256_of(wheel))})
    code, out, err = run_cli(capsys, "fetch", SPEC, "--json")
    assert code == 0, err
    return json.loads(out), wheel


def fetch_again(capsys) -> dict:
    code, out, err = run_cli(capsys, "fetch", SPEC, "--json")
    assert code == 0, err
    return json.loads(out)


def test_truncated_file_in_a_cached_tree_is_rebuilt(fetched, capsys):
    doc, _ = fetched
    victim = Path(doc["tree"]) / "sglang" / "version.py"
    original = victim.read_bytes()
    victim.write_bytes(original[:5])
    again = fetch_again(capsys)
    assert again["cached"] is False and again["tree_digest"] == doc["tree_digest"]
    assert victim.read_bytes() == original


@pytest.mark.parametrize("damage", ["empty-sidecar", "garbage-sidecar", "corrupt-object", "missing-tree"])
def test_damaged_entries_are_rebuilt_without_a_traceback(damage, fetched, capsys):
    doc, _ = fetched
    entry = Path(doc["tree"]).parent
    if damage == "empty-sidecar":
        (entry / "target.json").write_text("")
    elif damage == "garbage-sidecar":
        (entry / "target.json").write_text('{"path": 3}')
    elif damage == "corrupt-object":
        repo = git.Repo(doc["tree"])
        tree_sha = repo.head.commit.tree.hexsha
        obj = Path(doc["tree"]) / ".git" / "objects" / tree_sha[:2] / tree_sha[2:]
        obj.chmod(0o644)
        obj.write_bytes(b"corrupt")
    else:
        import shutil

        shutil.rmtree(entry / "tree")
    again = fetch_again(capsys)
    assert again["cached"] is False and again["tree_digest"] == doc["tree_digest"]
    assert fetch_again(capsys)["cached"] is True


def test_moved_cache_serves_the_new_location(fetched, cache_dir, tmp_path, monkeypatch, capsys):
    doc, wheel = fetched
    moved = tmp_path / "moved-cache"
    cache_dir.rename(moved)
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(moved))
    wheel.unlink()  # a hit must need neither the index nor the old path
    again = fetch_again(capsys)
    assert again["cached"] is True and Path(again["tree"]).is_relative_to(moved)
    assert not Path(doc["tree"]).exists()


def test_staging_leftover_of_a_dead_process_is_removed(fetched, cache_dir, capsys):
    trees = cache_dir / "trees"
    dead = trees / ".wheel-abc.999999999.x1y2.partial"   # no process has this pid
    live = trees / f".wheel-def.{os.getpid()}.x3y4.partial"  # being built by a running process
    for d in (dead, live):
        (d / "tree").mkdir(parents=True)
    fetch_again(capsys)
    assert not dead.exists() and live.exists()


def test_a_wrong_pin_never_removes_the_good_wheel(fetched, cache_dir, tmp_path, monkeypatch, capsys):
    doc, wheel = fetched
    kept = cache_dir / "wheels" / wheel.name
    assert kept.is_file()
    import shutil

    shutil.rmtree(Path(doc["tree"]).parent)  # force a rebuild that needs the wheel
    pin(tmp_path, monkeypatch, {SYNTH: (wheel.name, "1" * 64)})
    code, _, err = run_cli(capsys, "fetch", SPEC)
    assert code == 2 and "does not match the pin" in error_line(err)
    assert kept.is_file() and sha256_of(kept) == sha256_of(wheel)


def test_gc_removes_old_work_clones_only(cache_dir, capsys):
    work = cache_dir / "work"
    old, new = work / "sglang-1-old", work / "sglang-1-new"
    for d in (old, new):
        (d / "sglang").mkdir(parents=True)
    past = time.time() - 10 * 86400
    os.utime(old, (past, past))
    code, out, _ = run_cli(capsys, "gc", "--json")
    assert code == 0 and json.loads(out)["removed"] == [str(old)]
    assert not old.exists() and new.exists()
    code, _, err = run_cli(capsys, "gc", "--older-than", "-1")
    assert code == 2 and error_line(err)


def test_gc_removes_old_snapshots_of_installed_packages_and_killed_builds(cache_dir, capsys):
    trees = cache_dir / "trees"
    installed, directory, fresh = trees / "path-aaa", trees / "path-bbb", trees / "path-ccc"
    for entry, spec in ((installed, "installed"), (directory, "/srv/checkout"), (fresh, "installed")):
        (entry / "tree" / "sglang").mkdir(parents=True)
        (entry / "target.json").write_text(json.dumps({"spec": spec}))
    past = time.time() - 10 * 86400
    for entry in (installed, directory):
        os.utime(entry, (past, past))
    # a probe environment build killed with SIGKILL: its staging entry, pip's temporary files inside
    killed = cache_dir / "envs" / ".probe-0123.999999999.x.partial"
    (killed / "tmp" / "pip-unpack-x").mkdir(parents=True)
    code, out, _ = run_cli(capsys, "gc", "--json")
    assert code == 0 and sorted(json.loads(out)["removed"]) == sorted([str(killed), str(installed)])
    assert not installed.exists() and directory.exists() and fresh.exists() and not killed.exists()
    code, out, _ = run_cli(capsys, "gc", "--older-than", "0", "--json")
    assert json.loads(out)["removed"] == [str(fresh)] and directory.exists()


MALFORMED_MATRIX = {
    "missing-wheel": '[[release]]\nversion = "9.9.1"\n',
    "extra-key": '[[release]]\nversion = "9.9.1"\nwheel = { file = "a.whl", sha256 = "%s" }\ncolour = "red"\n'
    % ("0" * 64),
    "wrong-type": '[[release]]\nversion = 9\nwheel = { file = "a.whl", sha256 = "%s" }\n' % ("0" * 64),
    "bad-sha": '[[release]]\nversion = "9.9.1"\nwheel = { file = "a.whl", sha256 = "xyz" }\n',
    "bad-verdict": (
        '[[release]]\nversion = "9.9.1"\nwheel = { file = "a.whl", sha256 = "%s" }\nmeasured = true\n'
        'exceptions = [{ case = "handoff/x", pristine = "maybe", reason = "r" }]\n' % ("0" * 64)
    ),
    "exception-without-reason": (
        '[[release]]\nversion = "9.9.1"\nwheel = { file = "a.whl", sha256 = "%s" }\n'
        'measured = true\nexceptions = [{ case = "handoff/x", pristine = "safe" }]\n' % ("0" * 64)
    ),
    "enumerated-expectations": (
        '[[release]]\nversion = "9.9.1"\nwheel = { file = "a.whl", sha256 = "%s" }\n'
        'apply = {}\npristine = { "handoff/x" = "unsafe" }\n' % ("0" * 64)
    ),
    "not-toml": "[[release]\n",
    "not-utf8": b"\xff\xfe[[release]]\n",
    "twice": ('[[release]]\nversion = "9.9.1"\nwheel = { file = "a.whl", sha256 = "%s" }\n' % ("0" * 64)) * 2,
}


@pytest.mark.parametrize("case", list(MALFORMED_MATRIX))
def test_malformed_release_matrix_is_one_line_exit_2(case, tmp_path, monkeypatch, cache_dir, capsys):
    path = tmp_path / "releases.toml"
    text = MALFORMED_MATRIX[case]
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("SGLANG_BACKPORT_RELEASES", str(path))
    code, out, err = run_cli(capsys, "fetch", SPEC, "--json")
    assert code == 2 and str(path) in error_line(err)
    assert json.loads(out)["error"]["code"] == 2


def test_a_blob_that_no_longer_reads_is_rebuilt_and_out_is_left_clean(fetched, tmp_path, capsys):
    """The hit check hashes the work tree, not every git object: a truncated blob shows only
    when the entry is cloned. The entry is then rebuilt and --out gets a good tree, never a
    half-checked-out clone or a 'bad input' about the user's directory."""
    doc, _ = fetched
    repo = git.Repo(doc["tree"])
    blob = repo.head.commit.tree / "sglang" / "version.py"
    obj = Path(doc["tree"]) / ".git" / "objects" / blob.hexsha[:2] / blob.hexsha[2:]
    obj.chmod(0o644)
    obj.write_bytes(obj.read_bytes()[:7])
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "apply", SPEC, "--out", str(out))
    assert code != 2, err
    assert "does not clone" in err and "rebuilding it" in err
    assert (out / "sglang" / "version.py").is_file()
    assert git.Repo(out).head.commit.tree / "sglang" / "version.py"
    assert fetch_again(capsys)["cached"] is True
