"""The pack: a corpus of malformed packs (each bad input, exit 2), then the real pack on the
real release wheels.

The corpus (CORPUS) is a table: each case breaks one thing of a small valid pack and names
what the one-line error must say; every case is refused by the loader (BadInput naming the
file) and by the CLI (`status --series PACK --json`: exit 2 and one JSON error document).
`pytest tests/test_pack.py -k corpus -s` prints the number of cases.

The real pack: each release of the matrix (patches/releases.toml) is fetched from PyPI
(verified against its pin), cloned, and given the whole series by the engine; test_matrix.py
checks the per-fix outcomes against the matrix, this file what every applied series must be
(one commit per applied fix with its trailers, a clean tree, compiling files, a re-run that is
nothing-to-do).
"""

from __future__ import annotations

import json
import py_compile
import subprocess
from collections.abc import Callable
from pathlib import Path

import git
import pytest

from backport.cli import main
from backport.engine import apply_series, detect
from backport.errors import BadInput
from backport.expectations import representatives
from backport.pack import load_pack
from backport.releases import load_pins, load_releases
from tests.conftest import REPO
from tests.engine_helpers import FIX_COMMIT

# ------------------------------------------------------------------ corpus

MOD = "sglang/srt/disaggregation/prefill.py"


def _header(pr: int, depends: str = "none", **over: str) -> str:
    fields = {
        "Description": f"Fix {pr}",
        "Origin": f"upstream, https://github.com/sgl-project/sglang/pull/{pr}, commit {FIX_COMMIT[:10]}",
        "Bug": f"https://github.com/sgl-project/sglang/pull/{pr}",
        "Applies-To": ">=0.5.17",
        "Depends-On": depends,
        "Last-Update": "2026-11-30",
        **over,
    }
    return "".join(f"{k}: {v}\n" for k, v in fields.items() if v is not None) + "---\n"


def _diff(path: str = MOD, old: str = "    x = 1", new: str = "    x = 1  # fixed") -> str:
    return (f"diff --git a/{path} b/{path}\nindex 1111111..2222222 100644\n--- a/{path}\n+++ b/{path}\n"
            f"@@ -1,3 +1,3 @@\n def f():\n-{old}\n+{new}\n     return x\n")


GOOD_FIXES = f"""\
[[fix]]
id = "pr100"
title = "Fix one"
pr = 100
upstream_commit = "{FIX_COMMIT}"
fixed_in = ""
depends_on = []
fingerprint = [{{ file = "sglang/srt/disaggregation/prefill.py", pattern = "fixed" }}]

[[fix]]
id = "pr200"
title = "Fix two"
pr = 200
upstream_commit = "{FIX_COMMIT}"
fixed_in = ">=0.5.22"
depends_on = ["pr100"]
"""


def good_pack(root: Path) -> Path:
    (root / "pr100").mkdir(parents=True)
    (root / "pr200").mkdir()
    (root / "series").write_text("# the series\npr100\npr200\n")
    (root / "fixes.toml").write_text(GOOD_FIXES)
    (root / "pr100" / "pr100-0.5.17.patch").write_text(_header(100) + _diff())
    (root / "pr200" / "pr200-0.5.17.patch").write_text(
        _header(200, "pr100") + _diff(old="    y = 2", new="    y = 3"))
    return root


P1, P2 = "pr100/pr100-0.5.17.patch", "pr200/pr200-0.5.17.patch"


def put(name: str, text: str | bytes) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return edit


def sub(name: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        text = (root / name).read_text()
        assert old in text, (name, old)
        (root / name).write_text(text.replace(old, new, 1))
    return edit


def patch1(body: str, **over: str) -> Callable[[Path], None]:
    return put(P1, _header(100, **over) + body)


def fixes_with(extra: str, fix: str = "pr100") -> Callable[[Path], None]:
    """Add lines to one fix's table in fixes.toml."""
    return sub("fixes.toml", f'id = "{fix}"\n', f'id = "{fix}"\n{extra}\n')


TRUNC = f"diff --git a/{MOD} b/{MOD}\n--- a/{MOD}\n+++ b/{MOD}\n@@ -1,3 +1,3 @@\n def f():\n-    x = 1\n"
# (case id, the defect, text the one-line error must contain, the file it must name)
CORPUS: list[tuple[str, Callable[[Path], None], str, str]] = [
    # series
    ("series-empty", put("series", "# nothing here\n\n"), "lists no fix", "series"),
    ("series-not-utf8", put("series", b"pr100\n\xff\xfe\n"), "not UTF-8", "series"),
    ("series-unknown-fix", put("series", "pr100\npr999\n"), "has no entry", "series"),
    ("series-twice", put("series", "pr100\npr100\npr200\n"), "listed twice", "series"),
    ("series-order", put("series", "pr200\npr100\n"), "before its dependency", "series"),
    ("series-missing", lambda root: (root / "series").unlink(), "missing", "series"),
    # fixes.toml
    ("fixes-not-toml", put("fixes.toml", "[[fix]\nid = 1\n"), "not valid TOML", "fixes.toml"),
    (
        "fixes-not-utf8",
        put("fixes.toml", b"[[fix]]\nid = \"pr100\"\ntitle = \"\xff\"\n"),
        "not UTF-8",
        "fixes.toml",
    ),
    ("fixes-empty", put("fixes.toml", "# no fixes\n"), "no [fixes", "fixes.toml"),
    ("fixes-missing", lambda root: (root / "fixes.toml").unlink(), "missing", "fixes.toml"),
    (
        "fixes-self-dependency",
        sub("fixes.toml", 'depends_on = ["pr100"]', 'depends_on = ["pr200"]'),
        "depends on itself",
        "fixes.toml",
    ),
    (
        "fixes-cycle",
        sub("fixes.toml", "depends_on = []", 'depends_on = ["pr200"]'),
        "dependency cycle",
        "fixes.toml",
    ),
    (
        "fixes-unknown-dependency",
        sub("fixes.toml", 'depends_on = ["pr100"]', 'depends_on = ["pr404"]'),
        "which has no entry",
        "fixes.toml",
    ),
    ("fixes-missing-title", sub("fixes.toml", 'title = "Fix one"\n', ""), "missing title", "fixes.toml"),
    (
        "fixes-empty-title",
        sub("fixes.toml", 'title = "Fix one"', 'title = " "'),
        "title is empty",
        "fixes.toml",
    ),
    ("fixes-missing-pr", sub("fixes.toml", "pr = 100\n", ""), "missing pr", "fixes.toml"),
    ("fixes-pr-string", sub("fixes.toml", "pr = 100", 'pr = "100"'), "not a positive integer", "fixes.toml"),
    ("fixes-pr-bool", sub("fixes.toml", "pr = 100", "pr = true"), "not a positive integer", "fixes.toml"),
    (
        "fixes-missing-commit",
        sub("fixes.toml", f'upstream_commit = "{FIX_COMMIT}"\n', ""),
        "missing upstream_commit",
        "fixes.toml",
    ),
    ("fixes-unknown-key", fixes_with('colour = "blue"'), "unknown key 'colour'", "fixes.toml"),
    (
        "fixes-unknown-top-level",
        lambda root: (root / "fixes.toml").write_text("version = 1\n" + GOOD_FIXES),
        "unknown top-level key",
        "fixes.toml",
    ),
    (
        "fixes-fixed-in-type",
        sub("fixes.toml", 'fixed_in = ""', "fixed_in = 20"),
        "must be a string",
        "fixes.toml",
    ),
    (
        "fixes-fixed-in-spec",
        sub("fixes.toml", 'fixed_in = ""', 'fixed_in = "~=banana"'),
        "PEP 440",
        "fixes.toml",
    ),
    ("fixes-scope-spec", fixes_with('scope = "newer please"'), "PEP 440", "fixes.toml"),
    (
        "fixes-depends-on-string",
        sub("fixes.toml", 'depends_on = ["pr100"]', 'depends_on = "pr100"'),
        "depends_on must be a list",
        "fixes.toml",
    ),
    ("fixes-url-type", fixes_with("url = 5"), "url must be a string", "fixes.toml"),
    ("fixes-bad-id", sub("fixes.toml", 'id = "pr200"', 'id = "PR 200!"'), "not a valid fix id", "fixes.toml"),
    (
        "fixes-defined-twice",
        lambda root: (root / "fixes.toml").write_text(GOOD_FIXES + GOOD_FIXES.split("\n\n")[0] + "\n"),
        "defined twice",
        "fixes.toml",
    ),
    (
        "fixes-fingerprint-outside",
        sub("fixes.toml", 'file = "sglang/srt', 'file = "tools/srt'),
        "outside the package directory",
        "fixes.toml",
    ),
    (
        "fixes-fingerprint-regex",
        sub("fixes.toml", 'pattern = "fixed"', 'pattern = "(unclosed"'),
        "fingerprint pattern",
        "fixes.toml",
    ),
    (
        "fixes-fingerprint-key",
        sub("fixes.toml", 'pattern = "fixed"', 'pattern = "fixed", regex = true'),
        "unknown key 'regex'",
        "fixes.toml",
    ),
    (
        "fixes-fingerprint-type",
        sub(
            "fixes.toml",
            'fingerprint = [{ file = "sglang/srt/disaggregation/prefill.py", pattern = "fixed" }]',
            'fingerprint = "fixed"',
        ),
        "fingerprint must be a list",
        "fixes.toml",
    ),
    (
        "fixes-upstream-tests-type",
        fixes_with('upstream_tests = "test_x.py"'),
        "upstream_tests must be a list",
        "fixes.toml",
    ),
    # a header that restates fixes.toml differently
    (
        "header-origin-commit",
        patch1(_diff(), Origin="upstream, https://github.com/sgl-project/sglang/pull/100, commit deadbeef00"),
        f"Origin names commit deadbeef00, fixes.toml [pr100] upstream_commit is {FIX_COMMIT}",
        P1,
    ),
    (
        "header-origin-url",
        patch1(_diff(), Origin="upstream, https://github.com/sgl-project/sglang/pull/101"),
        "fixes.toml [pr100] url is https://github.com/sgl-project/sglang/pull/100",
        P1,
    ),
    ("header-bug", patch1(_diff(), Bug="https://github.com/sgl-project/sglang/issues/7"), "Bug is", P1),
    (
        "header-depends-on",
        put(P2, _header(200, "none") + _diff(old="    y = 2", new="    y = 3")),
        "Depends-On is none, fixes.toml [pr200] depends_on is pr100",
        P2,
    ),
    ("header-depends-on-extra", patch1(_diff(), **{"Depends-On": "pr200"}), "Depends-On is pr200", P1),
    # header
    ("header-no-end", put(P1, _header(100).replace("---\n", "") + _diff()), "no '---' line", P1),
    ("header-not-a-field", put(P1, "Just some words\n" + _header(100) + _diff()), "not 'Field: value'", P1),
    ("header-field-twice", put(P1, "Origin: x\n" + _header(100) + _diff()), "given twice", P1),
    *[
        (f"header-missing-{f.lower()}", patch1(_diff(), **{f: None}), f"missing header field {f}", P1)
        for f in ("Description", "Origin", "Applies-To", "Depends-On", "Last-Update")
    ],
    ("header-applies-to", patch1(_diff(), **{"Applies-To": "~=banana"}), "Applies-To", P1),
    ("header-last-update", patch1(_diff(), **{"Last-Update": "yesterday"}), "Last-Update", P1),
    ("header-depends-on-id", patch1(_diff(), **{"Depends-On": "Fix 100"}), "not a fix id", P1),
    ("patch-not-utf8", put(P1, _header(100).encode() + b"\xff" + _diff().encode()), "not UTF-8", P1),
    ("patch-nul", put(P1, _header(100) + _diff().replace("def f", "def\0f")), "NUL", P1),
    # confinement: nothing outside sglang/
    (
        "confine-root-conftest",
        patch1("--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+import os\n"),
        "conftest.py is outside the package directory sglang/",
        P1,
    ),
    (
        "confine-sibling-package",
        patch1(_diff(path="sglang_evil/__init__.py")),
        "outside the package directory",
        P1,
    ),
    (
        "confine-absolute",
        patch1(_diff(path="/etc/passwd").replace("a//etc", "/etc").replace("b//etc", "/etc")),
        "absolute path",
        P1,
    ),
    ("confine-absolute-after-prefix", patch1(_diff(path="/etc/passwd")), "absolute path", P1),
    ("confine-dotdot", patch1(_diff(path="sglang/../../outside.py")), "'..'", P1),
    ("confine-dot-git", patch1(_diff(path="sglang/.git/hooks/pre-commit")), ".git", P1),
    (
        "confine-no-prefix",
        patch1(f"--- {MOD}\n+++ {MOD}\n@@ -1 +1 @@\n-a\n+b\n"),
        "lacks the 'a/' prefix",
        P1,
    ),
    # diff structure
    ("diff-truncated-mid-line", patch1(_diff()[:-8]), "truncated in the middle of a line", P1),
    ("diff-truncated-hunk", patch1(TRUNC), "truncated hunk", P1),
    ("diff-counts-lie-more", patch1(_diff() + "+    z = 3\n"), "wrong line counts", P1),
    (
        "diff-counts-lie-less",
        patch1(_diff().replace("@@ -1,3 +1,3 @@", "@@ -1,2 +1,2 @@")),
        "line counts",
        P1,
    ),
    (
        "diff-malformed-hunk-header",
        patch1(_diff().replace("@@ -1,3 +1,3 @@", "@@ -1 +1 @ broken")),
        "malformed hunk header",
        P1,
    ),
    ("diff-empty", patch1(""), "no diff", P1),
    ("diff-words", patch1("just words, no diff\n"), "no diff", P1),
    ("diff-hunk-before-file", patch1("@@ -1 +1 @@\n-a\n+b\n"), "before any file header", P1),
    (
        "diff-binary",
        patch1(
            f"diff --git a/{MOD} b/{MOD}\nindex 1111111..2222222 100644\n"
            f"Binary files a/{MOD} and b/{MOD} differ\n"
        ),
        "binary",
        P1,
    ),
    (
        "diff-git-binary-patch",
        patch1(
            f"diff --git a/{MOD} b/{MOD}\nindex 1111111..2222222 100644\n"
            f"GIT binary patch\nliteral 3\nKcmZ>f|Nj6O\n\n"
        ),
        "binary",
        P1,
    ),
    (
        "diff-rename",
        patch1(
            f"diff --git a/{MOD} b/sglang/x.py\nsimilarity index 100%\nrename from {MOD}\n"
            f"rename to sglang/x.py\n"
        ),
        "renames",
        P1,
    ),
    (
        "diff-symlink",
        patch1(
            "diff --git a/sglang/l b/sglang/l\nnew file mode 120000\n--- /dev/null\n"
            "+++ b/sglang/l\n@@ -0,0 +1 @@\n+/etc\n"
        ),
        "mode 120000",
        P1,
    ),
    (
        "diff-submodule",
        patch1(
            "diff --git a/sglang/m b/sglang/m\nnew file mode 160000\n--- /dev/null\n"
            "+++ b/sglang/m\n@@ -0,0 +1 @@\n+Subproject commit " + "0" * 40 + "\n"
        ),
        "mode 160000",
        P1,
    ),
    (
        "diff-mode-change",
        patch1(f"diff --git a/{MOD} b/{MOD}\nold mode 100644\nnew mode 100755\n"),
        "mode change",
        P1,
    ),
    (
        "diff-git-header-junk",
        patch1(_diff().replace("index 1111111..2222222 100644\n", "hello there\n")),
        "unexpected line in git header",
        P1,
    ),
    (
        "diff-header-disagrees",
        patch1(_diff().replace(f"--- a/{MOD}", "--- a/sglang/other.py")),
        "disagrees",
        P1,
    ),
    # git apply's "inconsistent filename": the git header names one file, the ---/+++ lines another
    (
        "diff-git-header-names-escape",
        patch1(
            _diff().replace(f"diff --git a/{MOD} b/{MOD}", "diff --git a/../h3_escape.py b/../h3_escape.py")
        ),
        "inconsistent file names",
        P1,
    ),
    ("diff-file-twice", patch1(_diff() + _diff(old="    y = 2", new="    y = 3")), "appears twice", P1),
    (
        "diff-changes-nothing",
        patch1(_diff(new="    x = 1").replace("-    x = 1\n+    x = 1\n", "     x = 1\n")),
        "changes nothing",
        P1,
    ),
    (
        "diff-creation-with-old-lines",
        patch1("--- /dev/null\n+++ b/sglang/new.py\n@@ -1 +1 @@\n-a\n+b\n"),
        "creation of sglang/new.py has a hunk with old lines",
        P1,
    ),
]


def test_corpus_size():
    print(f"\nmalformed-pack corpus: {len(CORPUS)} cases, each exit 2")
    assert len(CORPUS) == len({name for name, *_ in CORPUS}) >= 70


def test_corpus_base_pack_is_valid(tmp_path):
    pack = load_pack(good_pack(tmp_path / "pack"))
    assert pack.series == ("pr100", "pr200") and [len(pack.variants[f]) for f in pack.series] == [1, 1]


@pytest.mark.parametrize("name,defect,needle,names", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_malformed_pack_is_bad_input(tmp_path, name, defect, needle, names):
    root = good_pack(tmp_path / "pack")
    defect(root)
    with pytest.raises(BadInput) as e:
        load_pack(root)
    msg = str(e.value)
    assert needle in msg and str(root / names) in msg and "\n" not in msg, msg


@pytest.mark.parametrize("name,defect,needle,names", CORPUS[::7], ids=[c[0] for c in CORPUS[::7]])
def test_corpus_cli_exits_2_with_one_json_document(tmp_path, capsys, name, defect, needle, names):
    root = good_pack(tmp_path / "pack")
    defect(root)
    tree = tmp_path / "tree"
    (tree / "sglang").mkdir(parents=True)
    assert main(["status", str(tree), "--series", str(root), "--json"]) == 2
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["error"]["code"] == 2 and needle in doc["error"]["message"]
    assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------- the real pack

RELEASES = load_releases()
MEASURED = [v for v, r in RELEASES.items() if r.measured]
# an exposed release (a fix with no variant for it) gets no patched tree; tests/test_matrix.py checks its
# refusal
SERVED = [v for v in MEASURED if not RELEASES[v].exposed]
IMPORTS = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
           "sglang.srt.disaggregation.common.conn", "sglang.srt.disaggregation.mooncake.conn",
           "sglang.srt.disaggregation.nixl.conn", "sglang.srt.disaggregation.fake.conn",
           "sglang.srt.managers.scheduler")


def test_shipped_pack_loads_confined_and_agreeing():
    """The shipped pack passes the loader's rules (headers agree with fixes.toml, paths in sglang/)."""
    pack = load_pack(REPO / "patches")
    assert set(pack.series) == set(pack.fixes)
    paths = {fp.path for vs in pack.variants.values() for pv in vs for fp in pv.files}
    assert paths and all(p.startswith("sglang/") for p in paths)
    for fid, variants in pack.variants.items():
        for pv in variants:
            own = set(pv.depends_on) - set(pack.fixes[fid].depends_on)
            assert set(pack.fixes[fid].depends_on) <= set(pv.depends_on)
            # a variant's own dependency: applied earlier, in scope wherever the variant applies
            assert all(pack.series.index(d) < pack.series.index(fid) for d in own), (pv.name, own)
            assert all(pack.fixes[d].in_scope(v) for d in own for v in load_pins() if pv.applies(v)), pv.name


@pytest.mark.parametrize("version", SERVED)
@pytest.mark.probe_env
@pytest.mark.network
def test_whole_pack_on_release(version, patched_tree):
    tree, report = patched_tree(version)
    applied = [p for p in report.patches if p.status == "applied"]
    assert report.status == ("applied" if applied else "nothing-to-do")
    pack = load_pack(REPO / "patches")
    for patch in report.patches:
        fix = pack.fixes[patch.fix]
        if patch.status == "not-applicable" and not fix.in_scope(version) and not fix.is_fixed_in(version):
            assert "no backport" in patch.reason and "exposed" in patch.reason, patch  # said out loud
    repo = git.Repo(tree.path)
    commits = list(repo.iter_commits(f"{tree.base_commit}..HEAD"))
    assert len(commits) == len(applied)
    for commit, patch in zip(reversed(commits), applied):
        if pack.fixes[patch.fix].is_vendor:  # the pack's own fix: no upstream PR to name
            assert f"Vendor-Fix: {patch.fix}" in commit.message and "Backport-Of:" not in commit.message
        else:
            # the PR, not the fix id: #35049's groundwork parts share its PR
            assert f"Backport-Of: sgl-project/sglang#{pack.fixes[patch.fix].pr}" in commit.message
            assert "Upstream-Commit:" in commit.message
        assert f"Backport-Variant: {patch.variant}" in commit.message
    assert not repo.is_dirty(untracked_files=True)
    touched = {f for c in commits for f in c.stats.files}
    assert all(f.startswith("sglang/") for f in touched)
    for rel in sorted(touched):  # every file the pack touched compiles
        py_compile.compile(str(tree.path / rel), doraise=True, cfile=str(tree.path / ".pyc-check"))
    (tree.path / ".pyc-check").unlink(missing_ok=True)


# The page-lifetime pack patches the transport modules (mooncake, nixl, fake) that no probe
# imports on every release; the other releases' patched modules are imported by every probe run
# (tests/test_matrix.py), so only these are imported here, on one release per code epoch.
@pytest.mark.parametrize("version", [v for v in representatives(load_pack(REPO / "patches"), RELEASES)
                                     if RELEASES[v].apply.get("pr41402") == "applied"])
@pytest.mark.probe_env
@pytest.mark.network
def test_patched_release_imports_on_cpu(version, patched_tree, probe_python, tmp_path):
    from backport.probing.harness import probe_environ

    tree, _ = patched_tree(version)
    code = f"import importlib\nfor m in {IMPORTS!r}: importlib.import_module(m)\nprint('ok')"
    proc = subprocess.run([probe_python, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=probe_environ(probe_python, tree.package_root, tmp_path), timeout=600,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("version", ["0.5.19", "0.5.20"])
@pytest.mark.probe_env
@pytest.mark.network
def test_reapply_is_nothing_to_do_and_status_sees_every_fix(version, patched_tree):
    tree, _ = patched_tree(version)
    head = git.Repo(tree.path).head.commit.hexsha
    again = apply_series(tree.path, load_pack(REPO / "patches"), version)
    assert again.status == "nothing-to-do"
    assert {p.status for p in again.patches} <= {"already-present", "not-applicable"}
    assert git.Repo(tree.path).head.commit.hexsha == head
    pack = load_pack(REPO / "patches")
    found = {d.fix: d.present for d in detect(tree.package_root, pack)
             if pack.fixes[d.fix].is_fixed_in(version) or pack.fixes[d.fix].in_scope(version)}
    assert found and all(found.values()), found


@pytest.mark.parametrize("version", ["0.5.17", "0.5.19"])
@pytest.mark.probe_env
@pytest.mark.network
def test_pristine_release_lacks_the_incident_fixes(version, release_tree):
    found = {
        d.fix: d.present for d in detect(release_tree(version).package_root, load_pack(REPO / "patches"))
    }
    assert found["pr36988"] is False and found["pr38935"] is False


@pytest.mark.probe_env
@pytest.mark.network
def test_cli_apply_on_a_spec_works_on_a_fresh_clone(
    shared_cache, release_tree, monkeypatch, tmp_path, capsys
):
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
