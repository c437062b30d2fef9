"""Apply the patch series to a git tree: drift-tolerant, all or nothing.

Decisions (see also placement.py for hunk placement):

* Per fix, in series order: ``not-applicable`` when the version is in
  ``fixed_in``; ``already-present`` when the fingerprint matches or the
  chosen variant reverse-applies cleanly (exact/offset, no fuzz; when no
  variant covers the version, any variant that reverse-applies counts);
  a dependency check (fix ``depends_on`` plus the variant's Depends-On: each
  must be applied earlier in this run, already present, or not applicable,
  else ``failed``); then the variant whose Applies-To contains the version
  (none: ``failed`` with the reason). A fix whose ``scope`` (fixes.toml)
  excludes the version, and that is not present, is ``not-applicable`` with
  a reason that says the release stays exposed; it satisfies no
  dependency. When the forward application
  conflicts but the variant reverse-applies with fuzz, the fix counts as
  ``already-present`` (a patch applied earlier with fuzz; a re-run must be
  ``nothing-to-do``). A missing fix is worse than a loud failure, so the
  strict reverse check comes first and the fuzzy one only after forward failed.
* Everything is computed in memory on an overlay of the tree, later fixes
  seeing earlier ones. Nothing is written unless every fix succeeds.
* On success: the working files are written and ``git update-index``
  records exactly those paths, while ``git fast-import`` writes the blobs,
  trees and commits (git does the hashing and the pack; nothing of git's
  object format is written here); then ``git update-ref`` moves HEAD (compare-and-swap against the base commit,
  reflog message ``sglang-backport: apply N patch(es)``). Any error in that
  phase restores the files, the index file and HEAD. Objects of a failed
  run may remain unreferenced (git gc drops them).
* Commits: author and committer ``sglang-backport <sglang-backport@localhost>``,
  date = the variant's Last-Update at 00:00:00 UTC, no signing, message
  ``Backport #N: <title>``, the Description, the Backport-Notes, then the
  trailers ``Backport-Of``, ``Upstream-Commit``, ``Backport-Variant``: the
  same base commit and the same pack give the same commit SHAs.
* A user's checkout with uncommitted changes to tracked files is refused
  (BadInput) unless ``allow_dirty``; even then a patch touching a file with
  uncommitted changes, or a file that git does not track, fails.
  Untracked files elsewhere do not make a tree dirty. The status check runs
  with ``--no-optional-locks`` so that even a refused run leaves the index
  file byte-for-byte as it was.
* Files are written as bytes, without git's clean/smudge/eol filters
  (SGLang trees have none). An existing file is rewritten in place unless it
  has other hard links (a cache sharing inodes), which are never written
  through.
* ``check=True`` runs everything up to the writes and returns the report
  (``check: true`` in the JSON; patch statuses say what would happen; no
  commit SHAs).
* Security (before anything else, BadInput): patch paths are validated when
  the pack loads (absolute, ``..``, ``.git``, binary, malformed); here every
  path of every variant of the selected fixes is checked against the tree for
  symlinks: a path through a symlink is refused, and the message says whether
  it leads outside the tree.
* Speed: the engine's cost is five git processes (status, cat-file of the
  touched directories' trees, update-index, fast-import, update-ref); they overlap with
  the Python work (status runs while the series is computed; update-index
  while fast-import writes the commits). See benchmarks/bench_apply.py.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .detect import fingerprint_match
from .errors import BadInput
from .placement import CONFLICT, EXACT, FileImage, Hunk, apply_hunks, place_hunks
from .series import FilePatch, Fix, Pack, PatchVariant, check_rel_path

# fast-import writes the series here; HEAD moves to it, then the ref is deleted
PENDING_REF = "refs/sglang-backport/pending"
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
        """The report as a dict ready for ``json.dumps``::

            {"schema": "sglang-backport/apply-report/1",
             "tree": "/abs/path", "version": "0.5.19", "package_prefix": "",
             "check": false,                      # true: nothing was written
             "base_commit": SHA, "head_commit": SHA,   # equal unless applied
             "status": "applied" | "nothing-to-do" | "failed",
             "patches": [{"fix": "pr38935", "variant": "pr38935-0.5.17.patch" | null,
                          "variant_sha256": HEX | null,
                          "status": "applied" | "already-present" | "not-applicable" | "failed",
                          "reason": "...",             # why, for every status but applied
                          "commit": SHA | null,        # the patch's commit when applied
                          "hunks": [{"file": "sglang/srt/...", "status": "exact" | "offset"
                                     | "fuzz" | "conflict", "offset": INT, "fuzz": 0..2,
                                     "line": INT,       # 1-based; 0 = the file as a whole
                                     # conflicts only:
                                     "reason": "...", "expected": [lines], "actual": [lines]}]}]}
        """
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
        self._images: dict[str, tuple[bytes, FileImage]] = {}

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

    def image(self, rel: str, data: bytes) -> FileImage:
        """The lines of ``data`` (the current content of rel), parsed once.
        Callers never mutate an image: apply_hunks builds a new one."""
        hit = self._images.get(rel)
        if hit is None or hit[0] is not data:
            hit = (data, FileImage.from_bytes(data))
            self._images[rel] = hit
        return hit[1]

    def read_text(self, rel: str) -> str | None:
        b = self.read(rel)
        return None if b is None else b.decode("utf-8", "surrogateescape")


def _lines_bytes(lines: Sequence[str], no_eol: bool) -> bytes:
    img = FileImage(list(lines), ["\n"] * len(lines))
    if lines and no_eol:
        img.eols[-1] = ""
    return img.to_bytes()


def _patch_file(fp: FilePatch, ov: Overlay, *, reverse: bool, fuzz: int = 2) -> tuple[list[HunkResult], bytes | None, bool]:
    """Apply (or reverse-apply) one file patch on the overlay, with up to
    ``fuzz`` (reverse: 0 unless asked). Returns (hunk results, new content or
    None for deletion, ok)."""
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
    img = ov.image(path, cur)
    if deletion:
        old = [l for h in hunks for l in h.old_lines]
        if img.lines != old:
            return fail("file to delete differs from the patch's old content", old, img.lines[: len(old) + 3])
        return [HunkResult(path, EXACT, line=1) for _ in hunks] or [HunkResult(path, EXACT, line=1)], None, True
    pls = place_hunks(img.lines, hunks, max_fuzz=fuzz, detail=not reverse)
    results = [HunkResult(path, p.status, p.offset, p.fuzz, p.line, p.expected, p.actual, p.reason) for p in pls]
    if any(p.status == CONFLICT for p in pls):
        return results, None, False
    return results, apply_hunks(img, hunks, pls).to_bytes(), True


def reverse_applies(ov: Overlay, variant: PatchVariant, fuzz: int = 0) -> bool:
    """True when every file of the variant reverse-applies (by default
    cleanly: exact or offset, no fuzz, no ambiguity): the tree already holds
    the patched state."""
    for fp in variant.files:
        _, _, ok = _patch_file(fp, ov, reverse=True, fuzz=fuzz)
        if not ok:
            return False
    return True


# ------------------------------------------------------------------- git


def _git(root: Path, *args: str, input: bytes | None = None) -> bytes:
    p = subprocess.run(["git", "-C", str(root), *args], input=input, capture_output=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:2])} failed: {p.stderr.decode(errors='replace').strip()}")
    return p.stdout


class _Proc:
    """A git command running in the background (the engine overlaps its few
    git processes: they are most of its cost). Input comes from a temporary
    file so that starting never blocks."""

    def __init__(self, root: Path, *args: str, input: bytes | None = None):
        import tempfile

        self.args = args
        stdin = subprocess.DEVNULL
        if input is not None:
            stdin = tempfile.TemporaryFile()  # noqa: SIM115 - closed right after Popen
            stdin.write(input)
            stdin.seek(0)
        self.p = subprocess.Popen(["git", "-C", str(root), *args], stdin=stdin, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        if input is not None:
            stdin.close()
        self.out: bytes | None = None

    def result(self) -> bytes:
        if self.out is None:
            out, err = self.p.communicate()
            if self.p.returncode != 0:
                raise RuntimeError(f"git {' '.join(self.args[:2])} failed: "
                                   f"{err.decode(errors='replace').strip()}")
            self.out = out
        return self.out

    def reap(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.communicate()


STATUS_ARGS = ("--no-optional-locks", "status", "--porcelain=v1", "-z", "--untracked-files=no",
               "--ignore-submodules=none")


def _dirty_paths(root: Path, out: bytes | None = None) -> set[str]:
    """Tracked paths with staged or unstaged changes (untracked files do not count)."""
    if out is None:
        out = _git(root, *STATUS_ARGS)
    parts = out.split(b"\0")
    paths: set[str] = set()
    i = 0
    while i < len(parts):
        e = parts[i]
        i += 1
        if len(e) < 4:
            continue
        paths.add(e[3:].decode("utf-8", "surrogateescape"))
        if (e[:1] in (b"R", b"C") or e[1:2] in (b"R", b"C")) and i < len(parts):
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
    return int(_dt.datetime(d.year, d.month, d.day, tzinfo=_dt.UTC).timestamp())


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


def _dirs_of(paths: Sequence[str]) -> list[str]:
    """Every directory along the paths, root ("") included."""
    dirs = {""}
    for p in paths:
        parts = p.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return sorted(dirs)


def _cat_trees_input(base: str, dirs: Sequence[str]) -> bytes:
    return "".join(f"{base}^{{tree}}\n" if d == "" else f"{base}:{d}\n" for d in dirs).encode(
        "utf-8", "surrogateescape")


def _parse_tree(data: bytes) -> dict[str, tuple[str, bytes]]:
    """A raw git tree object as {name: (mode, binary sha)}."""
    out: dict[str, tuple[str, bytes]] = {}
    i, n = 0, len(data)
    while i < n:
        sp = data.index(b" ", i)
        nul = data.index(b"\0", sp)
        out[data[sp + 1:nul].decode("utf-8", "surrogateescape")] = (data[i:sp].decode(), data[nul + 1:nul + 21])
        i = nul + 21
    return out


def _parse_cat_trees(out: bytes, dirs: Sequence[str]) -> dict[str, dict[str, tuple[str, bytes]]]:
    """``git cat-file --batch`` output, in request order: {dir: entries} for
    the directories that exist as trees in the base commit."""
    trees: dict[str, dict[str, tuple[str, bytes]]] = {}
    pos = 0
    for d in dirs:
        eol = out.index(b"\n", pos)
        head = out[pos:eol].split()
        pos = eol + 1
        if len(head) == 3:
            size = int(head[2])
            body = out[pos:pos + size]
            pos += size + 1
            if head[1] == b"tree":
                trees[d] = _parse_tree(body)
    return trees


def _entries_for(trees: dict[str, dict[str, tuple[str, bytes]]], paths: Sequence[str]) -> dict[str, tuple[str, str]]:
    """{repo path: (mode, hex sha)} for the paths that are regular files in the base."""
    out = {}
    for p in paths:
        d, _, name = p.rpartition("/")
        e = trees.get(d, {}).get(name)
        if e is not None and e[0] in ("100644", "100755"):
            out[p] = (e[0], e[1].hex())
    return out


def _fast_import_stream(ref: str, base: str, commits: list[tuple[str, int, dict[str, tuple[str, bytes] | None]]]
                        ) -> bytes:
    """A `git fast-import` stream: one commit per (message, epoch, {repo path: (mode, data) | None}),
    the first on top of ``base``, each marked :1, :2, ... so their ids can be read back. git
    itself hashes, builds the trees and writes the pack."""
    who = f"{AUTHOR_NAME} <{AUTHOR_EMAIL}>".encode()
    out = bytearray()
    for n, (message, epoch, changes) in enumerate(commits, start=1):
        text = message.encode("utf-8")
        out += b"commit %s\nmark :%d\n" % (ref.encode(), n)
        out += b"author %s %d +0000\ncommitter %s %d +0000\n" % (who, epoch, who, epoch)
        out += b"data %d\n%s\n" % (len(text), text)
        if n == 1:
            out += b"from %s\n" % base.encode()
        for path, val in changes.items():
            quoted = path.encode("utf-8", "surrogateescape")
            if val is None:
                out += b"D %s\n" % quoted
            else:
                mode, data = val
                out += b"M %s inline %s\ndata %d\n%s\n" % (mode.encode(), quoted, len(data), data)
        out += b"\n"
    out += b"done\n"
    return bytes(out)


@dataclass(frozen=True)
class _Base:
    hexsha: str


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
    from git.refs.symbolic import SymbolicReference

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
    procs: list[_Proc] = [_Proc(repo, *STATUS_ARGS)]  # the slowest step: start it first
    try:
        if g.bare or g.working_tree_dir is None or Path(g.working_tree_dir).resolve() != repo.resolve():
            raise BadInput(f"{repo}: not the root of a git work tree")
        if not (repo / prefix / "sglang").is_dir():
            raise BadInput(f"{repo / prefix}: no sglang/ package here (package_prefix {package_prefix!r}?)")
        selected = list(pack.series)
        if only is not None:
            for fid in only:
                if fid not in pack.series:
                    raise BadInput(f"--only {fid}: not in the series of {pack.root}")
            selected = [f for f in pack.series if f in set(only)]
        try:  # read from the ref files: no object lookup, no process
            base_sha = SymbolicReference.dereference_recursive(g, "HEAD")
        except ValueError:
            raise BadInput(f"{repo}: the repository has no commit") from None
        if len(base_sha) != 40:
            raise BadInput(f"{repo}: only SHA-1 repositories are supported")
        base = _Base(base_sha)
        touched = [prefix + fp.path for fid in selected for pv in pack.variants.get(fid, ()) for fp in pv.files]
        dirs = _dirs_of(touched)
        procs.append(_Proc(repo, "cat-file", "--batch", input=_cat_trees_input(base.hexsha, dirs)))
        # security, before touching anything
        for fid in selected:
            for pv in pack.variants.get(fid, ()):
                _check_symlinks(repo, prefix, pv)
        # the series is computed in memory while git status and cat-file run
        # (nothing is written before the dirty check below)
        computed = _compute(repo, prefix, pack, v, selected, set(), None)
        trees = _parse_cat_trees(procs[1].result(), dirs)
        if "" not in trees:
            raise BadInput(f"{repo}: HEAD {base_sha} is not a commit in this repository")
        base_entries = _entries_for(trees, touched)
        if any(prefix + rel not in base_entries and ov_rel_existed
               for rel, ov_rel_existed in _modified_paths(computed)):
            computed = _compute(repo, prefix, pack, v, selected, set(), base_entries)  # an untracked file
        built = None
        if not check and computed[1] and FAILED not in computed[3].values():
            built = _build(trees, base_entries, prefix, base, computed[1], computed[2])
        dirty = _dirty_paths(repo, procs[0].result())
        if dirty and not allow_dirty:
            first = min(dirty)
            raise BadInput(f"{repo}: uncommitted changes in {len(dirty)} tracked file(s) (e.g. {first}); "
                           f"commit or stash them, or allow dirty trees")
        if dirty & set(touched):
            computed = _compute(repo, prefix, pack, v, selected, dirty, base_entries)
            built = None
            if not check and computed[1] and FAILED not in computed[3].values():
                built = _build(trees, base_entries, prefix, base, computed[1], computed[2])
        return _finish(g, repo, prefix, v, base, check, built, *computed)
    finally:
        for p in procs:
            p.reap()
        g.close()


def _modified_paths(computed) -> list[tuple[str, bool]]:
    """(path, existed before the run) for every file the pending patches change."""
    _, pending, ov, _ = computed
    return [(rel, ov.disk(rel) is not None) for _, _, changes in pending for rel in changes]


def _compute(repo: Path, prefix: str, pack: Pack, v: Version, selected: list[str], dirty: set[str],
             base_entries: dict[str, tuple[str, str]] | None):
    """Every fix's outcome, in memory: (results, pending commits, overlay,
    states). ``base_entries`` None: the tracked-by-git check is left to the
    caller (which redoes the computation when a changed file is untracked)."""
    ov = Overlay(repo / prefix)
    state: dict[str, str] = {}
    out_of_scope: set[str] = set()  # not-applicable because the pack has no backport for v
    results: list[PatchResult] = []
    pending: list[tuple[Fix, PatchVariant, dict[str, bytes | None]]] = []

    def tracked(rel: str) -> bool:
        return base_entries is None or prefix + rel in base_entries

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
        if not fix.in_scope(v):
            state[fid] = NOT_APPLICABLE
            out_of_scope.add(fid)
            results.append(PatchResult(fid, None, NOT_APPLICABLE,
                                       f"no backport for sglang {v}: the pack carries {fid} for {fix.scope} "
                                       f"only; this release lacks the fix and stays exposed"))
            continue
        if variant is None:
            have = ", ".join(f"{pv.name} ({pv.applies_to})" for pv in pack.variants.get(fid, ())) or "none"
            state[fid] = FAILED
            results.append(PatchResult(fid, None, FAILED, f"no variant applies to sglang {v}; variants: {have}"))
            continue
        missing = []
        for dep in dict.fromkeys(fix.depends_on + variant.depends_on):
            st = state.get(dep)
            if dep in out_of_scope:
                missing.append(f"{dep} (no backport for {v})")
                continue
            if st in (APPLIED, PRESENT, NOT_APPLICABLE):
                continue
            if st == FAILED:
                missing.append(f"{dep} (failed)")
                continue
            dfix = pack.fixes.get(dep)
            if dfix is not None and dep not in state and (
                    dfix.is_fixed_in(v) or is_present(dfix, pack.variant_for(dep, v))[0]):
                continue  # outside this run (--only): fixed in the release, or there
            missing.append(f"{dep} (not present)" if dep not in selected else f"{dep} (not applied)")
        if missing:
            state[fid] = FAILED
            results.append(PatchResult(fid, vname, FAILED, "missing dependency: " + ", ".join(missing),
                                       variant_sha256=vsha))
            continue
        hunk_results: list[HunkResult] = []
        changes: dict[str, bytes | None] = {}
        problems: list[str] = []
        blocked = False  # a file the engine must not touch (dirty, untracked)
        for fp in variant.files:
            rel_repo = prefix + fp.path
            if rel_repo in dirty:
                hunk_results.append(HunkResult(fp.path, CONFLICT, reason="file has uncommitted changes"))
                problems.append(f"{fp.path}: uncommitted changes")
                blocked = True
                continue
            if not fp.is_creation and fp.path not in ov.changes and not tracked(fp.path):
                hunk_results.append(HunkResult(fp.path, CONFLICT, reason="file is not tracked by git"))
                problems.append(f"{fp.path}: not tracked by git")
                blocked = True
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
        if problems and not blocked and reverse_applies(ov, variant, fuzz=2):
            # a patch applied earlier with fuzz: its new side is there (with
            # fuzz) and its old side is not; strict reverse-apply came first
            state[fid] = PRESENT
            results.append(PatchResult(fid, vname, PRESENT, f"{variant.name} reverse-applies with fuzz and does "
                                       f"not apply forward", variant_sha256=vsha))
            continue
        if problems:
            state[fid] = FAILED
            results.append(PatchResult(fid, vname, FAILED, "; ".join(problems), tuple(hunk_results),
                                       variant_sha256=vsha))
            continue
        ov.changes.update(changes)
        state[fid] = APPLIED
        pending.append((fix, variant, changes))
        results.append(PatchResult(fid, vname, APPLIED, "", tuple(hunk_results), variant_sha256=vsha))
    return results, pending, ov, state


def _finish(g, repo: Path, prefix: str, v: Version, base, check: bool, built, results, pending, ov,
            state) -> ApplyReport:
    status = FAILED if FAILED in state.values() else (APPLIED if pending else "nothing-to-do")
    report = ApplyReport(str(repo.resolve()), str(v), base.hexsha, base.hexsha, status, tuple(results), check,
                         prefix)
    if status != APPLIED or check:
        return report
    commits = _write(g, repo, prefix, base, pending, ov, built)
    by_fix = dict(zip((f.id for f, _, _ in pending), commits))
    patches = tuple(PatchResult(r.fix, r.variant, r.status, r.reason, r.hunks, by_fix.get(r.fix), r.variant_sha256)
                    for r in results)
    return ApplyReport(report.tree, report.version, base.hexsha, commits[-1], status, patches, check, prefix)


def _build(trees, base_entries: dict[str, tuple[str, str]], prefix: str, base, pending, ov: Overlay):
    """The series' commits as a fast-import stream (see _fast_import_stream)."""
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
    return len(commits), _fast_import_stream(PENDING_REF, base.hexsha, commits)


def _write(g, repo: Path, prefix: str, base, pending, ov: Overlay, built) -> list[str]:
    """Write files and index entries, the objects (one pack), then move HEAD."""
    count, stream = built
    shas: list[str] = []
    final: dict[str, bytes | None] = {}
    for _, _, changes in pending:
        final.update(changes)
    index_file = Path(g.git_dir) / "index"
    saved_index = index_file.read_bytes() if index_file.exists() else None
    root = repo / prefix
    written: list[str] = []
    deleted_modes: dict[str, int] = {}
    ui: _Proc | None = None
    try:
        for rel, data in final.items():
            f = root / rel
            written.append(rel)
            if data is None:
                if f.exists():
                    deleted_modes[rel] = f.stat().st_mode & 0o7777
                    f.unlink()
                    _prune_dirs(f.parent, repo)
            else:
                _write_file(f, data, ov.modes.get(rel, "100644") if ov.disk(rel) is None else None)
        # index entries (with stat info) for exactly these paths, while the
        # pack is written; the bytes written are the committed blobs, as no
        # clean/smudge/eol filter runs (SGLang trees have none; a tree with
        # such filters would show the difference in git status)
        paths = "\0".join(prefix + rel for rel, data in final.items()
                          if data is not None or ov.disk(rel) is not None) + "\0"
        ui = _Proc(repo, "update-index", "--add", "--remove", "-z", "--stdin",
                   input=paths.encode("utf-8", "surrogateescape"))
        shas = _fast_import(repo, stream, count)
        ui.result()
        # HEAD last: compare-and-swap against the base commit
        _git(repo, "update-ref", "-m", f"sglang-backport: apply {len(shas)} patch(es)", "HEAD", shas[-1],
             base.hexsha)
    except BaseException:
        if ui is not None:
            ui.reap()
        for rel in written:
            f = root / rel
            orig = ov.disk(rel)
            try:
                if orig is None:
                    if f.exists():
                        f.unlink()
                        _prune_dirs(f.parent, repo)
                elif f.exists():
                    _write_file(f, orig, None)
                else:
                    f.parent.mkdir(parents=True, exist_ok=True)
                    f.write_bytes(orig)
                    os.chmod(f, deleted_modes.get(rel, 0o644))
            except OSError:
                pass
        if saved_index is not None:
            index_file.write_bytes(saved_index)
        with contextlib.suppress(OSError, RuntimeError):  # best effort: the original error matters
            if _git(repo, "rev-parse", "HEAD").decode().strip() != base.hexsha:
                _git(repo, "update-ref", "HEAD", base.hexsha)
        raise
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            _git(repo, "update-ref", "-d", PENDING_REF)
    return shas


def _fast_import(repo: Path, stream: bytes, count: int) -> list[str]:
    """Write the commits with `git fast-import` (into PENDING_REF); their ids, in order."""
    with tempfile.TemporaryDirectory(prefix="sglang-backport-marks-") as tmp:
        marks = Path(tmp) / "marks"
        # keep fast-import's pack as written (no unpacking into loose objects), stored at
        # compression level 1: git gc recompresses later, the run pays no heavy zlib
        _git(repo, "-c", "fastimport.unpackLimit=1", "-c", "core.compression=0", "fast-import", "--quiet",
             "--done", f"--export-marks={marks}", input=stream)
        ids = dict(line.split() for line in marks.read_text().splitlines())
    return [ids[f":{n}"] for n in range(1, count + 1)]


def _write_file(f: Path, data: bytes, new_mode: str | None) -> None:
    """Write a file's new content. An existing file with a single link is
    rewritten in place (mode kept; the original bytes are in memory for the
    rollback, and creating a new inode per file costs ~50x more on some file
    systems); a hard-linked file is replaced by a new file so that the other
    links (a cache, say) never change; a new file gets the patch's mode."""
    if new_mode is None:
        st = f.stat()
        if st.st_nlink == 1:
            with open(f, "r+b") as fh:
                fh.write(data)
                fh.truncate()
            return
        tmp = f.with_name(f".{f.name}.sglang-backport.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, st.st_mode & 0o7777)
        os.replace(tmp, f)
        return
    f.parent.mkdir(parents=True, exist_ok=True)
    with open(f, "xb") as fh:
        fh.write(data)
    os.chmod(f, 0o755 if new_mode == "100755" else 0o644)


def _prune_dirs(d: Path, stop: Path) -> None:
    stop = stop.resolve()
    while d.resolve() != stop and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent
