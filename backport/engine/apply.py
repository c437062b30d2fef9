"""Apply the patch series to a git work tree: drift-tolerant, all or nothing.

``apply_series`` runs, in order:

1. checks of the input (version, package prefix, ``only``, a work tree root
   with a commit; SHA-1 repositories only);
2. recovery: an interrupted apply (a journal, a pending ref) is finished or
   rolled back first (write.py, journal.py), and the report says which
   (``recovery``); with ``check`` an interrupted apply is bad input instead;
3. security, before anything else: every path of every variant of the
   selected fixes is checked against the tree for symlinks (a path through
   a symlink is refused, and the message says whether it leads outside the
   tree); the pack's own paths were checked when it loaded (confined to
   ``sglang/``, relative, no ``..`` or ``.git``, no binary);
4. the decision loop on an in-memory overlay (decide.py) while git reports,
   in the background, the dirty paths (``status``, with
   ``--no-optional-locks`` so that even a refused run leaves the index file
   byte for byte as it was), the base commit's trees on the way to the
   touched paths (``cat-file --batch``: the touched files' committed entries,
   and what objects.py builds the commits from) and their index flags
   (``ls-files -v``);
5. the paths the engine must not touch: uncommitted changes, a
   skip-worktree or assume-unchanged entry, bytes that differ from the
   committed blob (a change ``status`` cannot see). A fix that would change
   one fails; a checkout with uncommitted changes to tracked files is refused
   unless ``allow_dirty`` (untracked files elsewhere do not count);
6. when every fix succeeded: write.py commits the series and moves the work
   tree, crash-safe.

Commits: author and committer ``sglang-backport <sglang-backport@localhost>``,
date = the variant's Last-Update at 00:00:00 UTC, no signing, message
``Backport #N: <title>``, the Description, the Backport-Notes, then the
trailers ``Backport-Of``, ``Upstream-Commit``, ``Backport-Variant``: the same
base commit and the same pack give the same commit SHAs. ``check=True`` stops
before writing (``check: true`` in the JSON; no commit SHAs). Files are
written as bytes, without git's clean/smudge/eol filters (SGLang trees have
none).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import gitops
from ..errors import BadInput
from ..pack.model import Pack, PatchVariant, check_rel_path, parse_version
from .decide import Decision, decide
from .journal import JOURNAL_NAME, NEXT_INDEX, recover
from .objects import Trees, base_tree_specs
from .report import APPLIED, FAILED, NOTHING_TO_DO, ApplyReport, PatchResult
from .write import PENDING_REF, write_series

log = logging.getLogger("backport.engine")


def _norm_prefix(prefix: str) -> str:
    prefix = (prefix or "").strip().strip("/")
    if not prefix:
        return ""
    return check_rel_path(prefix, "package_prefix") + "/"


def _check_symlinks(repo: Path, prefix: str, variant: PatchVariant, seen: dict[str, bool]) -> None:
    """Refuse a variant path that goes through a symlink. ``seen``: {repo path: exists} of the
    components already checked in this run (variants share most directories)."""
    for fp in variant.files:
        rel = ""
        for part in (prefix + fp.path).split("/"):
            rel = f"{rel}/{part}" if rel else part
            exists = seen.get(rel)
            if exists is None:
                try:
                    exists = not stat.S_ISLNK(os.lstat(repo / rel).st_mode)
                except FileNotFoundError:
                    exists = False
                else:
                    if not exists:
                        _refuse_symlink(repo, variant, fp.path, repo / rel)
                seen[rel] = exists
            if not exists:
                break


def _refuse_symlink(repo: Path, variant: PatchVariant, path: str, link: Path) -> None:
    target = os.readlink(link)
    where = "inside" if link.resolve().is_relative_to(repo.resolve()) else "outside"
    raise BadInput(f"{variant.path}: {path} goes through the symlink {link.relative_to(repo)} -> "
                   f"{target} ({where} the tree)")


def interrupted(repo: Path, git_dir: Path) -> bool:
    """Did an apply stop half-way here (its journal or pending ref is left)?"""
    return ((git_dir / JOURNAL_NAME).exists() or (git_dir / NEXT_INDEX).exists()
            or gitops.read_ref(repo, PENDING_REF) is not None)


def recover_checkout(repo: Path) -> str:
    """Finish or roll back an interrupted apply in the work tree ``repo``; what was done ("" = nothing)."""
    repo = Path(repo)
    git_dir, _ = gitops.work_tree(repo)
    return recover(repo, git_dir, PENDING_REF) if interrupted(repo, git_dir) else ""


def apply_series(repo: Path, pack: Pack, version: str, *, package_prefix: str = "",
                 only: Sequence[str] | None = None, check: bool = False,
                 allow_dirty: bool = False) -> ApplyReport:
    """Apply ``pack``'s series for sglang ``version`` to the git work tree
    ``repo`` (its root). ``package_prefix``: path from the repo root to the
    directory containing ``sglang/`` ("" for wheel trees, "python/" for an
    upstream checkout). Raises BadInput for bad input; returns a report whose
    status is ``failed`` (exit 1) when a fix could not be applied, in which
    case files, index and HEAD are as before."""
    repo = Path(repo)
    v = parse_version(version, "version")
    prefix = _norm_prefix(package_prefix)
    git_dir, base = gitops.work_tree(repo)
    if not (repo / prefix / "sglang").is_dir():
        raise BadInput(f"{repo / prefix}: no sglang/ package here (package_prefix {package_prefix!r}?)")
    selected = list(pack.series)
    if only is not None:
        for fid in only:
            if fid not in pack.series:
                raise BadInput(f"--only {fid}: not in the series of {pack.root}")
        selected = [f for f in pack.series if f in set(only)]
    if base is None:
        raise BadInput(f"{repo}: the repository has no commit")
    if len(base) != 40:
        raise BadInput(f"{repo}: only SHA-1 repositories are supported")
    recovery = ""
    if interrupted(repo, git_dir):
        if check:
            raise BadInput(f"{repo}: an apply was interrupted here; run apply without --check to finish or "
                           f"roll it back first")
        recovery = recover(repo, git_dir, PENDING_REF)
        log.warning("%s: %s", repo, recovery)
        base = gitops.read_ref(repo, "HEAD") or base
    if not check and (git_dir / "index.lock").exists():
        raise BadInput(f"{git_dir / 'index.lock'}: exists; another git process is running in {repo} "
                       f"(or remove a stale lock)")
    touched = sorted({prefix + fp.path for fid in selected for pv in pack.variants.get(fid, ())
                      for fp in pv.files})
    specs = base_tree_specs(base, touched)
    procs = [gitops.Background(repo, *gitops.STATUS_ARGS),  # the slowest step: start it first
             gitops.Background(repo, *gitops.batch_args(), input=gitops.batch_input(list(specs.values()))),
             gitops.Background(repo, *gitops.flags_args(touched))]
    try:
        seen: dict[str, bool] = {}
        for fid in selected:  # security, before anything else
            for pv in pack.variants.get(fid, ()):
                _check_symlinks(repo, prefix, pv, seen)
        decision = decide(repo, prefix, pack, v, selected, {}, None)
        try:
            trees = _base_trees(base, specs, procs[1].result())
        except gitops.GitError:
            raise BadInput(f"{repo}: HEAD {base} is not a commit in this repository") from None
        base_entries = trees.entries(touched)
        if any(prefix + rel not in base_entries and existed for rel, existed in decision.changed_paths()):
            decision = decide(repo, prefix, pack, v, selected, {}, base_entries)  # an untracked file
        blocked = _untouchable(repo, prefix, decision, touched, base_entries, procs[2].result())
        if blocked:
            decision = decide(repo, prefix, pack, v, selected, blocked, base_entries)

        def dirty_gate() -> None:
            """Refuse a dirty checkout, or send the decision back when a touched path has
            uncommitted changes (only with allow_dirty); status is still running until here."""
            dirty = gitops.dirty_paths(procs[0].result())
            if dirty and not allow_dirty:
                raise BadInput(f"{repo}: uncommitted changes in {len(dirty)} tracked file(s) (e.g. {min(dirty)}); "
                               f"commit or stash them, or allow dirty trees")
            found = {p: "uncommitted changes" for p in dirty & set(touched)}
            if any(blocked.get(p) != why for p, why in found.items()):
                raise _Redecide(found)

        try:
            if check or not decision.pending or decision.failed:
                dirty_gate()  # nothing is written: decide it now
            return _finish(repo, git_dir, prefix, str(v), base, check, decision, trees, recovery, dirty_gate)
        except _Redecide as again:  # rare: the speculative objects were left unreachable
            decision = decide(repo, prefix, pack, v, selected, {**blocked, **again.blocked}, base_entries)
            return _finish(repo, git_dir, prefix, str(v), base, check, decision, trees, recovery, None)
    finally:
        for p in procs:
            p.reap()


def _base_trees(base: str, specs: dict[str, str], batch_out: bytes) -> Trees:
    """The base commit's trees on the way to the touched paths (a directory it lacks: None)."""
    objs = gitops.batch_objects(batch_out, list(specs.values()))
    if objs[specs[""]] is None or objs[specs[""]][0] != "tree":
        raise gitops.GitError(f"{base}: no tree")  # said as bad input by the caller
    return Trees({d: obj[1] if obj and obj[0] == "tree" else None for d, obj in
                  ((d, objs[spec]) for d, spec in specs.items())})


class _Redecide(Exception):
    """Touched paths git status found changed: decide again with them blocked."""

    def __init__(self, blocked: dict[str, str]):
        super().__init__(f"{len(blocked)} touched path(s) with uncommitted changes")
        self.blocked = blocked


def _untouchable(repo: Path, prefix: str, decision: Decision, touched: Sequence[str],
                 base_entries: dict[str, tuple[str, str]], ls_files_out: bytes) -> dict[str, str]:
    """{repo path: why} for touched paths whose local changes git status does
    not show: a skip-worktree or assume-unchanged entry, or bytes that are
    not the committed blob."""
    blocked = {p: f"{flag} set (git status does not show its local changes)"
               for p, flag in gitops.flagged_paths(ls_files_out).items()}
    for p in touched:
        entry = base_entries.get(p)
        data = decision.overlay.disk(p[len(prefix):])
        if p not in blocked and entry is not None and data is not None and gitops.blob_id(data) != entry[1]:
            blocked[p] = "local changes (its bytes differ from the committed file)"
    return blocked


def _finish(repo: Path, git_dir: Path, prefix: str, version: str, base: str, check: bool, decision: Decision,
            trees: Trees, recovery: str,
            gate: Callable[[], None] | None) -> ApplyReport:
    status = FAILED if decision.failed else (APPLIED if decision.pending else NOTHING_TO_DO)
    report = ApplyReport(str(repo.resolve()), version, base, base, status, decision.results, check, prefix,
                         recovery)
    if status != APPLIED or check:
        return report
    commits = write_series(repo, git_dir, prefix, base, decision, trees, gate)
    by_fix = dict(zip((f.id for f, _, _ in decision.pending), commits))
    patches = tuple(PatchResult(r.fix, r.variant, r.status, r.reason, r.hunks, by_fix.get(r.fix), r.variant_sha256)
                    for r in decision.results)
    return ApplyReport(report.tree, version, base, commits[-1], status, patches, check, prefix, recovery)
