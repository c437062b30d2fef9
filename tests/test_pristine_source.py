"""What `run` and `apply` take as the tree, and which version: a checkout's recorded commit (never its
live work tree), its release tag (a version file must agree), and `apply --out` doing what it says.

The offline tests use small synthetic checkouts; the `network` ones the real 0.5.19 wheel (cached in
the test workspace after the first download), with the probe matrix stubbed.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import git
import pytest

from backport import cli, evidence
from backport.probing.harness import launch
from backport.tree import tree_digest
from tests.synthetic import write_tree

REPO = Path(__file__).resolve().parent.parent


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def error_line(err: str) -> str:
    """The one error line, last on stderr (progress lines may precede it)."""
    errors = [line for line in err.splitlines() if line.startswith("sglang-backport: error:")]
    assert len(errors) == 1 and err.rstrip("\n").splitlines()[-1] == errors[0], err
    return errors[0]


def commit(repo: git.Repo, message: str) -> str:
    repo.git.add("-A")
    repo.git.commit("-qm", message, author="Me <me@example.com>")
    return repo.head.commit.hexsha


def checkout(root: Path, version: str, *, tag: str | None = None, upstream_layout: bool = False) -> git.Repo:
    """A user's git checkout of a synthetic SGLang tree; the upstream layout keeps `sglang/` under
    `python/` with upstream's version.py (its 0.0.0.dev0 fallback) and no generated `_version.py`."""
    package_root = root / "python" if upstream_layout else root
    write_tree(package_root, version)
    if upstream_layout:
        (package_root / "sglang" / "_version.py").unlink()
        (package_root / "sglang" / "version.py").write_text(
            "try:\n    from sglang._version import __version__\nexcept ImportError:\n    __version__ = "
            "\"0.0.0.dev0\"\n"
        )
        (root / ".gitignore").write_text("python/sglang/_version.py\n")
    repo = git.Repo.init(root)
    with repo.config_writer() as config:
        config.set_value("user", "name", "Me").set_value("user", "email", "me@example.com")
    commit(repo, "upstream release")
    if tag:
        repo.create_tag(tag)
    return repo


# ---- apply --out: what it says, or exit 2 before any work -------------------------------------------


@pytest.mark.parametrize("case", ["proc", "under-a-file", "not-empty", "with-check"])
def test_apply_out_refused_before_any_work(case, tmp_path, cache_dir, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    out = {"proc": "/proc/not-writable", "under-a-file": str(tmp_path / "file" / "x"),
           "not-empty": str(tmp_path / "full"), "with-check": str(tmp_path / "new")}[case]
    extra = ["--check"] if case == "with-check" else []
    before = sorted(p.name for p in tmp_path.iterdir())
    started = time.monotonic()
    code, out_text, err = run_cli(capsys, "apply", "sglang==0.5.19", "--out", out, *extra)
    elapsed = time.monotonic() - started
    assert code == 2 and out_text == ""
    line = error_line(err)
    assert "--out" in line and out in line and "cache" not in line, line
    assert elapsed < 2, f"{elapsed:.1f} s before the refusal"
    assert not cache_dir.exists(), "nothing fetched, no cache entry built or blamed"
    assert (
        (sorted(p.name for p in tmp_path.iterdir()) == before and not Path(out).exists())
        or case == "not-empty"
    )
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep"
    code, out_text, _ = run_cli(capsys, "apply", "sglang==0.5.19", "--out", out, *extra, "--json")
    assert code == 2 and "--out" in json.loads(out_text)["error"]["message"]


def test_a_clone_destination_git_cannot_create_never_blames_the_cache(tmp_path, cache_dir):
    from backport.errors import BadInput
    from backport.sources import clone_pristine, materialise

    source = materialise(str(write_tree(tmp_path / "plain", "9.9.3"))).tree
    entry = source.path.parent
    before = sorted(p.name for p in entry.iterdir())
    with pytest.raises(BadInput, match="/proc/x") as refused:
        clone_pristine(source, Path("/proc"), Path("/proc/x"))
    assert "cache" not in str(refused.value)
    assert entry.is_dir() and sorted(p.name for p in entry.iterdir()) == before, "the entry was not rebuilt"


def test_apply_out_relative_makes_exactly_that_directory(tmp_path, cache_dir, capsys, monkeypatch):
    plain = write_tree(tmp_path / "plain", "9.9.3")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code, _, err = run_cli(capsys, "apply", str(plain), "--out", "trees/x")
    assert code == 0, err
    assert (work / "trees" / "x" / ".git").is_dir() and (
        work / "trees" / "x" / "sglang" / "__init__.py"
    ).is_file()
    assert sorted(p.relative_to(work).as_posix() for p in (work / "trees").iterdir()) == ["trees/x"]


def test_apply_checkout_with_out_clones_it_and_leaves_the_checkout(tmp_path, cache_dir, capsys):
    repo = checkout(tmp_path / "co", "9.9.2", tag="v9.9.2")
    (tmp_path / "co" / "notes.txt").write_text("uncommitted work\n")
    before = (repo.head.commit.hexsha, repo.active_branch.name, repo.git.status("--porcelain"))
    code, out, err = run_cli(
        capsys, "apply", str(tmp_path / "co"), "--out", str(tmp_path / "clone"), "--json"
    )
    assert code == 0, err
    assert json.loads(out)["tree"] == str((tmp_path / "clone").resolve())
    with git.Repo(tmp_path / "clone") as clone:
        assert clone.head.commit.hexsha == before[0]
    assert (repo.head.commit.hexsha, repo.active_branch.name, repo.git.status("--porcelain")) == before


# ---- versions from the truth --------------------------------------------------------------------------


def test_a_stale_version_file_against_the_tag_is_refused_naming_both(tmp_path, cache_dir, capsys):
    co = tmp_path / "co"
    checkout(co, "9.9.2", tag="v9.9.2")
    (co / ".gitignore").write_text("sglang/_version.py\n")
    git.Repo(co).git.rm("--cached", "-q", "sglang/_version.py")
    commit(git.Repo(co), "the generated version file is not tracked")
    git.Repo(co).git.tag("-f", "v9.9.2")
    (co / "sglang" / "_version.py").write_text(
        "__version__ = version = '9.9.1'\n"
    )  # an earlier pip install -e
    for argv in (["status", str(co)], ["apply", "--check", str(co)], ["run", str(co), "--no-upstream-tests"]):
        code, _, err = run_cli(capsys, *argv)
        line = error_line(err)
        assert code == 2 and "9.9.1" in line and "v9.9.2" in line and "--version" in line, (argv, line)
    code, out, err = run_cli(capsys, "status", str(co), "--version", "9.9.2", "--json")
    assert code == 0 and json.loads(out)["version"] == "9.9.2", err
    (co / "sglang" / "_version.py").write_text("__version__ = version = '9.9.2'\n")  # agrees with the tag
    code, out, _ = run_cli(capsys, "status", str(co), "--json")
    assert code == 0 and json.loads(out)["version"] == "9.9.2"


def test_an_untagged_checkout_says_to_fetch_tags_or_pass_version(tmp_path, cache_dir, capsys, monkeypatch):
    co = tmp_path / "co"
    checkout(co, "9.9.2", upstream_layout=True)  # no tag, version.py's fallback only
    job_run = importlib.import_module("backport.job.run")
    monkeypatch.setattr(
        job_run, "ensure_env", lambda *a, **k: pytest.fail("refused only after the env build")
    )
    for argv in (["apply", str(co)], ["run", str(co), "--no-upstream-tests"]):
        code, _, err = run_cli(capsys, *argv)
        line = error_line(err)
        assert code == 2 and "fetch --tags" in line and "--version" in line and "PEP 440" not in line, line
    code, out, err = run_cli(capsys, "apply", "--check", str(co), "--version", "9.9.2", "--json")
    assert code == 0 and json.loads(out)["version"] == "9.9.2", err
    git.Repo(co).create_tag("v9.9.2")
    code, out, _ = run_cli(capsys, "status", str(co), "--json")
    assert code == 0 and json.loads(out)["version"] == "9.9.2", "the tag, not version.py's 0.0.0.dev0"


def test_an_untagged_git_target_names_the_spec_and_version(tmp_path, cache_dir, capsys, monkeypatch):
    repo = checkout(tmp_path / "co", "9.9.2", upstream_layout=True)
    spec = f"git+file://{tmp_path / 'co'}@{repo.head.commit.hexsha}"
    job_run = importlib.import_module("backport.job.run")
    monkeypatch.setattr(job_run, "ensure_env", lambda python=None, **_: Path(sys.executable))
    code, _, err = run_cli(capsys, "run", spec, "--no-upstream-tests", "--reference", "none")
    line = error_line(err)
    assert code == 2 and spec in line and "--version" in line and "PEP 440" not in line, line
    code, out, err = run_cli(capsys, "apply", spec, "--version", "9.9.2", "--check", "--json")
    assert code == 0 and json.loads(out)["version"] == "9.9.2", err


@pytest.mark.parametrize(("tag", "past", "want"), [("v9.9.2", 0, "9.9.2"), ("v9.9.2", 2, "9.9.2.post0.dev2"),
                                                   ("v9.9.2.post1", 1, "9.9.2.post2.dev1")])
def test_a_checkout_version_is_its_tag(tag, past, want, tmp_path, cache_dir, capsys):
    co = tmp_path / "co"
    repo = checkout(co, "9.9.2", tag=tag, upstream_layout=True)
    for n in range(past):
        (co / f"later{n}.txt").write_text("later\n")
        commit(repo, f"later {n}")
    code, out, err = run_cli(capsys, "status", str(co), "--json")
    assert code == 0 and json.loads(out)["version"] == want, err


def test_version_flag_is_refused_for_a_wheel_target(tmp_path, cache_dir, capsys):
    code, _, err = run_cli(capsys, "run", "sglang==0.5.19", "--version", "0.5.20")
    assert code == 2 and "--version" in error_line(err) and not cache_dir.exists()


@pytest.mark.parametrize("typo", ["sglang=0.5.19", "sglang 0.5.19", "sglang===0.5.19", "sglang:0.5.19"])
def test_a_mistyped_release_spec_suggests_the_double_equals(typo, tmp_path, cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "run", typo)
    assert code == 2 and "did you mean sglang==0.5.19?" in error_line(err)


def test_the_harness_reports_the_given_version_never_the_fallback(tmp_path):
    """probes.runtime.harness --version: the document and the cases get the toolkit's version; without it, an
    upstream checkout's 0.0.0.dev0 is reported as unknown (a case reading it errors, never skips)."""
    import subprocess

    co = tmp_path / "co"
    checkout(co, "9.9.2", upstream_layout=True)
    env = {"PYTHONPATH": str(co / "python"), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}

    def harness(*extra):
        proc = subprocess.run(
            [
                *launch(sys.executable, "harness"),
                "--tree",
                str(co / "python"),
                "--probe",
                "transfer_coverage",
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    assert harness("--version", "0.5.19")["version"] == "0.5.19"
    assert harness()["version"] == "unknown"


def test_tree_version_refuses_the_fallback(monkeypatch):
    from probes import TREE_VERSION_ENV, tree_version

    monkeypatch.setenv(TREE_VERSION_ENV, "0.5.19")
    assert str(tree_version()) == "0.5.19"
    for said in ("0.0.0.dev0", "unknown"):
        monkeypatch.setenv(TREE_VERSION_ENV, said)
        with pytest.raises(RuntimeError, match="unknown"):
            tree_version()


def test_a_checkout_carrying_pack_commits_is_refused_as_pristine(tmp_path, cache_dir, capsys, monkeypatch):
    co = tmp_path / "co"
    repo = checkout(co, "9.9.2", tag="v9.9.2")
    base = repo.head.commit.hexsha
    (co / "sglang" / "srt" / "fix.py").write_text("# a backported fix\n")
    commit(repo, "fix\n\nBackport-Of: sgl-project/sglang#36988\n")
    (co / "sglang" / "srt" / "mine.py").write_text("# the user's own commit on top\n")
    commit(repo, "mine")
    job_run = importlib.import_module("backport.job.run")
    monkeypatch.setattr(
        job_run, "ensure_env", lambda *a, **k: pytest.fail("refused only after the env build")
    )
    code, _, err = run_cli(capsys, "run", str(co), "--no-upstream-tests")
    line = error_line(err)
    assert code == 2 and base in line and "not a pristine release" in line, line


def test_run_head_mode_probes_both_checkouts_as_commits(tmp_path, cache_dir, capsys, monkeypatch):
    """`run BASE --head HEAD` with two checkouts (nothing applied): each is probed as a clone of its
    commit; a commit made in either while the probes run changes nothing probed or recorded."""
    base_repo = checkout(tmp_path / "base", "9.9.2", tag="v9.9.2")
    head_repo = checkout(tmp_path / "head", "9.9.2", tag="v9.9.2")
    (tmp_path / "head" / "sglang" / "srt" / "fixed.py").write_text("# the upstream fix\n")
    head_commit = commit(head_repo, "fix")
    recorded = {"pristine": base_repo.head.commit.hexsha, "patched": head_commit}
    digests = {"pristine": tree_digest(tmp_path / "base"), "patched": tree_digest(tmp_path / "head")}

    def meanwhile():
        for root in (tmp_path / "base", tmp_path / "head"):
            (root / "sglang" / "srt" / "later.py").write_text("# committed while the probes ran\n")
            commit(git.Repo(root), "later")

    seen = stub_matrix(monkeypatch, during=meanwhile)
    code, out, err = run_cli(capsys, "run", str(tmp_path / "base"), "--head", str(tmp_path / "head"),
                             "--out", str(tmp_path / "bundle"), "--reference", "none", "--no-upstream-tests",
                             "--json")
    assert code == 0 and json.loads(out)["result"] == "pass", err
    trees = json.loads((tmp_path / "bundle" / "receipt.json").read_text())["predicate"]["inputs"]["trees"]
    for role in ("pristine", "patched"):
        assert seen[role]["root"] not in (tmp_path / "base", tmp_path / "head")
        assert seen[role]["head"] == recorded[role] and seen[role]["digest"] == digests[role]
        assert trees[role]["tree_digest"] == digests[role]


def test_uncommitted_changes_are_refused_before_the_env_build(tmp_path, cache_dir, capsys, monkeypatch):
    co = tmp_path / "co"
    checkout(co, "9.9.2", tag="v9.9.2")
    (co / "sglang" / "srt" / "wip.py").write_text("# not committed\n")
    job_run = importlib.import_module("backport.job.run")
    monkeypatch.setattr(
        job_run, "ensure_env", lambda *a, **k: pytest.fail("refused only after the env build")
    )
    code, _, err = run_cli(capsys, "run", str(co), "--no-upstream-tests")
    assert code == 2 and "uncommitted changes" in error_line(err) and "wip.py" in err


# ---- run PATH on the real 0.5.19: the recorded commit is what is probed ------------------------------


@pytest.fixture
def real_cache(shared_cache, monkeypatch):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    return shared_cache


@pytest.fixture
def user_checkout(release_tree, tmp_path):
    """A user's checkout of the real 0.5.19 (its one commit is the pristine release)."""
    from backport.tree import clone_tree

    pristine = release_tree("0.5.19")
    co = clone_tree(pristine, tmp_path, tmp_path / "checkout")
    with git.Repo(co.path) as repo, repo.config_writer() as config:
        config.set_value("user", "name", "Me").set_value("user", "email", "me@example.com")
    return co.path, pristine


def stub_matrix(monkeypatch, during=None):
    """The probe matrix stubbed (fixture verdicts), recording each tree as it is when probed;
    `during()` runs first, as something else would while the real matrix runs."""
    from tests.test_evidence import PASSING_CASES, probe_doc

    job_run = importlib.import_module("backport.job.run")
    seen: dict[str, dict] = {}

    def fake(python, roots, probes=None, *, jobs=None, labels=None, coverage=None, versions=None):
        if during is not None:
            during()
        for root, label, version in zip(roots, labels, versions, strict=True):
            role = label.split(" ")[0]
            with git.Repo(root, search_parent_directories=True) as repo:
                seen[role] = {"root": Path(root), "digest": tree_digest(Path(root)), "version": version,
                              "head": repo.head.commit.hexsha}
        return [probe_doc(Path(root), ("pristine", "patched", "reference").index(label.split(" ")[0]),
                          PASSING_CASES) for root, label in zip(roots, labels, strict=True)]

    monkeypatch.setattr(job_run, "run_matrix", fake)
    monkeypatch.setattr(job_run, "ensure_env", lambda python=None, **_: Path(sys.executable))
    return seen


@pytest.mark.network
def test_run_refuses_a_checkout_the_pack_was_applied_to(real_cache, user_checkout, capsys, monkeypatch):
    co, pristine = user_checkout
    assert run_cli(capsys, "apply", str(co))[0] == 0
    job_run = importlib.import_module("backport.job.run")
    monkeypatch.setattr(
        job_run, "ensure_env", lambda *a, **k: pytest.fail("refused only after the env build")
    )
    started = time.monotonic()
    code, _, err = run_cli(capsys, "run", str(co), "--no-upstream-tests")
    line = error_line(err)
    assert code == 2 and pristine.base_commit in line and "Backport-Of" in line, line
    assert time.monotonic() - started < 10


@pytest.mark.network
def test_run_refuses_a_checkout_with_the_pack_squashed_in(real_cache, user_checkout, capsys, monkeypatch):
    """No trailers left (the pack's commits squashed into the user's own, one past the tag): the
    fingerprints of the pack's own fixes, which no release has, still refuse it."""
    co, pristine = user_checkout
    with git.Repo(co) as repo:
        repo.create_tag("v0.5.19")
        assert run_cli(capsys, "apply", str(co))[0] == 0
        repo.git.reset("--soft", pristine.base_commit)
        commit(repo, "our hardening")
    job_run = importlib.import_module("backport.job.run")
    monkeypatch.setattr(
        job_run, "ensure_env", lambda *a, **k: pytest.fail("refused only after the env build")
    )
    code, _, err = run_cli(capsys, "run", str(co), "--no-upstream-tests")
    line = error_line(err)
    assert code == 2 and "by fingerprint" in line and "sbp-transfer-coverage" in line, line


@pytest.mark.network
def test_run_probes_the_recorded_commit_while_the_checkout_is_applied(real_cache, user_checkout, tmp_path,
                                                                      capsys, monkeypatch):
    """An `apply` on the checkout while `run CHECKOUT` probes changes nothing that is probed: the
    pristine role is a clone at the recorded commit, its digest the release's own."""
    from backport.engine import apply_series, detect
    from backport.pack import load_pack

    co, pristine = user_checkout
    pack = load_pack(REPO / "patches")
    seen = stub_matrix(monkeypatch, during=lambda: apply_series(co, pack, "0.5.19"))
    code, out, err = run_cli(capsys, "run", str(co), "--out", str(tmp_path / "bundle"), "--no-upstream-tests",
                             "--reference", "none", "--json")
    assert code == 0 and json.loads(out)["result"] == "pass", err
    with git.Repo(co) as repo:
        assert repo.head.commit.hexsha != pristine.base_commit, "the checkout was applied meanwhile"
    probed = seen["pristine"]
    assert probed["root"] != co and probed["head"] == pristine.base_commit and probed["version"] == "0.5.19"
    assert probed["digest"] == pristine.tree_digest
    p = json.loads((tmp_path / "bundle" / "receipt.json").read_text())["predicate"]
    trees = p["inputs"]["trees"]
    assert trees["pristine"]["tree_digest"] == pristine.tree_digest == probed["digest"]
    assert trees["pristine"]["commit"] == pristine.base_commit
    assert trees["patched"]["tree_digest"] == seen["patched"]["digest"] != pristine.tree_digest
    assert evidence.verify(tmp_path / "bundle").ok
    assert not probed["root"].exists(), "the pristine clone is removed at the end"
    missing = {d.fix for d in detect(pristine.path, pack, version="0.5.19") if not d.present}
    assert "pr36988" in missing  # the cache entry itself was never patched


@pytest.mark.network
def test_a_tree_changed_while_probed_is_a_finding(real_cache, tmp_path, capsys, monkeypatch):
    job_run = importlib.import_module("backport.job.run")
    seen = stub_matrix(monkeypatch)
    real = job_run.run_matrix

    def tamper(python, roots, *args, labels=None, **kwargs):
        docs = real(python, roots, *args, labels=labels, **kwargs)
        patched = seen["patched"]["root"] / "sglang" / "srt" / "disaggregation" / "utils.py"
        patched.write_text(patched.read_text() + "\n# changed while probed\n")
        return docs

    monkeypatch.setattr(job_run, "run_matrix", tamper)
    code, _, err = run_cli(capsys, "run", "sglang==0.5.19", "--out", str(tmp_path / "bundle"),
                           "--no-upstream-tests", "--reference", "none")
    assert code == 1 and "changed while it was probed" in err and "patched" in err, err
    assert not (tmp_path / "bundle").exists()


@pytest.mark.network
@pytest.mark.probe_env
def test_run_on_an_upstream_checkout_applied_while_probed(real_cache, probe_python, release_tree, tmp_path,
                                                          capsys, monkeypatch):
    """Rows 1, 2 and 9 of issue 43 for real: an upstream-layout v0.5.19 checkout (no generated
    `_version.py`, so `sglang.version` says 0.0.0.dev0), applied in place while `run` probes it. The
    pristine role is the recorded commit (cases unsafe, digest the release's), and no case is skipped
    as "before 0.5.16" on the strength of the fallback version."""
    import shutil

    from backport.engine import apply_series
    from backport.pack import load_pack

    pristine = release_tree("0.5.19")
    co = tmp_path / "sglang"
    shutil.copytree(pristine.package_root / "sglang", co / "python" / "sglang")
    (co / "python" / "sglang" / "_version.py").unlink()
    (co / ".gitignore").write_text("python/sglang/_version.py\n")
    repo = git.Repo.init(co)
    base = commit(repo, "upstream v0.5.19")
    repo.create_tag("v0.5.19")
    job_run = importlib.import_module("backport.job.run")
    real = job_run.run_matrix

    def applied_meanwhile(*args, **kwargs):
        report = apply_series(co, load_pack(REPO / "patches"), "0.5.19", package_prefix="python/")
        assert report.status == "applied"
        return real(*args, **kwargs)

    monkeypatch.setattr(job_run, "run_matrix", applied_meanwhile)
    code, out, err = run_cli(
        capsys,
        "run",
        str(co),
        "--out",
        str(tmp_path / "bundle"),
        "--python",
        probe_python,
        "--no-upstream-tests",
        "--reference",
        "none",
        "--json",
    )
    assert code == 0 and json.loads(out)["result"] == "pass", err[-3000:]
    assert repo.head.commit.hexsha != base
    p = json.loads((tmp_path / "bundle" / "receipt.json").read_text())["predicate"]
    assert p["inputs"]["trees"]["pristine"]["commit"] == base
    pristine_doc = json.loads((tmp_path / "bundle" / "probes" / "pristine.json").read_text())
    patched_doc = json.loads((tmp_path / "bundle" / "probes" / "patched.json").read_text())
    assert pristine_doc["version"] == patched_doc["version"] == "0.5.19"
    unsafe = [c["case"] for c in pristine_doc["cases"] if c["verdict"] == "unsafe"]
    assert len(unsafe) >= 10, "the pristine release shows the exposure"
    skipped = [c["case"] for c in patched_doc["cases"] if "0.5.16" in (c.get("observed") or "")
               and c["verdict"] == "not-applicable"]
    assert skipped == []
    assert evidence.verify(tmp_path / "bundle").ok
