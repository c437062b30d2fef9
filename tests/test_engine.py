"""The backport engine on real git repositories built by the tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest

from backport.engine import apply_series, detect, index_refs, recover_checkout
from backport.engine.objects import read_loose_trees
from backport.engine.placement import FileImage, Hunk, place_hunks
from backport.engine.write import FAULT_LOG, FAULT_PAUSE
from backport.errors import BadInput
from backport.pack import load_pack, load_variant
from tests.conftest import REPO as REPO_ROOT
from tests.engine_helpers import (
    APPLY_SCRIPT,
    PKG,
    diff_of,
    git_wrapper,
    header,
    leftovers,
    make_fix_table,
    make_pack,
    make_repo,
    module_text,
    run_git,
    snapshot,
    tree_state,
    work_files,
    write_files,
)

MOD = f"{PKG}/prefill.py"
OTHER = f"{PKG}/decode.py"
BASE = module_text(40)


def change(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def fix_patch(tmp: Path, edits: list[tuple[str, str]], *, base: str = BASE, path: str = MOD, **hdr) -> str:
    after = base
    for old, new in edits:
        after = change(after, old, new)
    return header(**hdr) + diff_of(tmp, {path: base}, {path: after})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "tree", {MOD: BASE, OTHER: module_text(10, "g")})


def one_fix_pack(tmp: Path, patch: str, fid: str = "pr100", **fix) -> object:
    root = make_pack(tmp / f"pack-{fid}", [dict(id=fid, **fix)], {fid: {f"{fid}-0.5.17.patch": patch}})
    return load_pack(root)


def read(repo: Path, rel: str = MOD) -> bytes:
    return (repo / rel).read_bytes()


def head(repo: Path) -> str:
    return run_git(repo, "rev-parse", "HEAD").strip()


FIX10 = [("    x = 10\n", "    x = 10  # fixed\n")]


# ----------------------------------------------------------------- placement


def test_exact_applies_and_commits(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10), title="Retire aborted results")
    base = head(repo)
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "applied" and rep.base_commit == base and rep.head_commit == head(repo) != base
    (p,) = rep.patches
    assert p.status == "applied" and p.variant == "pr100-0.5.17.patch"
    assert [(h.status, h.offset, h.fuzz) for h in p.hunks] == [("exact", 0, 0)]
    assert read(repo) == change(BASE, *FIX10[0]).encode()
    c = git.Repo(repo).head.commit
    assert c.message.startswith("Backport #100: Retire aborted results\n")
    assert "Backport-Of: sgl-project/sglang#100" in c.message
    assert "Upstream-Commit: 0123456789abcdef0123456789abcdef01234567" in c.message
    assert "Backport-Variant: pr100-0.5.17.patch" in c.message
    assert (c.author.name, c.author.email) == ("sglang-backport", "sglang-backport@localhost")
    assert c.committer.email == "sglang-backport@localhost"
    assert c.authored_datetime.isoformat() == "2026-11-30T00:00:00+00:00"
    assert p.commit == c.hexsha and c.parents[0].hexsha == base
    assert run_git(repo, "status", "--porcelain") == ""  # index and files agree with HEAD
    assert run_git(repo, "diff-files") == ""  # and the index has fresh stat info
    run_git(repo, "fsck", "--full", "--strict")  # the loose objects the engine wrote are sound
    assert run_git(repo, "for-each-ref", "refs/sglang-backport/") == ""  # the pending ref is gone
    assert "sglang-backport: apply 1 patch" in run_git(repo, "reflog", "-1", "main")


def test_offset_reports_line_delta(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    write_files(repo, {MOD: "".join(f"# new header line {i}\n" for i in range(5)) + BASE})
    run_git(repo, "commit", "-qam", "drift")
    rep = apply_series(repo, pack, "0.5.19")
    h = rep.patches[0].hunks[0]
    assert (rep.status, h.status, h.offset, h.fuzz) == ("applied", "offset", 5, 0)
    assert b"    x = 10  # fixed\n" in read(repo)


def test_offset_searches_both_directions_nearest_wins(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    drifted = BASE.replace("def f2():\n    x = 2\n    return x\n\n", "")  # 4 lines fewer above
    write_files(repo, {MOD: drifted})
    run_git(repo, "commit", "-qam", "drift")
    h = apply_series(repo, pack, "0.5.19").patches[0].hunks[0]
    assert (h.status, h.offset) == ("offset", -4)


def test_fuzz_drops_outer_context(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    write_files(repo, {MOD: change(BASE, "def f11():", "def f11_renamed():")})
    run_git(repo, "commit", "-qam", "drift")
    rep = apply_series(repo, pack, "0.5.19")
    h = rep.patches[0].hunks[0]
    assert (rep.status, h.status, h.fuzz, h.offset) == ("applied", "fuzz", 1, 0)
    assert b"def f11_renamed():" in read(repo) and b"    x = 10  # fixed\n" in read(repo)


def test_rerun_after_fuzz_is_nothing_to_do(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    write_files(repo, {MOD: change(BASE, "def f11():", "def f11_renamed():")})
    run_git(repo, "commit", "-qam", "drift")
    assert apply_series(repo, pack, "0.5.19").patches[0].hunks[0].status == "fuzz"
    again = apply_series(repo, pack, "0.5.19")
    assert again.status == "nothing-to-do" and "with fuzz" in again.patches[0].reason


def test_fuzz_two(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    drifted = change(BASE, "    return x\n\ndef f11():", "    return x\n# gap\ndef f11_a():")
    write_files(repo, {MOD: drifted})
    run_git(repo, "commit", "-qam", "drift")
    h = apply_series(repo, pack, "0.5.19").patches[0].hunks[0]
    assert (h.status, h.fuzz) == ("fuzz", 2)


def test_conflict_reports_nearest_candidate_and_leaves_tree(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    write_files(repo, {MOD: change(BASE, "    x = 10\n", "    x = 1000\n")})
    run_git(repo, "commit", "-qam", "drift")
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "failed" and rep.exit_code == 1 and rep.head_commit == rep.base_commit
    p = rep.patches[0]
    h = p.hunks[0]
    assert p.status == "failed" and h.status == "conflict"
    assert h.line == 39  # where the hunk would start: the nearest best partial match
    assert "    x = 10" in h.expected and "    x = 1000" in h.actual
    assert "prefill.py:39" in p.reason
    assert snapshot(repo) == before
    j = rep.to_json()["patches"][0]["hunks"][0]
    assert j["status"] == "conflict" and j["expected"] and j["actual"]


def _block_file(positions: list[int], n: int = 40, tag: str = "l") -> str:
    lines = [f"{tag}{i}" for i in range(n)]
    block = ["a = 1", "b = 2", "c = 3", "x = 0", "d = 4", "e = 5", "f = 6"]
    for p in sorted(positions, reverse=True):
        lines[p:p + len(block)] = block
    return "\n".join(lines) + "\n"


def test_ambiguous_location_is_a_conflict(tmp_path):
    base = _block_file([10])
    repo = make_repo(tmp_path / "tree", {MOD: _block_file([0, 20], tag="m")})
    patch = header() + diff_of(tmp_path, {MOD: base}, {MOD: base.replace("x = 0", "x = 1")})
    pack = one_fix_pack(tmp_path, patch)
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19")
    h = rep.patches[0].hunks[0]
    assert rep.status == "failed" and h.status == "conflict" and "ambiguous" in h.reason
    assert "1 and 21" in h.reason
    assert snapshot(repo) == before


def test_nearest_of_two_unequal_candidates_wins(tmp_path):
    base = _block_file([10])
    repo = make_repo(tmp_path / "tree", {MOD: _block_file([3, 20], tag="m")})
    patch = header() + diff_of(tmp_path, {MOD: base}, {MOD: base.replace("x = 0", "x = 1")})
    rep = apply_series(repo, one_fix_pack(tmp_path, patch), "0.5.19")
    h = rep.patches[0].hunks[0]
    assert (rep.status, h.status, h.offset) == ("applied", "offset", -7)


def test_placement_unit_anchored_start_and_end():
    # a hunk short of leading context because it sits at line 1 stays at the
    # start of the file; short of trailing context, at the end (GNU patch)
    top = Hunk(1, 3, 1, 4, (("+", "import os"), (" ", "a"), (" ", "b"), (" ", "c")))
    assert place_hunks(["a", "b", "c", "d", "e"], [top])[0].status == "exact"
    assert place_hunks(["z", "a", "b", "c", "d", "e"], [top])[0].status == "conflict"
    end = Hunk(3, 3, 3, 4, ((" ", "c"), (" ", "d"), (" ", "e"), ("+", "f")))
    assert place_hunks(["a", "b", "c", "d", "e"], [end])[0].status == "exact"
    pl = place_hunks(["a", "b", "x", "y", "c", "d", "e"], [end])[0]
    assert (pl.status, pl.offset) == ("offset", 2)
    assert place_hunks(["c", "d", "e", "more"], [end])[0].status == "conflict"


def test_placement_unit_hunks_keep_order():
    h1 = Hunk(2, 3, 2, 3, ((" ", "a"), ("-", "x"), ("+", "X"), (" ", "b")))
    h2 = Hunk(10, 3, 10, 3, ((" ", "a"), ("-", "x"), ("+", "X"), (" ", "b")))
    lines = ["0", "a", "x", "b", "4", "5", "6", "7", "8", "9", "10", "11"]
    pls = place_hunks(lines, [h1, h2])
    assert pls[0].status == "exact" and pls[1].status == "conflict"  # cannot reuse lines 2-4


# ---------------------------------------------------------- series semantics


def test_rerun_is_nothing_to_do(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    first = apply_series(repo, pack, "0.5.19")
    assert first.status == "applied"
    again = apply_series(repo, pack, "0.5.19")
    assert again.status == "nothing-to-do" and again.exit_code == 0
    assert again.patches[0].status == "already-present" and "reverse-applies" in again.patches[0].reason
    assert again.head_commit == again.base_commit == first.head_commit == head(repo)


def test_already_present_by_fingerprint(tmp_path, repo):
    fp = [{"file": MOD, "pattern": r"x = 10  # fixed$"}]
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10), fingerprint=fp)
    write_files(
        repo, {MOD: change(BASE, "    x = 10\n", "    x = 10  # fixed\n").replace("def f1()", "def f1b()")}
    )
    run_git(repo, "commit", "-qam", "hand-applied")
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "nothing-to-do" and rep.patches[0].reason.startswith("fingerprint: 1/1")
    (d,) = detect(repo, pack)
    assert d.present and "1/1 rules matched" in d.how
    (d2,) = detect(make_repo(tmp_path / "pristine", {MOD: BASE}), pack)
    assert not d2.present and "missed" in d2.how


def test_detect_without_fingerprint_uses_version(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10), fixed_in=">=0.5.21")
    (d,) = detect(repo, pack)
    assert not d.present and d.how == "no fingerprint rules"
    (d,) = detect(repo, pack, version="0.5.21")
    assert d.present and "fixed_in" in d.how
    (d,) = detect(repo, pack, version="0.5.19")
    assert not d.present
    apply_series(repo, pack, "0.5.19")
    (d,) = detect(repo, pack, version="0.5.19")
    assert d.present and "reverse-applies" in d.how


def test_not_applicable_when_fixed_in(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10), fixed_in=">=0.5.20")
    rep = apply_series(repo, pack, "0.5.21")
    assert rep.status == "nothing-to-do" and rep.patches[0].status == "not-applicable"
    assert apply_series(repo, pack, "0.5.19", check=True).patches[0].status == "applied"


def test_out_of_scope_is_not_applicable_and_said(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10), scope=">=0.5.19")
    rep = apply_series(repo, pack, "0.5.17")
    assert rep.status == "nothing-to-do" and rep.patches[0].status == "not-applicable"
    assert "no backport for sglang 0.5.17" in rep.patches[0].reason and "exposed" in rep.patches[0].reason
    assert apply_series(repo, pack, "0.5.19").status == "applied"


def test_out_of_scope_dependency_is_missing(tmp_path, repo):
    root = _dep_pack(tmp_path)
    toml = (root / "fixes.toml").read_text().replace('[fixes.pr100]\n', '[fixes.pr100]\nscope = ">=0.5.19"\n')
    (root / "fixes.toml").write_text(toml)
    rep = apply_series(repo, load_pack(root), "0.5.17")
    assert [p.status for p in rep.patches] == ["not-applicable", "failed"]
    assert "pr100 (no backport for 0.5.17)" in rep.patches[1].reason


def _three_fixes(tmp: Path) -> Path:
    fixes = [{"id": "pr100"}, {"id": "pr200"}, {"id": "pr300"}]
    patches = {
        "pr100": {"pr100-0.5.17.patch": fix_patch(tmp, [("    x = 5\n", "    x = 5  # one\n")], pr=100)},
        "pr200": {"pr200-0.5.17.patch": fix_patch(tmp, [("    x = 20\n", "    x = 20  # two\n")], pr=200)},
        "pr300": {
            "pr300-0.5.17.patch": header(pr=300)
            + diff_of(
                tmp,
                {OTHER: module_text(10, "g")},
                {OTHER: change(module_text(10, "g"), "    x = 3\n", "    x = 3  # three\n")},
            )
        },
    }
    return make_pack(tmp / "pack3", fixes, patches)


def test_patch_two_of_three_failing_leaves_tree_unchanged(tmp_path, repo):
    pack = load_pack(_three_fixes(tmp_path))
    write_files(repo, {MOD: change(BASE, "    x = 20\n", "    x = 2000\n")})
    run_git(repo, "commit", "-qam", "drift")
    run_git(repo, "add", "-A")
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19")
    assert [p.status for p in rep.patches] == ["applied", "failed", "applied"]
    assert rep.status == "failed" and all(p.commit is None for p in rep.patches)
    assert snapshot(repo) == before
    ok = apply_series(repo, pack, "0.5.19", only=["pr100", "pr300"])
    assert ok.status == "applied" and len(list(git.Repo(repo).iter_commits())) == 4  # 2 + 2 commits


def test_three_patches_three_commits_in_order(tmp_path, repo):
    pack = load_pack(_three_fixes(tmp_path))
    rep = apply_series(repo, pack, "0.5.19")
    run_git(repo, "fsck", "--full", "--strict")
    assert run_git(repo, "status", "--porcelain") == ""
    msgs = [c.summary for c in git.Repo(repo).iter_commits()]
    assert msgs[:3] == ["Backport #300: Fix pr300", "Backport #200: Fix pr200", "Backport #100: Fix pr100"]
    assert [p.commit for p in rep.patches] == [
        c.hexsha for c in list(git.Repo(repo).iter_commits())[:3][::-1]
    ]


def assert_crash_at_head_update_restores(repo, pack, monkeypatch):
    """Crash at the last step (moving HEAD): files, index and HEAD must be as before."""
    before = snapshot(repo)

    def flaky(*args, **kw):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(index_refs.RefUpdate, "commit", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        apply_series(repo, pack, "0.5.19")
    assert snapshot(repo) == before
    assert run_git(repo, "for-each-ref", "refs/sglang-backport/") == ""


def test_failure_in_final_write_restores_everything(tmp_path, repo, monkeypatch):
    pack = load_pack(_three_fixes(tmp_path))
    assert_crash_at_head_update_restores(repo, pack, monkeypatch)


def test_failure_after_deleting_a_file_restores_it(tmp_path, monkeypatch):
    gone = f"{PKG}/legacy.py"
    repo = make_repo(tmp_path / "tree", {MOD: BASE, gone: "old = True\n"})
    os.chmod(repo / gone, 0o755)
    run_git(repo, "commit", "-qam", "exec")
    pack = one_fix_pack(tmp_path, header() + diff_of(tmp_path, {gone: "old = True\n"}, {gone: None}))
    assert_crash_at_head_update_restores(repo, pack, monkeypatch)


def test_check_changes_nothing(tmp_path, repo):
    pack = load_pack(_three_fixes(tmp_path))
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19", check=True)
    assert rep.check and rep.status == "applied" and rep.head_commit == rep.base_commit
    assert [p.status for p in rep.patches] == ["applied"] * 3 and all(p.commit is None for p in rep.patches)
    assert snapshot(repo) == before


def test_deterministic_commit_shas(tmp_path, repo):
    pack = load_pack(_three_fixes(tmp_path))
    a, b = tmp_path / "a", tmp_path / "b"
    git.Repo.clone_from(repo, a).close()
    git.Repo.clone_from(repo, b).close()
    ra = apply_series(a, pack, "0.5.19")
    os.utime(pack.root / "series")  # another moment, same inputs
    rb = apply_series(b, pack, "0.5.19")
    assert [p.commit for p in ra.patches] == [
        p.commit for p in rb.patches
    ] and ra.head_commit == rb.head_commit


@pytest.mark.parametrize("packed", ["everything", "history"])
def test_packed_objects_give_the_same_commits(tmp_path, repo, packed):
    """The base trees are read straight from loose objects, or by git cat-file where one of them
    is packed (here: all of them, or all but a new commit's): both give the same commits."""
    pack = load_pack(_three_fixes(tmp_path))
    loose, other = tmp_path / "loose", tmp_path / "packed"
    for clone in (loose, other):
        run_git(tmp_path, "clone", "-q", str(repo), str(clone))
    run_git(other, "gc", "-q")
    if packed == "history":  # a commit of its own: its root tree is loose, the package's trees packed
        for clone in (loose, other):
            (clone / "NOTES").write_text("local notes\n")
            run_git(clone, "add", "NOTES")
            run_git(clone, "commit", "-qm", "notes")
    assert read_loose_trees(loose / ".git" / "objects", head(loose), ["", PKG]) is not None
    assert read_loose_trees(other / ".git" / "objects", head(other), ["", PKG]) is None
    ra, rb = apply_series(loose, pack, "0.5.19"), apply_series(other, pack, "0.5.19")
    assert ra.status == rb.status == "applied"
    assert [p.commit for p in ra.patches] == [
        p.commit for p in rb.patches
    ] and ra.head_commit == rb.head_commit
    run_git(other, "fsck", "--strict")


def test_json_schema(tmp_path, repo):
    rep = apply_series(repo, load_pack(_three_fixes(tmp_path)), "0.5.19")
    doc = json.loads(json.dumps(rep.to_json()))
    assert {"tree", "version", "base_commit", "head_commit", "status", "patches"} <= set(doc)
    assert doc["tree"] == str(repo.resolve()) and doc["version"] == "0.5.19"
    for p in doc["patches"]:
        assert {"fix", "variant", "status", "reason", "hunks", "commit"} <= set(p)
        for h in p["hunks"]:
            assert {"file", "status", "offset", "fuzz"} <= set(h)


# ------------------------------------------------------------ dirty checkout


def test_unstaged_edit_elsewhere_is_left_as_it_was(tmp_path, repo):
    """The rule of git am and git cherry-pick: a file the series does not touch may carry
    unstaged work; it is neither refused, nor touched, nor committed."""
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    (repo / OTHER).write_text("local work\n")
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "applied"
    assert (repo / OTHER).read_text() == "local work\n"  # untouched, and not committed
    assert git.Repo(repo).head.commit.tree[OTHER].data_stream.read() == module_text(10, "g").encode()
    assert run_git(repo, "status", "--porcelain", "--untracked-files=no") == f" M {OTHER}\n"


@pytest.mark.parametrize("edit", ["bytes", "deleted"])
def test_edit_to_a_touched_file_is_refused(tmp_path, repo, edit):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    if edit == "bytes":
        (repo / MOD).write_text(BASE + "# my local edit\n")
    else:
        (repo / MOD).unlink()
    before = snapshot(repo)
    with pytest.raises(BadInput, match=f"uncommitted changes .* {MOD}"):
        apply_series(repo, pack, "0.5.19")
    assert snapshot(repo) == before and leftovers(repo) == []


def test_allow_dirty_never_touches_a_dirty_file(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    (repo / MOD).write_text(BASE + "# my local edit\n")
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19", allow_dirty=True)
    assert rep.status == "failed" and "uncommitted" in rep.patches[0].reason
    assert snapshot(repo) == before


def test_staged_change_to_a_touched_file_fails_its_fix(tmp_path, repo):
    """A staged change whose work-tree file is back at the committed bytes: only the index shows it."""
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    committed = (repo / MOD).read_bytes()
    (repo / MOD).write_text(BASE + "# staged edit\n")
    run_git(repo, "add", MOD)
    (repo / MOD).write_bytes(committed)
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19", allow_dirty=True)
    assert rep.status == "failed" and rep.patches[0].reason.endswith("uncommitted changes (staged)"), (
        rep.to_json()
    )
    assert snapshot(repo) == before and leftovers(repo) == []


def test_staged_change_counts_as_dirty_and_stays_staged_when_allowed(tmp_path, repo):
    """git am's rule: the index must match HEAD. Allowed, a staged change elsewhere stays staged."""
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    (repo / OTHER).write_text("staged\n")
    run_git(repo, "add", OTHER)
    before = snapshot(repo)
    with pytest.raises(BadInput, match=f"staged changes in 1 file.*{OTHER}"):
        apply_series(repo, pack, "0.5.19")
    assert snapshot(repo) == before
    assert apply_series(repo, pack, "0.5.19", allow_dirty=True).status == "applied"
    assert run_git(repo, "status", "--porcelain", "--untracked-files=no") == f"M  {OTHER}\n"
    assert b"# fixed" in read(repo)


def test_unmerged_path_is_refused(tmp_path, repo):
    """A conflicted merge or stash pop leaves unmerged entries: HEAD must not move under it."""
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    run_git(repo, "checkout", "-q", "-b", "side")
    (repo / OTHER).write_text("side\n")
    run_git(repo, "commit", "-qam", "side")
    run_git(repo, "checkout", "-q", "main")
    (repo / OTHER).write_text("main\n")
    run_git(repo, "commit", "-qam", "main")
    subprocess.run(["git", "-C", str(repo), "merge", "-q", "side"], capture_output=True, check=False)
    assert "UU" in run_git(repo, "status", "--porcelain")
    before = snapshot(repo)
    with pytest.raises(BadInput, match=f"staged changes in 1 file.*{OTHER}"):
        apply_series(repo, pack, "0.5.19")
    assert snapshot(repo) == before


# --------------------------------------------------------- file-level cases


def test_crlf_file(tmp_path):
    crlf = BASE.replace("\n", "\r\n").encode()
    repo = make_repo(tmp_path / "tree", {MOD: crlf})
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10 + [("    x = 30\n", "    x = 30\n    y = 31\n")]))
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "applied"
    out = read(repo)
    expected = change(change(BASE, *FIX10[0]), "    x = 30\n", "    x = 30\n    y = 31\n").replace(
        "\n", "\r\n"
    )
    assert out == expected.encode()
    assert apply_series(repo, pack, "0.5.19").status == "nothing-to-do"


def test_file_without_trailing_newline(tmp_path):
    base = "a = 1\nb = 2\nc = 3\nd = 4"
    after = "a = 1\nb = 2\nc = 3\nd = 4\ne = 5"
    repo = make_repo(tmp_path / "tree", {MOD: base})
    pack = one_fix_pack(tmp_path, header() + diff_of(tmp_path, {MOD: base}, {MOD: after}))
    assert apply_series(repo, pack, "0.5.19").status == "applied"
    assert read(repo) == after.encode()


def test_patch_with_newline_on_file_without(tmp_path):
    base = "a = 1\nb = 2\nc = 3\n"
    repo = make_repo(tmp_path / "tree", {MOD: base.rstrip("\n")})
    pack = one_fix_pack(tmp_path, header() + diff_of(tmp_path, {MOD: base}, {MOD: base + "d = 4\n"}))
    assert apply_series(repo, pack, "0.5.19").status == "applied"
    assert read(repo) == b"a = 1\nb = 2\nc = 3\nd = 4\n"


def test_file_creation_and_deletion(tmp_path):
    gone = f"{PKG}/legacy.py"
    new = f"{PKG}/retire.py"
    repo = make_repo(tmp_path / "tree", {MOD: BASE, gone: "old = True\n"})
    patch = header() + diff_of(tmp_path, {MOD: BASE, gone: "old = True\n"},
                               {gone: None, new: "def retire():\n    return 1\n"})
    pack = one_fix_pack(tmp_path, patch)
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "applied"
    assert not (repo / gone).exists() and (repo / new).read_text() == "def retire():\n    return 1\n"
    tree = git.Repo(repo).head.commit.tree
    assert new in [b.path for b in tree.traverse()] and gone not in [b.path for b in tree.traverse()]
    assert run_git(repo, "status", "--porcelain") == ""
    run_git(repo, "fsck", "--full", "--strict")
    again = apply_series(repo, pack, "0.5.19")
    assert again.status == "nothing-to-do"


def test_creation_over_untracked_file_fails(tmp_path, repo):
    new = f"{PKG}/retire.py"
    pack = one_fix_pack(tmp_path, header() + diff_of(tmp_path, {}, {new: "x = 1\n"}))
    (repo / new).write_text("my own file\n")
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "failed" and "already exists" in rep.patches[0].reason
    assert snapshot(repo) == before


def test_modifying_an_untracked_file_fails(tmp_path, repo):
    loose = f"{PKG}/scratch.py"
    (repo / loose).write_text(BASE)  # same content as the patch expects, but git does not track it
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10, path=loose))
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "failed" and "not tracked by git" in rep.patches[0].reason
    assert snapshot(repo) == before


def test_upstream_checkout_layout(tmp_path):
    repo = make_repo(tmp_path / "tree", {MOD: BASE}, prefix="python/")
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    rep = apply_series(repo, pack, "0.5.19", package_prefix="python/")
    assert rep.status == "applied" and b"# fixed" in read(repo, "python/" + MOD)
    assert rep.patches[0].hunks[0].file == MOD


def test_hard_linked_file_is_not_changed_through_its_other_link(tmp_path, repo):
    cache_copy = tmp_path / "cache-copy.py"
    os.link(repo / MOD, cache_copy)
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    assert apply_series(repo, pack, "0.5.19").status == "applied"
    assert cache_copy.read_text() == BASE and b"# fixed" in read(repo)


def test_executable_mode_kept(tmp_path, repo):
    os.chmod(repo / MOD, 0o755)
    run_git(repo, "commit", "-qam", "exec")
    assert (
        apply_series(repo, one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10)), "0.5.19").status == "applied"
    )
    assert os.stat(repo / MOD).st_mode & 0o777 == 0o755
    assert run_git(repo, "ls-tree", "HEAD", MOD).startswith("100755 ")


def test_git_worktree(tmp_path, repo):
    wt = tmp_path / "wt"
    run_git(repo, "worktree", "add", "-q", "-b", "backport", str(wt))
    rep = apply_series(wt, one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10)), "0.5.19")
    assert rep.status == "applied" and run_git(wt, "status", "--porcelain") == ""
    assert run_git(repo, "rev-parse", "main").strip() == rep.base_commit  # the main checkout is untouched
    assert run_git(repo, "rev-parse", "backport").strip() == rep.head_commit


def test_detached_head(tmp_path, repo):
    run_git(repo, "checkout", "-q", "--detach")
    rep = apply_series(repo, one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10)), "0.5.19")
    assert rep.status == "applied" and head(repo) == rep.head_commit
    assert run_git(repo, "rev-parse", "main").strip() == rep.base_commit


# ---------------------------------------------------- variants, dependencies


def _variant_pack(tmp: Path) -> Path:
    return make_pack(tmp / "vpack", [{"id": "pr200"}], {"pr200": {
        "pr200-0.5.17.patch": fix_patch(tmp, [("    x = 7\n", "    x = 7  # old releases\n")],
                                        applies_to=">=0.5.17,<0.5.19", pr=200),
        "pr200-0.5.19.patch": fix_patch(tmp, [("    x = 7\n", "    x = 7  # new releases\n")],
                                        applies_to=">=0.5.19,<0.5.21", pr=200),
    }})


@pytest.mark.parametrize("version,variant,marker", [("0.5.17", "pr200-0.5.17.patch", b"# old releases"),
                                                      ("0.5.18", "pr200-0.5.17.patch", b"# old releases"),
                                                      ("0.5.20", "pr200-0.5.19.patch", b"# new releases")])
def test_variant_selection_by_applies_to(tmp_path, repo, version, variant, marker):
    rep = apply_series(repo, load_pack(_variant_pack(tmp_path)), version)
    assert rep.patches[0].variant == variant and marker in read(repo)


def test_no_variant_for_version_fails(tmp_path, repo):
    before = snapshot(repo)
    rep = apply_series(repo, load_pack(_variant_pack(tmp_path)), "0.5.16")
    assert rep.status == "failed" and rep.exit_code == 1
    assert "no variant applies to sglang 0.5.16" in rep.patches[0].reason
    assert snapshot(repo) == before


def test_overlapping_applies_to_is_bad_input(tmp_path, repo):
    root = _variant_pack(tmp_path)
    p = root / "pr200" / "pr200-0.5.19.patch"
    p.write_text(p.read_text().replace("Applies-To: >=0.5.19,<0.5.21", "Applies-To: >=0.5.18"))
    with pytest.raises(BadInput, match="overlap"):
        apply_series(repo, load_pack(root), "0.5.18")


def _dep_pack(tmp: Path) -> Path:
    return make_pack(tmp / "dpack", [{"id": "pr100"}, {"id": "pr300", "depends_on": ["pr100"]}], {
        "pr100": {"pr100-0.5.17.patch": fix_patch(tmp, [("    x = 5\n", "    x = 5  # one\n")], pr=100)},
        "pr300": {"pr300-0.5.17.patch": fix_patch(tmp, [("    x = 30\n", "    x = 30  # three\n")], pr=300,
                                                  depends_on="pr100")},
    })


def test_missing_dependency_fails(tmp_path, repo):
    pack = load_pack(_dep_pack(tmp_path))
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19", only=["pr300"])
    assert rep.status == "failed" and "missing dependency: pr100" in rep.patches[0].reason
    assert snapshot(repo) == before
    assert apply_series(repo, pack, "0.5.19").status == "applied"
    assert apply_series(repo, pack, "0.5.19", only=["pr300"]).status == "nothing-to-do"


def test_failed_dependency_fails_dependent(tmp_path, repo):
    write_files(repo, {MOD: change(BASE, "    x = 5\n", "    x = 55\n")})
    run_git(repo, "commit", "-qam", "drift")
    rep = apply_series(repo, load_pack(_dep_pack(tmp_path)), "0.5.19")
    assert [p.status for p in rep.patches] == ["failed", "failed"]
    assert "pr100 (failed)" in rep.patches[1].reason


def test_why_a_patch_failed_is_a_value_not_its_prose(tmp_path, repo):
    """"The pack cannot serve this release" (evidence.unserved_fixes) reads the engine's failure values:
    renaming every reason leaves it unchanged; reports written before the value judge by their shape."""
    from backport.engine.report import ApplyReport
    from backport.evidence import unserved_fixes

    no_variant = apply_series(repo, load_pack(_variant_pack(tmp_path)), "0.5.16").patches[0]
    waiting = apply_series(repo, load_pack(_dep_pack(tmp_path)), "0.5.19", only=["pr300"]).patches[0]
    write_files(repo, {MOD: change(BASE, "    x = 5\n", "    x = 55\n")})
    run_git(repo, "commit", "-qam", "drift")
    conflict = apply_series(repo, load_pack(_dep_pack(tmp_path)), "0.5.19").patches[0]
    assert [p.cause for p in (no_variant, waiting, conflict)] == ["no-variant", "missing-dependency",
                                                                     "does-not-place"]

    def report(*patches, renamed=False, legacy=False):
        docs = [p.to_json() for p in patches]
        for d in docs:
            if renamed:
                d["reason"] = "renamed"
            if legacy:
                d.pop("cause")
        return ApplyReport.from_json({"status": "failed", "patches": docs})

    for renamed, legacy in ((False, False), (True, False), (True, True)):
        served = unserved_fixes(report(no_variant, waiting, renamed=renamed, legacy=legacy))
        assert served == ([no_variant.fix], [waiting.fix]), (renamed, legacy)
        assert unserved_fixes(report(no_variant, conflict, renamed=renamed, legacy=legacy)) is None


# ------------------------------------------------------ security, bad input


def _write_variant(tmp: Path, text: str) -> Path:
    p = tmp / "bad" / "pr100" / "pr100-0.5.17.patch"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_git_binary_patch_is_bad_input(tmp_path):
    diff = diff_of(tmp_path, {"sglang/x.bin": b"\x00\x01\x02" * 10}, {"sglang/x.bin": b"\x00\x09\x02" * 10})
    assert "GIT binary patch" in diff
    p = _write_variant(tmp_path, header() + diff)
    with pytest.raises(BadInput, match="binary"):
        load_variant(p)


def test_bad_patch_in_pack_fails_load_before_any_change(tmp_path, repo):
    root = _three_fixes(tmp_path)
    f = root / "pr300" / "pr300-0.5.17.patch"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:-2]))  # truncate the last hunk
    with pytest.raises(BadInput, match=r"pr300-0.5.17.patch.*truncated"):
        load_pack(root)


@pytest.mark.parametrize("inside", [False, True])
def test_symlink_in_path_is_bad_input(tmp_path, inside):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.py").write_text("a\n")
    repo = make_repo(tmp_path / "tree", {MOD: BASE})
    (repo / "sglang" / "inner").mkdir()
    (repo / "sglang" / "inner" / "victim.py").write_text("a\n")
    os.symlink(repo / "sglang" / "inner" if inside else outside, repo / "sglang" / "link")
    run_git(repo, "add", "-A")
    run_git(repo, "commit", "-qm", "link")
    pack = one_fix_pack(tmp_path, header() + "--- a/sglang/link/victim.py\n+++ b/sglang/link/victim.py\n"
                                              "@@ -1 +1 @@\n-a\n+b\n")
    before = snapshot(repo)
    with pytest.raises(BadInput, match="symlink.*" + ("inside" if inside else "outside")):
        apply_series(repo, pack, "0.5.19")
    assert snapshot(repo) == before and (outside / "victim.py").read_text() == "a\n"


def test_bad_version_and_not_a_repo(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    with pytest.raises(BadInput, match="PEP 440"):
        apply_series(repo, pack, "not-a-version")
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(BadInput, match="not a git repository"):
        apply_series(plain, pack, "0.5.19")
    with pytest.raises(BadInput, match="not in the series"):
        apply_series(repo, pack, "0.5.19", only=["pr999"])
    empty = tmp_path / "empty"
    (empty / "sglang").mkdir(parents=True)
    run_git(empty, "init", "-q")
    with pytest.raises(BadInput, match="no commit"):
        apply_series(empty, pack, "0.5.19")
    with pytest.raises(BadInput, match="not a git repository"):
        apply_series(repo / "sglang", pack, "0.5.19")


def test_header_fields_parsed(tmp_path):
    p = _write_variant(
        tmp_path, fix_patch(tmp_path, FIX10, depends_on="pr1, pr2", notes="line one\n line two")
    )
    v = load_variant(p)
    assert v.depends_on == ("pr1", "pr2") and v.header["Backport-Notes"] == "line one\nline two"
    assert v.header["Description"].startswith("Fix a thing\n") and str(v.applies_to) == ">=0.5.17"
    assert len(v.sha256) == 64 and v.patchset is not None and v.files[0].path == MOD


def test_fileimage_roundtrip_mixed_endings():
    data = b"a\r\nb\nc\r\nno-newline"
    img = FileImage.from_bytes(data)
    assert img.lines == ["a", "b", "c", "no-newline"] and img.to_bytes() == data


# ------------------------------------------------ crash safety (issue 12)

LEGACY, RETIRE = f"{PKG}/legacy.py", f"{PKG}/retire.py"
STEPS = ["objects", "journal", f"file {MOD}", f"file {OTHER}", f"file {LEGACY}", f"file {RETIRE}", "index",
         "head", "swap index", "done"]


@pytest.fixture(scope="module")
def crash_kit(tmp_path_factory):
    """A template checkout, a four-fix pack (edits, a creation, a deletion) and the two
    states a run may leave: pristine and fully patched (from an uninterrupted run)."""
    tmp = tmp_path_factory.mktemp("crash")
    template = make_repo(tmp / "template", {MOD: BASE, OTHER: module_text(10, "g"), LEGACY: "old = True\n"})
    root = _three_fixes(tmp)
    (root / "series").write_text("pr100\npr200\npr300\npr400\n")
    (root / "fixes.toml").write_text((root / "fixes.toml").read_text() + make_fix_table("pr400"))
    (root / "pr400").mkdir()
    (root / "pr400" / "pr400-0.5.17.patch").write_text(header(pr=400) + diff_of(
        tmp, {LEGACY: "old = True\n"}, {LEGACY: None, RETIRE: "def retire():\n    return 1\n"}))
    reference = tmp / "reference"
    run_git(tmp, "clone", "-q", str(template), str(reference))
    assert apply_series(reference, load_pack(root), "0.5.19").status == "applied"
    pristine = {"head": head(template), "files": work_files(template)}
    patched = {"head": head(reference), "files": work_files(reference)}
    return tmp, template, root, pristine, patched


def _killed_run(kit, name: str, extra_env: dict, ready: Path, sig=signal.SIGKILL) -> tuple[Path, str]:
    """Clone the template, start `apply` on it in its own process group, wait for ``ready``
    to appear (the run is paused at its kill point), send ``sig`` to the group."""
    tmp, template, pack_root, _, _ = kit
    repo = tmp / name
    run_git(tmp, "clone", "-q", str(template), str(repo))
    env = {**os.environ, **extra_env, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", APPLY_SCRIPT, str(repo), str(pack_root)], env=env,
                            cwd=tmp, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    return repo, f"rc={proc.returncode} {out.decode()} {err.decode()[-500:]}"


def _recovered(kit, repo: Path) -> str:
    """Recover in process (as the next run does), then check the state and that the next
    apply ends fully patched with the reference commits."""
    _, _, pack_root, pristine, patched = kit
    found = tree_state(repo, pristine, patched)  # what the kill left, before any recovery
    said = recover_checkout(repo)
    state = tree_state(repo, pristine, patched)
    assert state in ("pristine", "patched") and leftovers(repo) == [], (state, said, leftovers(repo))
    assert ("rolled back" in said) == (state == "pristine") and ("finished" in said) == (state == "patched")
    again = apply_series(repo, load_pack(pack_root), "0.5.19")
    assert tree_state(repo, pristine, patched) == "patched" and again.head_commit == patched["head"]
    return found, state


def test_fault_steps_are_the_write_window(crash_kit, tmp_path):
    log = tmp_path / "steps.log"
    repo = crash_kit[0] / "steps"
    run_git(crash_kit[0], "clone", "-q", str(crash_kit[1]), str(repo))
    env = {**os.environ, FAULT_LOG: str(log), "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", APPLY_SCRIPT, str(repo), str(crash_kit[2])], env=env, check=True)
    assert [line.split(" ", 1)[1] for line in log.read_text().splitlines()] == STEPS
    assert tree_state(repo, crash_kit[3], crash_kit[4]) == "patched" and leftovers(repo) == []


@pytest.mark.parametrize("step", range(1, len(STEPS) + 1), ids=STEPS)
def test_sigkill_at_every_step_is_recovered(crash_kit, step):
    log = crash_kit[0] / f"kill-{step}.log"

    def paused() -> bool:
        return log.exists() and len(log.read_text().splitlines()) >= step

    repo, how = _killed_run(crash_kit, f"kill-{step}", {FAULT_LOG: str(log), FAULT_PAUSE: str(step)}, paused)
    assert "rc=-9" in how, how
    found, state = _recovered(crash_kit, repo)
    assert state == ("pristine" if step <= STEPS.index("head") + 1 else "patched")
    # the journal matters: killed between the first file and the index swap, the tree was half-way
    assert found == ("half" if 3 < step < len(STEPS) else state), found


@pytest.mark.parametrize("command", ["update-index", "update-ref"])
@pytest.mark.parametrize("when", ["pre", "post"])
def test_sigkill_around_each_git_write_is_recovered(crash_kit, command, when):
    marker = crash_kit[0] / f"git-{command}-{when}.hit"
    env = git_wrapper(crash_kit[0] / f"bin-{command}-{when}", marker, command, when)
    repo, how = _killed_run(crash_kit, f"git-{command}-{when}", env, marker.exists)
    assert "rc=-9" in how, how
    _, state = _recovered(crash_kit, repo)
    assert state == ("patched" if (command, when) == ("update-ref", "post") else "pristine")


@pytest.mark.parametrize("where", ["hashing", "pack"])
def test_an_interruption_while_the_objects_are_written_leaves_it_pristine(crash_kit, monkeypatch, where):
    """The objects are written in process: stopped while they are hashed, or half-way through
    the pack, the run rolls back and leaves no temporary pack file and nothing fsck rejects."""
    from backport.engine import objects

    tmp, template, pack_root, pristine, patched = crash_kit
    repo = tmp / f"objects-interrupted-{where}"
    run_git(tmp, "clone", "-q", str(template), str(repo))
    real_write, calls = objects.PackWriter.write, []

    def write(self, kind, data):
        calls.append(kind)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_write(self, kind, data)

    def write_whole(fd, data):
        os.write(fd, data[:len(data) // 2])  # a torn pack: half of it
        os.close(fd)
        raise KeyboardInterrupt

    if where == "hashing":
        monkeypatch.setattr(objects.PackWriter, "write", write)
    else:
        monkeypatch.setattr(objects, "_write_whole", write_whole)
    with pytest.raises(KeyboardInterrupt):
        apply_series(repo, load_pack(pack_root), "0.5.19")
    assert tree_state(repo, pristine, patched) == "pristine" and leftovers(repo) == []
    assert not list((repo / ".git" / "objects" / "pack").glob("tmp_*"))
    run_git(repo, "fsck", "--full", "--strict")
    monkeypatch.undo()
    assert apply_series(repo, load_pack(pack_root), "0.5.19").head_commit == patched["head"]
    run_git(repo, "fsck", "--full", "--strict")


@pytest.mark.parametrize("step", [1, STEPS.index("index") + 1, len(STEPS)], ids=["objects", "index", "done"])
def test_sigterm_in_the_write_window_is_held_until_the_tree_is_patched(crash_kit, step):
    log = crash_kit[0] / f"term-{step}.log"

    def paused() -> bool:
        return log.exists() and len(log.read_text().splitlines()) >= step

    repo, how = _killed_run(
        crash_kit, f"term-{step}", {FAULT_LOG: str(log), FAULT_PAUSE: f"{step}:1"}, paused, signal.SIGTERM
    )
    assert "rc=-15" in how, how  # the signal still ends the process, once the series is in
    assert tree_state(repo, crash_kit[3], crash_kit[4]) == "patched" and leftovers(repo) == []
    assert recover_checkout(repo) == ""


def test_sigterm_before_the_write_window_leaves_it_pristine(crash_kit):
    repo, how = _killed_run(crash_kit, "term-early", {}, lambda: True, signal.SIGTERM)
    assert "rc=-15" in how, how
    assert tree_state(repo, crash_kit[3], crash_kit[4]) == "pristine" and leftovers(repo) == []


def test_recovery_refuses_a_file_edited_after_the_crash(crash_kit):
    log = crash_kit[0] / "edited.log"
    step = STEPS.index(f"file {OTHER}") + 1

    def paused() -> bool:
        return log.exists() and len(log.read_text().splitlines()) >= step

    repo, _ = _killed_run(crash_kit, "edited", {FAULT_LOG: str(log), FAULT_PAUSE: str(step)}, paused)
    (repo / MOD).write_text("the operator's own edit\n")
    with pytest.raises(BadInput, match="changed since the interrupted apply"):
        recover_checkout(repo)
    assert (repo / MOD).read_text() == "the operator's own edit\n"
    assert (repo / ".git" / "sglang-backport-apply.json").exists()  # kept for the operator
    with pytest.raises(BadInput, match="changed since the interrupted apply"):
        apply_series(repo, load_pack(crash_kit[2]), "0.5.19")


def test_check_refuses_an_interrupted_apply(crash_kit):
    log = crash_kit[0] / "check.log"
    repo, _ = _killed_run(crash_kit, "check", {FAULT_LOG: str(log), FAULT_PAUSE: "3"},
                          lambda: log.exists() and len(log.read_text().splitlines()) >= 3)
    with pytest.raises(BadInput, match="interrupted"):
        apply_series(repo, load_pack(crash_kit[2]), "0.5.19", check=True)
    assert _recovered(crash_kit, repo) == ("pristine", "pristine")


def test_skip_worktree_file_with_local_edit_is_never_committed(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    run_git(repo, "update-index", "--skip-worktree", MOD)
    (repo / MOD).write_text(BASE + "# a local edit git status does not show\n")
    assert run_git(repo, "status", "--porcelain") == ""
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19")
    assert rep.status == "failed" and "skip-worktree" in rep.patches[0].reason
    assert snapshot(repo) == before


@pytest.mark.parametrize("flag", ["--assume-unchanged", "--skip-worktree"])
def test_flagged_file_is_not_touched_even_when_unchanged(tmp_path, repo, flag):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    run_git(repo, "update-index", flag, MOD)
    before = snapshot(repo)
    rep = apply_series(repo, pack, "0.5.19", allow_dirty=True)
    assert rep.status == "failed" and flag.strip("-") in rep.patches[0].reason
    assert snapshot(repo) == before


def test_the_next_index_never_writes_through_its_link_to_the_index(repo):
    """The next index starts as a second name of the index: git builds it in <name>.lock and
    renames it, so the index keeps its bytes until the swap; a name left by a killed run is
    replaced, not written through; a swap where git wrote nothing leaves one name."""
    index, nxt = repo / ".git" / "index", repo / ".git" / "sglang-backport-index"
    before = index.read_bytes()
    os.link(index, nxt)  # as a killed run leaves it
    index_refs.index_twin(index, nxt)
    (repo / MOD).write_text(BASE + "# staged by the test\n")
    index_refs.update_index(repo, [MOD], nxt)
    assert index.read_bytes() == before and nxt.read_bytes() != before
    index_refs.swap_index(nxt, index)
    assert not nxt.exists() and run_git(repo, "diff", "--cached", "--name-only") == f"{MOD}\n"
    after = index.read_bytes()
    index_refs.index_twin(index, nxt)  # git writes nothing: the two names stay one file
    index_refs.swap_index(nxt, index)
    assert not nxt.exists() and index.read_bytes() == after


def test_stale_index_lock_is_refused_before_any_write(tmp_path, repo):
    pack = one_fix_pack(tmp_path, fix_patch(tmp_path, FIX10))
    (repo / ".git" / "index.lock").write_bytes(b"")
    with pytest.raises(BadInput, match=r"index.lock"):
        apply_series(repo, pack, "0.5.19")
    assert head(repo) == run_git(repo, "rev-parse", "main").strip() and read(repo) == BASE.encode()
