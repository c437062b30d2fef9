"""`sglang-backport refresh FIX --release X`: quilt's refresh on a copy of the shipped pack."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import git
import pytest

from backport import gitops
from backport.cli import main
from backport.engine import apply_series
from backport.pack import load_pack, load_variant
from backport.tree import clone_tree

REPO = Path(__file__).resolve().parent.parent
CONTEXT = "        can_run_cuda_graph = result.can_run_cuda_graph"  # trailing context of one hunk


@pytest.fixture
def pack_copy(tmp_path) -> Path:
    dest = tmp_path / "patches"
    shutil.copytree(REPO / "patches", dest)
    return dest


def _refresh(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["refresh", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _body(path: Path) -> str:
    return path.read_text().split("\n---\n", 1)[1]


def _tree_id(work_tree: Path) -> str:
    return gitops.run(work_tree, "rev-parse", "HEAD^{tree}").decode().strip()


def _applies_to(path: Path, spec: str) -> None:
    """Rewrite a variant's Applies-To line (the test's own edit of a pack copy)."""
    text = path.read_text()
    old = next(line for line in text.splitlines() if line.startswith("Applies-To: "))
    path.write_text(text.replace(old, f"Applies-To: {spec}", 1))


@pytest.mark.network
def test_refresh_widens_a_variant_whose_hunks_place_without_fuzz(pack_copy, capsys, monkeypatch, shared_cache,
                                                                 release_tree, patched_tree, tmp_path):
    """pr36988-0.5.17 places on 0.5.16 at an offset, no fuzz: refresh stretches its Applies-To over
    0.5.16 instead of forking a file with the same hunks at other line numbers, and the pack then
    patches 0.5.16 to the very tree the shipped pack gives it (which serves 0.5.16 with that variant)."""
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    source = pack_copy / "pr36988" / "pr36988-0.5.17.patch"
    _applies_to(source, ">=0.5.17,<0.5.18")  # 0.5.16 served by no variant of the copy
    before = sorted(p.name for p in source.parent.iterdir())
    code, doc = _refresh(capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy),
                         "--work-dir", str(tmp_path / "wt"))
    assert code == 0, doc
    assert (doc["status"], doc["from_variant"], doc["path"]) == ("widened", source.name, str(source))
    assert doc["applies_to"] == ">=0.5.16,<0.5.18" and len(doc["hunks"]) == 7
    assert {h["status"] for h in doc["hunks"]} == {"offset"}
    assert sorted(p.name for p in source.parent.iterdir()) == before  # no file forked

    pack = load_pack(pack_copy)  # the header agrees with fixes.toml, or this raises
    variant = pack.variant_for("pr36988", "0.5.16")
    assert variant.path == source and variant.header["Applies-To"] == ">=0.5.16,<0.5.18"
    notes = " ".join(variant.header["Backport-Notes"].split())
    assert "Widened to 0.5.16 by sglang-backport refresh" in notes
    assert _body(source) == _body(REPO / "patches" / "pr36988" / "pr36988-0.5.17.patch")

    clone = clone_tree(release_tree("0.5.16"), tmp_path, tmp_path / "copy")
    report = apply_series(clone.path, pack, "0.5.16")
    assert report.status == "applied", report.to_json()
    shipped, _ = patched_tree("0.5.16")
    assert _tree_id(clone.path) == _tree_id(shipped.path)


@pytest.mark.network
def test_refresh_where_the_variant_serves_without_fuzz_writes_nothing(pack_copy, capsys, monkeypatch,
                                                                      shared_cache):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    code, doc = _refresh(capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy))
    assert code == 0 and doc["status"] == "served" and doc["path"] is None, doc
    assert (doc["from_variant"], doc["applies_to"]) == ("pr36988-0.5.17.patch", ">=0.5.16,<0.5.18")
    for name in ("pr36988-0.5.17.patch", "pr36988-0.5.15.patch"):
        shipped = (REPO / "patches" / "pr36988" / name).read_bytes()
        assert (pack_copy / "pr36988" / name).read_bytes() == shipped
    assert not (pack_copy / "pr36988" / "pr36988-0.5.16.patch").exists()


@pytest.mark.network
def test_refresh_forks_a_variant_that_needs_fuzz(pack_copy, capsys, monkeypatch, shared_cache, release_tree,
                                                  tmp_path):
    """A context line of the source drifted (one hunk places with fuzz 1 only): refresh writes a
    variant of 0.5.16's own, which places exactly there, and 0.5.16 leaves the source."""
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    source = pack_copy / "pr36988" / "pr36988-0.5.17.patch"
    text = source.read_text()
    line = "\n             batch=batch,\n"  # the trailing context line of one hunk
    assert text.count(line) == 1
    source.write_text(text.replace(line, line.rstrip("\n") + "  # drifted\n"))
    code, doc = _refresh(capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy),
                         "--work-dir", str(tmp_path / "wt"))
    assert code == 0, doc
    new = pack_copy / "pr36988" / "pr36988-0.5.16.patch"
    assert (doc["status"], doc["from_variant"], doc["path"]) == ("written", "pr36988-0.5.17.patch", str(new))
    assert sorted(h["status"] for h in doc["hunks"]) == ["fuzz"] + ["offset"] * 6

    pack = load_pack(pack_copy)  # the header agrees with fixes.toml, or this raises
    variant = pack.variant_for("pr36988", "0.5.16")
    assert variant.path == new and variant.header["Applies-To"] == ">=0.5.16,<0.5.17"
    assert "Refreshed for 0.5.16 from pr36988-0.5.17.patch" in " ".join(
        variant.header["Backport-Notes"].split()
    )
    assert variant.header["Description"] == pack.variant_for("pr36988", "0.5.17").header["Description"]
    assert pack.variant_for("pr36988", "0.5.17").header["Applies-To"] == ">=0.5.17,<0.5.18"  # 0.5.16 left it

    report = apply_series(release_tree("0.5.16").path, pack, "0.5.16", only=["pr36988"], check=True)
    (result,) = report.patches
    assert (result.status, result.variant) == ("applied", "pr36988-0.5.16.patch")
    assert [h.status for h in result.hunks] == ["exact"] * 7

    code, doc = _refresh(capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy))
    assert code == 2 and "exists" in doc["error"]["message"]  # never overwritten


@pytest.mark.network
def test_conflict_leaves_a_work_tree_and_continue_writes_the_variant(pack_copy, capsys, monkeypatch,
                                                                      shared_cache, release_tree, tmp_path):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    # what the hand resolution must come to: the diff the clean variant makes on 0.5.16 (the engine's)
    clean = clone_tree(release_tree("0.5.16"), tmp_path, tmp_path / "clean")
    assert apply_series(clean.path, load_pack(pack_copy), "0.5.16", only=["pr36988"]).status == "applied"
    reference = gitops.diff(clean.path, clean.base_commit, "HEAD", clean.package_prefix)

    source = pack_copy / "pr36988" / "pr36988-0.5.17.patch"
    text = source.read_text()
    assert text.count("\n " + CONTEXT + "\n") == 1
    source.write_text(text.replace("\n " + CONTEXT + "\n", "\n " + CONTEXT + "_and_more\n"))
    wt = tmp_path / "wt"
    code, doc = _refresh(capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy),
                         "--work-dir", str(wt))
    assert code == 1 and doc["status"] == "conflict" and doc["path"] == str(wt.resolve())
    assert [h["status"] for h in doc["hunks"]].count("conflict") == 1
    assert not (pack_copy / "pr36988" / "pr36988-0.5.16.patch").exists()
    prefill = wt / "sglang" / "srt" / "disaggregation" / "prefill.py"
    reject = prefill.with_name("prefill.py.rej")
    assert "_and_more" in reject.read_text()

    code, doc = _refresh(
        capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy), "--continue", str(wt)
    )
    assert code == 2 and "prefill.py.rej" in doc["error"]["message"]  # not resolved yet

    # the resolution by hand: the rejected hunk's added lines go before the real context line
    (conflicted,) = [
        h for f in load_variant(source).files for h in f.hunks if (" ", CONTEXT + "_and_more") in h.lines
    ]
    added = [t for tag, t in conflicted.lines if tag == "+"]
    lines = prefill.read_text().split("\n")
    at = next(i for i in range(2, len(lines)) if lines[i] == CONTEXT and lines[i - 1] == ""
              and lines[i - 2].strip() == "req.time_stats.set_last_chunked_prefill_finish_time()")
    prefill.write_text("\n".join(lines[:at] + added + lines[at:]))
    reject.unlink()
    with git.Repo(wt) as repo:
        repo.git.commit("-q", "-a", "-m", "resolve the rejected hunk",
                        env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                             "GIT_COMMITTER_EMAIL": "t@t"})

    code, doc = _refresh(
        capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy), "--continue", str(wt)
    )
    assert code == 0 and doc["status"] == "written", doc
    new = pack_copy / "pr36988" / "pr36988-0.5.16.patch"
    assert load_pack(pack_copy).variant_for("pr36988", "0.5.16").path == new
    assert _body(new) == reference
    assert "resolved by hand" in new.read_text()


@pytest.mark.parametrize(("fix", "release", "message"), [
    ("pr99999", "0.5.16", "no such fix"),
    ("pr36988", "0.4.5", "not pinned"),
    ("pr36988", "0.5.20", "already contains the fix"),
    ("pr36988", "0.5.17", "exists"),
    ("pr36988", "latest", "not a PEP 440 version"),
])
def test_bad_input_is_exit_2_with_one_line(pack_copy, capsys, fix, release, message):
    code, doc = _refresh(capsys, fix, "--release", release, "--series", str(pack_copy))
    assert code == 2 and message in doc["error"]["message"] and "\n" not in doc["error"]["message"]
    assert sorted(p.name for p in (pack_copy / "pr36988").iterdir()) == \
        sorted(p.name for p in (REPO / "patches" / "pr36988").iterdir())


def test_continue_refuses_a_tree_refresh_did_not_leave(pack_copy, capsys, tmp_path):
    git.Repo.init(tmp_path / "other").close()
    code, doc = _refresh(capsys, "pr36988", "--release", "0.5.16", "--series", str(pack_copy),
                         "--continue", str(tmp_path / "other"))
    assert code == 2 and "not a work tree left by" in doc["error"]["message"]


def test_a_fork_ends_where_a_post_release_of_its_own_base_is_served(pack_copy):
    """A fork's Applies-To stops at the first later release another variant serves, a post release of
    the same base included (it wrote >=0.4.10.post1,<0.5.1 over -0.4.10.post2's 0.4.10.post2: two
    variants claimed one release)."""
    from backport.refresh import _plan

    folder = pack_copy / "sbp-bootstrap-auth"
    older = folder / "sbp-bootstrap-auth-0.4.10.patch"
    (folder / "sbp-bootstrap-auth-0.4.10.post1.patch").rename(older)
    _applies_to(older, ">=0.4.9.post2,<0.4.10.post1")  # 0.4.10.post1 served by no variant of the copy
    _, _, applies, narrowed, refusal = _plan(load_pack(pack_copy), "sbp-bootstrap-auth", "0.4.10.post1")
    assert applies == ">=0.4.10.post1,<0.4.10.post2", applies
    assert (narrowed, refusal) == ("", "")
    # with the post release unserved, the fork reaches the first later release something serves
    (folder / "sbp-bootstrap-auth-0.4.10.post2.patch").unlink()
    _applies_to(folder / "sbp-bootstrap-auth-0.5.2.patch", ">=0.5.1.post1,<0.5.3")
    applies = _plan(load_pack(pack_copy), "sbp-bootstrap-auth", "0.4.10.post1")[2]
    assert applies == ">=0.4.10.post1,<0.5.1.post1", applies


def test_a_variant_s_own_dependency_is_applied_before_it_is_placed():
    """sbp-transfer-coverage's variants below 0.5.13 extend sbp-abort-hold's failure branch: their
    Depends-On names it though the fix's depends_on does not, and refresh's clone gets it first."""
    from packaging.version import Version

    from backport.refresh import _closure

    pack = load_pack(REPO / "patches")
    (source,) = [pv for pv in pack.variants["sbp-transfer-coverage"] if pv.applies("0.5.9")]
    assert source.depends_on == ("sbp-abort-hold",) and pack.fixes["sbp-transfer-coverage"].depends_on == ()
    assert _closure(pack, "sbp-transfer-coverage", Version("0.5.9"), source.depends_on) == ["sbp-abort-hold"]
    assert _closure(pack, "sbp-transfer-coverage", Version("0.5.9")) == []
