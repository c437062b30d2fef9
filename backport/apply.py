"""Apply the patch series to a git tree: drift-tolerant, all or nothing.

Decisions (see also placement.py for hunk placement):

* Per fix, in series order: ``not-applicable`` when the version is in
  ``fixed_in``; ``already-present`` when the fingerprint matches or the
  chosen variant reverse-applies cleanly (exact/offset, no fuzz; when no
  variant covers the version, any variant that reverse-applies counts);
  a dependency check (fix ``depends_on`` plus the variant's Depends-On: each
  must be applied earlier in this run, already present, or not applicable,
  else ``failed``); then the variant whose Applies-To contains the version
  (none: ``failed`` with the reason).
* Everything is computed in memory on an overlay of the tree, later fixes
  seeing earlier ones. Nothing is written unless every fix succeeds.
* On success the commits are built first as git objects (blobs, trees,
  commits; unreferenced objects change neither files, index nor HEAD), then
  the working files are written, the index entries of exactly those paths
  updated, and HEAD moved with a compare-and-swap ``update-ref``. Any error
  in that last step restores the files, the index file and HEAD.
* Commits: author and committer ``sglang-backport <sglang-backport@localhost>``,
  date = the variant's Last-Update at 00:00:00 UTC, no signing: the same
  base commit and the same pack give the same commit SHAs.
* A user's checkout with uncommitted changes to tracked files is refused
  (BadInput) unless ``allow_dirty``; even then a patch touching a file with
  uncommitted changes, or a file that git does not track, fails.
  Untracked files elsewhere do not make a tree dirty.
* ``check=True`` runs everything up to the writes and returns the report
  (``check: true`` in the JSON; patch statuses say what would happen; no
  commit SHAs).
* Security (before anything else, BadInput): patch paths are validated when
  the pack loads (absolute, ``..``, ``.git``, binary, malformed); here every
  path of every variant of the selected fixes is checked against the tree for
  symlinks: a path through a symlink is refused, and the message says whether
  it leads outside the tree.
"""

from __future__ import annotations

import datetime as _dt
import os
import subprocess
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Sequence

from packaging.version import InvalidVersion, Version

from .detect import fingerprint_match
from .errors import BadInput
from .placement import CONFLICT, EXACT, FileImage, Hunk, place_hunks, apply_hunks
from .series import FilePatch, Fix, Pack, PatchVariant, check_rel_path

AUTHOR_NAME = "sglang-backport"
AUTHOR_EMAIL = "sglang-backport@localhost"
UPSTREAM_REPO = "sgl-project/sglang"

APPLIED, PRESENT, NOT_APPLICABLE, FAILED = "applied", "already-present", "not-applicable", "failed"
REPORT_SCHEMA = "sglang-backport/apply-report/1"


# ------------------------------------------------------------------ report


@dataclass(frozen=True)
class HunkResult:
    file: str  # path relative to the package root, as in the patch
    status: str  # exact | offset | fuzz | conflict
    offset: int = 0  # line delta from the line the hunk header states
    fuzz: int = 0
    line: int = 0  # 1-based line where the hunk went (conflict: nearest candidate; 0: file-level)
    expected: list[str] | None = None  # conflicts only: the hunk's old lines
    actual: list[str] | None = None  # conflicts only: the file's lines at `line`
    reason: str = ""

    def to_json(self) -> dict:
        d = {"file": self.file, "status": self.status, "offset": self.offset, "fuzz": self.fuzz,
             "line": self.line}
        if self.status == CONFLICT:
            d.update(reason=self.reason, expected=self.expected, actual=self.actual)
        return d


@dataclass(frozen=True)
class PatchResult:
    fix: str
    variant: str | None  # patch file name
    status: str  # applied | already-present | not-applicable | failed
    reason: str = ""
    hunks: tuple[HunkResult, ...] = ()
    commit: str | None = None
    variant_sha256: str | None = None

    def to_json(self) -> dict:
        return {"fix": self.fix, "variant": self.variant, "variant_sha256": self.variant_sha256,
                "status": self.status, "reason": self.reason, "commit": self.commit,
                "hunks": [h.to_json() for h in self.hunks]}


@dataclass(frozen=True)
class ApplyReport:
    tree: str
    version: str
    base_commit: str
    head_commit: str
    status: str  # applied | nothing-to-do | failed
    patches: tuple[PatchResult, ...]
    check: bool = False
    package_prefix: str = ""

    @property
    def exit_code(self) -> int:
        return 1 if self.status == FAILED else 0

    def to_json(self) -> dict:
        """The documented JSON document (a dict ready for json.dumps)."""
        return {"schema": REPORT_SCHEMA, "tree": self.tree, "version": self.version,
                "package_prefix": self.package_prefix, "check": self.check,
                "base_commit": self.base_commit, "head_commit": self.head_commit,
                "status": self.status, "patches": [p.to_json() for p in self.patches]}


# ----------------------------------------------------------------- overlay


class Overlay:
    """The tree under the package root, as files on disk plus pending changes."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._disk: dict[str, bytes | None] = {}
        self.changes: dict[str, bytes | None] = {}
        self.modes: dict[str, str] = {}  # mode of files created by the series

    def disk(self, rel: str) -> bytes | None:
        if rel not in self._disk:
            f = self.root / rel
            try:
                self._disk[rel] = f.read_bytes() if (f.is_file() and not f.is_symlink()) else None
            except OSError:
                self._disk[rel] = None
        return self._disk[rel]

    def read(self, rel: str) -> bytes | None:
        if rel in self.changes:
            return self.changes[rel]
        return self.disk(rel)

    def exists(self, rel: str) -> bool:
        if rel in self.changes:
            return self.changes[rel] is not None
        return os.path.lexists(self.root / rel)

    def read_text(self, rel: str) -> str | None:
        b = self.read(rel)
        return None if b is None else b.decode("utf-8", "surrogateescape")


def _lines_bytes(lines: Sequence[str], no_eol: bool) -> bytes:
    img = FileImage(list(lines), ["\n"] * len(lines))
    if lines and no_eol:
        img.eols[-1] = ""
    return img.to_bytes()


def _patch_file(fp: FilePatch, ov: Overlay, *, reverse: bool) -> tuple[list[HunkResult], bytes | None, bool]:
    """Apply (or reverse-apply with no fuzz) one file patch on the overlay.
    Returns (hunk results, new content or None for deletion, ok)."""
    path = fp.path
    creation, deletion = fp.is_creation, fp.is_deletion
    hunks: list[Hunk] = list(fp.hunks)
    if reverse:
        creation, deletion = deletion, creation
        hunks = [h.reversed() for h in hunks]
    cur = ov.read(path)

    def fail(reason: str, expected=None, actual=None) -> tuple[list[HunkResult], None, bool]:
        return [HunkResult(path, CONFLICT, line=0, expected=expected, actual=actual, reason=reason)], None, False

    if creation:
        if ov.exists(path):
            return fail("file to create already exists")
        new = [l for h in hunks for l in h.new_lines]
        no_eol = bool(hunks) and hunks[-1].new_no_eol
        return [HunkResult(path, EXACT, line=1) for _ in hunks] or [HunkResult(path, EXACT, line=1)], \
            _lines_bytes(new, no_eol), True
    if cur is None:
        return fail("file to patch does not exist" if not ov.exists(path) else "not a regular file")
    img = FileImage.from_bytes(cur)
    if deletion:
        old = [l for h in hunks for l in h.old_lines]
        if img.lines != old:
            return fail("file to delete differs from the patch's old content", old, img.lines[: len(old) + 3])
        return [HunkResult(path, EXACT, line=1) for _ in hunks] or [HunkResult(path, EXACT, line=1)], None, True
    pls = place_hunks(img.lines, hunks, max_fuzz=0 if reverse else 2, detail=not reverse)
    results = [HunkResult(path, p.status, p.offset, p.fuzz, p.line, p.expected, p.actual, p.reason) for p in pls]
    if any(p.status == CONFLICT for p in pls):
        return results, None, False
    return results, apply_hunks(img, hunks, pls).to_bytes(), True


def reverse_applies(ov: Overlay, variant: PatchVariant) -> bool:
    """True when every file of the variant reverse-applies cleanly (exact or
    offset, no fuzz, no ambiguity): the tree already holds the patched state."""
    for fp in variant.files:
        _, _, ok = _patch_file(fp, ov, reverse=True)
        if not ok:
            return False
    return True


# ------------------------------------------------------------------- git


def _git(root: Path, *args: str, input: bytes | None = None) -> bytes:
    p = subprocess.run(["git", "-C", str(root), *args], input=input, capture_output=True)
    if p.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:2])} failed: {p.stderr.decode(errors='replace').strip()}")
    return p.stdout


def _dirty_paths(root: Path) -> set[str]:
    """Tracked paths with staged or unstaged changes (untracked files do not count)."""
    out = _git(root, "--no-optional-locks", "status", "--porcelain=v1", "-z", "--untracked-files=no", "--ignore-submodules=none")
    parts = out.split(b"\0")
    paths: set[str] = set()
    i = 0
    while i < len(parts):
        e = parts[i]
        i += 1
        if len(e) < 4:
            continue
        paths.add(e[3:].decode("utf-8", "surrogateescape"))
        if e[:1] in (b"R", b"C") or e[1:2] in (b"R", b"C"):
            if i < len(parts):
                paths.add(parts[i].decode("utf-8", "surrogateescape"))
                i += 1
    return paths


def _check_symlinks(repo: Path, prefix: str, variant: PatchVariant) -> None:
    root = repo.resolve()
    for fp in variant.files:
        rel = prefix + fp.path
        cur = repo
        for part in rel.split("/"):
            cur = cur / part
            if cur.is_symlink():
                target = os.readlink(cur)
                inside = cur.resolve().is_relative_to(root)
                where = "inside" if inside else "outside"
                raise BadInput(f"{variant.path}: {fp.path} goes through the symlink {cur.relative_to(repo)} -> "
                               f"{target} ({where} the tree)")
            if not cur.exists():
                break


def _epoch(d: _dt.date) -> int:
    return int(_dt.datetime(d.year, d.month, d.day, tzinfo=_dt.timezone.utc).timestamp())


def commit_message(fix: Fix, variant: PatchVariant) -> str:
    desc = variant.header.get("Description", "").strip()
    notes = variant.header.get("Backport-Notes", "").strip()
    parts = [f"Backport #{fix.pr}: {fix.title}", desc]
    if notes:
        parts.append("Backport notes: " + notes)
    parts.append(f"Backport-Of: {UPSTREAM_REPO}#{fix.pr}\n"
                 f"Upstream-Commit: {fix.upstream_commit}\n"
                 f"Backport-Variant: {variant.name}")
    return "\n\n".join(p for p in parts if p) + "\n"


def _base_entries(repo: Path, rev: str, paths: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{repo path: (mode, sha)} for the paths that are regular files in rev."""
    if not paths:
        return {}
    out = _git(repo, "--literal-pathspecs", "ls-tree", "-z", "--full-tree", rev, "--", *sorted(set(paths)))
    entries = {}
    for rec in out.split(b"\0"):
        if not rec:
            continue
        meta, path = rec.split(b"\t", 1)
        mode, kind, sha = meta.decode().split()
        if kind == "blob":
            entries[path.decode("utf-8", "surrogateescape")] = (mode, sha)
    return entries


def _fast_import(repo: Path, base: str, commits: list[tuple[str, int, dict[str, tuple[str, bytes] | None]]],
                 ref: str) -> list[str]:
    """Write every commit (message, epoch, {repo path: (mode, data) | None})
    with one ``git fast-import`` onto the scratch ``ref``; return the SHAs.
    Blobs, trees and commits come out exactly as git would write them."""
    import tempfile

    buf = BytesIO()
    w = buf.write
    who = f"{AUTHOR_NAME} <{AUTHOR_EMAIL}>"
    for i, (message, epoch, changes) in enumerate(commits, 1):
        msg = message.encode("utf-8")
        w(f"commit {ref}\nmark :{i}\nauthor {who} {epoch} +0000\ncommitter {who} {epoch} +0000\n".encode())
        w(b"data %d\n" % len(msg) + msg + b"\n")
        if i == 1:
            w(f"from {base}\n".encode())
        for path, val in changes.items():
            p = path.encode("utf-8", "surrogateescape")
            if val is None:
                w(b"D " + p + b"\n")
            else:
                mode, data = val
                w(b"M " + mode.encode() + b" inline " + p + b"\ndata %d\n" % len(data) + data + b"\n")
        w(b"\n")
    w(b"done\n")
    with tempfile.TemporaryDirectory(prefix="sglang-backport-") as td:
        marks = Path(td) / "marks"
        _git(repo, "fast-import", "--quiet", "--done", f"--export-marks={marks}", input=buf.getvalue())
        # the marks file holds ":N sha" per line
        got = dict(line.split(" ", 1) for line in marks.read_text().splitlines() if line)
    return [got[f":{i}"] for i in range(1, len(commits) + 1)]


# -------------------------------------------------------------- the series


def _norm_prefix(prefix: str) -> str:
    prefix = (prefix or "").strip().strip("/")
    if not prefix:
        return ""
    return check_rel_path(prefix, "package_prefix") + "/"


def apply_series(repo: Path, pack: Pack, version: str, *, package_prefix: str = "",
                 only: Sequence[str] | None = None, check: bool = False,
                 allow_dirty: bool = False) -> ApplyReport:
    """Apply ``pack``'s series for sglang ``version`` to the git work tree
    ``repo`` (its root). ``package_prefix``: path from the repo root to the
    directory containing ``sglang/`` ("" for wheel trees, "python/" for an
    upstream checkout). Raises BadInput for bad input; returns a report whose
    status is ``failed`` (exit 1) when a fix could not be applied, in which
    case files, index and HEAD are as before."""
    import git  # gitpython

    repo = Path(repo)
    try:
        v = Version(str(version))
    except InvalidVersion:
        raise BadInput(f"version: {version!r} is not a PEP 440 version") from None
    prefix = _norm_prefix(package_prefix)
    try:
        g = git.Repo(repo)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise BadInput(f"{repo}: not a git repository") from None
    try:
        if g.bare or g.working_tree_dir is None or Path(g.working_tree_dir).resolve() != repo.resolve():
            raise BadInput(f"{repo}: not the root of a git work tree")
        if not g.head.is_valid():
            raise BadInput(f"{repo}: the repository has no commit")
        if not (repo / prefix / "sglang").is_dir():
            raise BadInput(f"{repo / prefix}: no sglang/ package here (package_prefix {package_prefix!r}?)")
        selected = list(pack.series)
        if only is not None:
            for fid in only:
                if fid not in pack.series:
                    raise BadInput(f"--only {fid}: not in the series of {pack.root}")
            selected = [f for f in pack.series if f in set(only)]
        # security, before touching anything
        for fid in selected:
            for pv in pack.variants.get(fid, ()):
                _check_symlinks(repo, prefix, pv)
        dirty = _dirty_paths(repo)
        if dirty and not allow_dirty:
            first = sorted(dirty)[0]
            raise BadInput(f"{repo}: uncommitted changes in {len(dirty)} tracked file(s) (e.g. {first}); "
                           f"commit or stash them, or allow dirty trees")
        base = g.head.commit
        return _run(g, repo, prefix, pack, v, selected, base, dirty, check)
    finally:
        g.close()


def _run(g, repo: Path, prefix: str, pack: Pack, v: Version, selected: list[str], base, dirty: set[str],
         check: bool) -> ApplyReport:
    ov = Overlay(repo / prefix)
    state: dict[str, str] = {}
    results: list[PatchResult] = []
    pending: list[tuple[Fix, PatchVariant, dict[str, bytes | None]]] = []
    touched = [prefix + fp.path for fid in selected for pv in pack.variants.get(fid, ()) for fp in pv.files]
    base_entries = _base_entries(repo, base.hexsha, touched)

    def tracked(rel: str) -> bool:
        return prefix + rel in base_entries

    def is_present(fix: Fix, variant: PatchVariant | None) -> tuple[bool, str]:
        fp_ok, how = fingerprint_match(fix, ov.read_text)
        if fp_ok:
            return True, how
        cands = [variant] if variant is not None else list(pack.variants.get(fix.id, ()))
        for pv in cands:
            if reverse_applies(ov, pv):
                return True, f"{pv.name} reverse-applies cleanly"
        return False, how

    for fid in selected:
        fix = pack.fixes[fid]
        if fix.is_fixed_in(v):
            state[fid] = NOT_APPLICABLE
            results.append(PatchResult(fid, None, NOT_APPLICABLE, f"{v} is in fixed_in {fix.fixed_in}"))
            continue
        variant = pack.variant_for(fid, v)
        vname = variant.name if variant else None
        vsha = variant.sha256 if variant else None
        present, how = is_present(fix, variant)
        if present:
            state[fid] = PRESENT
            results.append(PatchResult(fid, vname, PRESENT, how, variant_sha256=vsha))
            continue
        if variant is None:
            have = ", ".join(f"{pv.name} ({pv.applies_to})" for pv in pack.variants.get(fid, ())) or "none"
            state[fid] = FAILED
            results.append(PatchResult(fid, None, FAILED, f"no variant applies to sglang {v}; variants: {have}"))
            continue
        missing = []
        for dep in dict.fromkeys(fix.depends_on + variant.depends_on):
            st = state.get(dep)
            if st in (APPLIED, PRESENT, NOT_APPLICABLE):
                continue
            if st == FAILED:
                missing.append(f"{dep} (failed)")
                continue
            dfix = pack.fixes.get(dep)
            if dfix is not None and dep not in state:
                if dfix.is_fixed_in(v) or is_present(dfix, pack.variant_for(dep, v))[0]:
                    continue
            missing.append(f"{dep} (not present)" if dep not in selected else f"{dep} (not applied)")
        if missing:
            state[fid] = FAILED
            results.append(PatchResult(fid, vname, FAILED, "missing dependency: " + ", ".join(missing),
                                       variant_sha256=vsha))
            continue
        hunk_results: list[HunkResult] = []
        changes: dict[str, bytes | None] = {}
        problems: list[str] = []
        for fp in variant.files:
            rel_repo = prefix + fp.path
            if rel_repo in dirty:
                hunk_results.append(HunkResult(fp.path, CONFLICT, reason="file has uncommitted changes"))
                problems.append(f"{fp.path}: uncommitted changes")
                continue
            if not fp.is_creation and fp.path not in ov.changes and not tracked(fp.path):
                hunk_results.append(HunkResult(fp.path, CONFLICT, reason="file is not tracked by git"))
                problems.append(f"{fp.path}: not tracked by git")
                continue
            hr, new, ok = _patch_file(fp, ov, reverse=False)
            hunk_results.extend(hr)
            if ok:
                changes[fp.path] = new
                if fp.is_creation:
                    ov.modes[fp.path] = fp.new_mode or "100644"
            else:
                for h in hr:
                    if h.status == CONFLICT:
                        problems.append(f"{h.file}:{h.line}: {h.reason}" if h.line else f"{h.file}: {h.reason}")
        if problems:
            state[fid] = FAILED
            results.append(PatchResult(fid, vname, FAILED, "; ".join(problems), tuple(hunk_results),
                                       variant_sha256=vsha))
            continue
        ov.changes.update(changes)
        state[fid] = APPLIED
        pending.append((fix, variant, changes))
        results.append(PatchResult(fid, vname, APPLIED, "", tuple(hunk_results), variant_sha256=vsha))

    status = FAILED if FAILED in state.values() else (APPLIED if pending else "nothing-to-do")
    report = ApplyReport(str(repo.resolve()), str(v), base.hexsha, base.hexsha, status, tuple(results), check,
                         prefix)
    if status != APPLIED or check:
        return report
    commits = _write(g, base_entries, repo, prefix, base, pending, ov)
    by_fix = dict(zip((f.id for f, _, _ in pending), commits))
    patches = tuple(PatchResult(r.fix, r.variant, r.status, r.reason, r.hunks, by_fix.get(r.fix), r.variant_sha256)
                    for r in results)
    return ApplyReport(report.tree, report.version, base.hexsha, commits[-1], status, patches, check, prefix)


def _write(g, base_entries: dict[str, tuple[str, str]], repo: Path, prefix: str, base, pending,
           ov: Overlay) -> list[str]:
    """Build the commits as objects, then write files, index and HEAD."""
    import hashlib

    modes = {p: m for p, (m, _) in base_entries.items()}
    commits = []
    for fix, variant, changes in pending:
        cc: dict[str, tuple[str, bytes] | None] = {}
        for rel, data in changes.items():
            rp = prefix + rel
            if data is None:
                cc[rp] = None
                modes.pop(rp, None)
            else:
                modes.setdefault(rp, ov.modes.get(rel, "100644"))
                cc[rp] = (modes[rp], data)
        commits.append((commit_message(fix, variant), _epoch(variant.last_update), cc))
    scratch = f"refs/sglang-backport/staging-{os.getpid()}"
    final: dict[str, bytes | None] = {}
    for _, _, changes in pending:
        final.update(changes)
    index_file = Path(g.git_dir) / "index"
    saved_index = index_file.read_bytes() if index_file.exists() else None
    root = repo / prefix
    written: list[str] = []
    try:
        # objects first (a scratch ref holds them; it goes in the same
        # transaction that moves HEAD), then files, index and HEAD
        shas = _fast_import(repo, base.hexsha, commits, scratch)
        for rel, data in final.items():
            f = root / rel
            written.append(rel)
            if data is None:
                if f.exists():
                    f.unlink()
                    _prune_dirs(f.parent, repo)
            else:
                f.parent.mkdir(parents=True, exist_ok=True)
                mode = (0o755 if ov.modes.get(rel) == "100755" else 0o644) if ov.disk(rel) is None \
                    else f.stat().st_mode & 0o7777
                tmp = f.with_name(f".{f.name}.sglang-backport.tmp")
                tmp.write_bytes(data)
                os.chmod(tmp, mode)
                os.replace(tmp, f)
        info = []
        for rel, data in final.items():
            rp = prefix + rel
            if data is None:
                info.append(f"0 {'0' * 40}\t{rp}")
            else:
                sha = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                info.append(f"{modes[rp]} {sha}\t{rp}")
        _git(repo, "update-index", "-z", "--index-info", input=("\0".join(info) + "\0").encode("utf-8", "surrogateescape"))
        # stat info for the entries just written (exit status 1 only means
        # that other, dirty, entries need an update: not our business)
        subprocess.run(["git", "-C", str(repo), "update-index", "-q", "--refresh"], capture_output=True)
        _git(repo, "update-ref", "-m", f"sglang-backport: apply {len(shas)} patch(es)", "--stdin",
             input=f"update HEAD {shas[-1]} {base.hexsha}\ndelete {scratch} {shas[-1]}\n".encode())
    except BaseException:
        for rel in written:
            f = root / rel
            orig = ov.disk(rel)
            try:
                if orig is None:
                    if f.exists():
                        f.unlink()
                        _prune_dirs(f.parent, repo)
                else:
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_bytes(orig)
            except OSError:
                pass
        if saved_index is not None:
            index_file.write_bytes(saved_index)
        try:
            _git(repo, "update-ref", "-d", scratch)
        except Exception:
            pass
        try:
            if _git(repo, "rev-parse", "HEAD").decode().strip() != base.hexsha:
                _git(repo, "update-ref", "HEAD", base.hexsha)
        except Exception:
            pass
        raise
    return shas


def _prune_dirs(d: Path, stop: Path) -> None:
    stop = stop.resolve()
    while d.resolve() != stop and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent
