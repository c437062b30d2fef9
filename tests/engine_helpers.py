"""Helpers for tests/test_engine.py: real git repositories and small packs.

Patches are made by ``git diff`` in a scratch repository, as a maintainer
would make them, then wrapped in a DEP-3 header.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import textwrap
from pathlib import Path

import git

PKG = "sglang/srt/disaggregation"
FIX_COMMIT = "0123456789abcdef0123456789abcdef01234567"  # every test fix's upstream_commit
ENV = {
    "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.invalid",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}


def module_text(n: int = 40, name: str = "f") -> str:
    """A Python module of n small, distinct functions (4 lines each)."""
    return "".join(f"def {name}{i}():\n    x = {i}\n    return x\n\n" for i in range(n))


def run_git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    env = dict(os.environ, **ENV)
    p = subprocess.run(["git", "-C", str(cwd), *args], input=input, capture_output=True, env=env, check=True)
    return p.stdout.decode()


def make_repo(path: Path, files: dict[str, str | bytes], prefix: str = "") -> Path:
    """A git repo whose first commit holds ``files`` (paths under prefix)."""
    path.mkdir(parents=True, exist_ok=True)
    run_git(path, "init", "-q", "-b", "main")
    run_git(path, "config", "core.autocrlf", "false")
    write_files(path, {prefix + k: v for k, v in files.items()})
    (path / prefix / "sglang").mkdir(parents=True, exist_ok=True)
    (path / prefix / "sglang" / "__init__.py").touch()
    run_git(path, "add", "-A")
    run_git(path, "commit", "-q", "-m", "pristine")
    return path


def write_files(root: Path, files: dict[str, str | bytes | None]) -> None:
    for rel, content in files.items():
        f = root / rel
        if content is None:
            f.unlink()
            continue
        f.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            f.write_bytes(content.encode())
        else:
            f.write_bytes(content)


def diff_of(tmp: Path, before: dict[str, str | bytes], after: dict[str, str | bytes | None]) -> str:
    """``git diff`` text for before -> after (paths relative to the package root)."""
    key = repr((sorted(before.items()), sorted(after.items()))).encode()
    d = tmp / f"scratch-{hashlib.sha1(key).hexdigest()[:10]}"
    if d.exists():
        import shutil
        shutil.rmtree(d)
    d.mkdir(parents=True)
    run_git(d, "init", "-q")
    run_git(d, "config", "core.autocrlf", "false")
    write_files(d, dict(before))
    run_git(d, "add", "-A")
    run_git(d, "commit", "-q", "--allow-empty", "-m", "before")
    write_files(d, dict(after))
    run_git(d, "add", "-A")
    return run_git(d, "diff", "--cached", "--no-color", "--no-renames", "--binary")


def header(description: str = "Fix a thing", applies_to: str = ">=0.5.17", depends_on: str = "none",
           last_update: str = "2026-11-30", pr: int = 100, notes: str | None = "Same as upstream.",
           drop: tuple[str, ...] = ()) -> str:
    fields = {
        "Description": description + "\n a longer explanation of the fix",
        # agrees with make_pack's fixes.toml entry for pr<pr> (the commit abbreviated)
        "Origin": f"upstream, https://github.com/sgl-project/sglang/pull/{pr}, commit {FIX_COMMIT[:10]}",
        "Bug": f"https://github.com/sgl-project/sglang/pull/{pr}",
        "Applies-To": applies_to,
        "Depends-On": depends_on,
        "Last-Update": last_update,
    }
    if notes:
        fields["Backport-Notes"] = notes
    return "".join(f"{k}: {v}\n" for k, v in fields.items() if k not in drop) + "---\n"


def make_pack(root: Path, fixes: list[dict], patches: dict[str, dict[str, str]]) -> Path:
    """fixes: dicts with id, pr, title, fixed_in, depends_on, fingerprint;
    patches: {fix_id: {file_name: full patch text}}."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "series").write_text("# test series\n" + "".join(f["id"] + "\n" for f in fixes))
    (root / "fixes.toml").write_text("".join(make_fix_table(**f) for f in fixes))
    for fid, files in patches.items():
        d = root / fid
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    return root


def make_fix_table(id: str, **f) -> str:
    """One fix's [fixes.<id>] table: keys title, pr, commit, fixed_in, scope, depends_on, fingerprint."""
    out = [f"[fixes.{id}]", f"title = {f.get('title', 'Fix ' + id)!r}".replace("'", '"'),
           f"pr = {f.get('pr', int(id[2:]) if id[2:].isdigit() else 1)}",
           f'upstream_commit = "{f.get("commit", FIX_COMMIT)}"', f'fixed_in = "{f.get("fixed_in", "")}"']
    if "scope" in f:
        out.append(f'scope = "{f["scope"]}"')
    out.append("depends_on = [" + ", ".join(f'"{d}"' for d in f.get("depends_on", [])) + "]")
    out.append("fingerprint = [" + ", ".join("{{ file = {}, pattern = {} }}".format(
        _toml_str(r["file"]), _toml_str(r["pattern"])) for r in f.get("fingerprint", [])) + "]")
    return "\n".join(out) + "\n\n"


def _toml_str(s: str) -> str:
    return "'" + s + "'"  # literal string: no escapes


def snapshot(repo: Path) -> dict:
    """Everything apply must leave alone on failure: files, index, HEAD."""
    files = {}
    for p in sorted(repo.rglob("*")):
        rel = p.relative_to(repo).as_posix()
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if p.is_symlink():
            files[rel] = ("link", os.readlink(p))
        elif p.is_file():
            files[rel] = (p.stat().st_mode, p.read_bytes())
        else:
            files[rel] = ("dir",)
    r = git.Repo(repo)
    try:
        head = r.head.commit.hexsha
        ref = r.git.symbolic_ref("HEAD")
    finally:
        r.close()
    return {"files": files, "index": (repo / ".git" / "index").read_bytes(), "head": head, "ref": ref,
            "branch": run_git(repo, "rev-parse", "refs/heads/main").strip()}


def dedent(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


# ------------------------------------------------------- fault injection

APPLY_SCRIPT = ("import sys\nfrom pathlib import Path\nfrom backport.engine import apply_series\n"
                "from backport.pack import load_pack\n"
                "print(apply_series(Path(sys.argv[1]), load_pack(sys.argv[2]), '0.5.19').status)\n")


def work_files(repo: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of the work tree outside .git: (mode, bytes)."""
    return {p.relative_to(repo).as_posix(): (p.stat().st_mode, p.read_bytes())
            for p in sorted(repo.rglob("*")) if p.is_file() and ".git" not in p.relative_to(repo).parts}


def leftovers(repo: Path) -> list[str]:
    """What an apply must never leave behind once recovered: locks (the index's, HEAD's, a
    branch's), journal, pending ref, temporary pack files, a pack without its index."""
    git_dir = repo / ".git"
    found = [n for n in ("index.lock", "HEAD.lock", "sglang-backport-apply.json", "sglang-backport-index",
                         "sglang-backport-index.lock") if (git_dir / n).exists()]
    found += [p.relative_to(git_dir).as_posix() for p in (git_dir / "refs").rglob("*.lock")]
    found += run_git(repo, "for-each-ref", "--format=%(refname)", "refs/sglang-backport/").split()
    pack_dir = git_dir / "objects" / "pack"
    found += [p.name for p in pack_dir.glob("tmp_*")]
    found += [p.name for p in pack_dir.glob("*.pack") if not p.with_suffix(".idx").exists()]
    return found


def tree_state(repo: Path, pristine: dict, patched: dict) -> str:
    """"pristine", "patched" (files, HEAD, index all agree with one of them) or "half"."""
    head = run_git(repo, "rev-parse", "HEAD").strip()
    clean = run_git(repo, "status", "--porcelain", "--untracked-files=all") == ""
    files = work_files(repo)
    for name, want in (("pristine", pristine), ("patched", patched)):
        if head == want["head"] and files == want["files"] and clean:
            return name
    return "half"


def git_wrapper(bin_dir: Path, marker: Path, command: str, when: str) -> dict[str, str]:
    """Environment with a `git` first on PATH that, for the git subcommand
    ``command``, sleeps before running the real git (when="pre") or after it
    returned ("post"), having touched ``marker`` so the test knows when."""
    import shutil

    real = shutil.which("git")
    bin_dir.mkdir(parents=True, exist_ok=True)
    hit = f'case " $* " in *" {command} "*) touch "{marker}"; sleep 60;; esac\n'
    body = (hit + f'"{real}" "$@"\nrc=$?\n') if when == "pre" else (f'"{real}" "$@"\nrc=$?\n' + hit)
    script = bin_dir / "git"
    script.write_text("#!/bin/sh\n" + body + "exit $rc\n")
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
