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
4. the decision loop on an in-memory overlay (decide.py). Alongside it: the
   base commit's trees on the way to the touched paths (the touched files'
   committed entries, and what objects.py builds the commits from), read
   straight from loose objects, or by ``git cat-file --batch`` where one is
   packed; and in the background git reports the touched paths' index flags
   (``ls-files -v``) and the staged paths (``diff-index --cached`` against the
   base: no work-tree file is read, so it costs the same whatever the tree's
   size). Every git here only reads, with ``--no-optional-locks``, so even a
   refused run leaves the index file byte for byte as it was;
5. the checkout rule of ``git am`` and ``git cherry-pick``: the index must
   match the base commit (no staged change, no unmerged path), and a file the
   series may touch (any path of a selected fix's variants) must be exactly
   its committed blob. A checkout that breaks the rule is refused unless
   ``allow_dirty``, which lets staged changes elsewhere through (they stay
   staged) and fails the fix that would change such a file instead. A file
   with a skip-worktree or assume-unchanged flag always fails the fix that
   would change it (git hides its local changes). Unstaged edits to files the
   series does not touch are left as they are (still unstaged, on top of the
   new HEAD): they were never at risk, and finding them costs a stat of every
   tracked file (the rule before 2026-12 did; see docs/reference.md, "apply");
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

import dataclasses
import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from .. import gitops
from ..errors import BadInput
from ..pack.model import Pack, PatchVariant, check_rel_path, parse_version
from ..vocab import ApplyStatus
from .decide import Decision, decide
from .journal import JOURNAL_NAME, NEXT_INDEX, recover
from .leftovers import foreign_locks
from .objects import Trees, base_tree_specs, read_loose_trees
from .report import ApplyReport
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
                    exists = not stat.S_ISLNK(os.lstat(os.path.join(repo, rel)).st_mode)
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
    held = [] if check else foreign_locks(git_dir)  # recovery removed this toolkit's own: these are a git's
    if held:
        raise BadInput(f"{held[0]}: exists and no journal of this toolkit names it; another git process is "
                       f"updating {repo}'s refs (or one was killed): wait for it, or remove the lock once no "
                       f"git runs there")
    touched = sorted({prefix + fp.path for fid in selected for pv in pack.variants.get(fid, ())
                      for fp in pv.files})
    specs = base_tree_specs(base, touched)
    loose = read_loose_trees(gitops.objects_dir(git_dir), base, specs)
    # at most two readers at once: a third git started while both run waits ~3 ms for a core
    # before it can exec, and holds this thread (and the GIL) that long
    procs: list[gitops.Background] = []
    try:
        flags = _start(procs, repo, *gitops.flags_args(touched))
        second = (_start(procs, repo, *gitops.staged_args(base)) if loose is not None else
                  _start(procs, repo, *gitops.batch_args(), input=gitops.batch_input(list(specs.values()))))
        seen: dict[str, bool] = {}
        for fid in selected:  # security, before anything else
            for pv in pack.variants.get(fid, ()):
                _check_symlinks(repo, prefix, pv, seen)
        decision = decide(repo, prefix, pack, v, selected, {}, None)
        if loose is not None:
            trees, staged_diff = loose, second
        else:
            staged_diff = _start(procs, repo, *gitops.staged_args(base))  # the two are done by now
            try:
                trees = _base_trees(base, specs, second.result())
            except gitops.GitError:
                raise BadInput(f"{repo}: HEAD {base} is not a commit in this repository") from None
        base_entries = trees.entries(touched)
        if any(prefix + rel not in base_entries and existed for rel, existed in decision.changed_paths()):
            decision = decide(repo, prefix, pack, v, selected, {}, base_entries)  # an untracked file
        flagged, changed = _untouchable(repo, prefix, decision, touched, base_entries, flags.result())
        staged = gitops.staged_paths(staged_diff.result())
        if staged and not allow_dirty:
            raise BadInput(f"{repo}: staged changes in {len(staged)} file(s) (e.g. {min(staged)}); commit or "
                           f"stash them, or allow dirty trees")
        changed.update((p, "staged") for p in staged.intersection(touched) if p not in flagged)
        if changed and not allow_dirty:
            path, what = min(changed.items())
            raise BadInput(
                f"{repo}: uncommitted changes in {len(changed)} file(s) the series may change (e.g. "
                f"{path}: {what}); commit or stash them, or allow dirty trees"
            )
        blocked = {**{p: f"uncommitted changes ({what})" for p, what in changed.items()}, **flagged}
        if blocked:
            decision = decide(repo, prefix, pack, v, selected, blocked, base_entries)
        return _finish(repo, git_dir, prefix, str(v), base, check, decision, trees, recovery)
    finally:
        for p in procs:
            p.reap()


def _start(
    procs: list[gitops.Background], repo: Path, *args: str, input: bytes | None = None
) -> gitops.Background:
    procs.append(gitops.Background(repo, *args, input=input))  # reaped on every way out
    return procs[-1]


def _base_trees(base: str, specs: dict[str, str], batch_out: bytes) -> Trees:
    """The base commit's trees on the way to the touched paths (a directory it lacks: None)."""
    objs = gitops.batch_objects(batch_out, list(specs.values()))
    root = objs[specs[""]]
    if root is None or root[0] != "tree":
        raise gitops.GitError(f"{base}: no tree")  # said as bad input by the caller
    return Trees.parse({d: obj[1] if obj and obj[0] == "tree" else None for d, obj in
                        ((d, objs[spec]) for d, spec in specs.items())})


def _untouchable(
    repo: Path,
    prefix: str,
    decision: Decision,
    touched: Sequence[str],
    base_entries: dict[str, tuple[str, str]],
    ls_files_out: bytes,
) -> tuple[dict[str, str], dict[str, str]]:
    """The touched paths the engine must not touch, {repo path: why}: flagged (a skip-worktree or
    assume-unchanged entry: git status does not show its local changes) and changed (bytes that
    are not the committed blob, or a committed file gone from the work tree)."""
    flagged = {p: f"{flag} set (git status does not show its local changes)"
               for p, flag in gitops.flagged_paths(ls_files_out).items()}
    changed = {}
    for p in touched:
        entry = base_entries.get(p)
        if p in flagged or entry is None:  # not in the base commit: decide says whether a file is in the way
            continue
        if (data := decision.overlay.disk(p[len(prefix):])) is None:
            changed[p] = "deleted from the work tree"
        elif gitops.blob_id(data) != entry[1]:
            changed[p] = "its bytes differ from the committed file"
    return flagged, changed


def _finish(repo: Path, git_dir: Path, prefix: str, version: str, base: str, check: bool, decision: Decision,
            trees: Trees, recovery: str) -> ApplyReport:
    status = (ApplyStatus.FAILED if decision.failed
              else ApplyStatus.APPLIED if decision.pending else ApplyStatus.NOTHING_TO_DO)
    report = ApplyReport(str(repo.resolve()), version, base, base, status, decision.results, check, prefix,
                         recovery)
    if status != ApplyStatus.APPLIED or check:
        return report
    commits = write_series(repo, git_dir, prefix, base, decision, trees)
    by_fix = dict(zip((f.id for f, _, _ in decision.pending), commits))
    # every field kept but the commit (the cause of a not-applicable fix too: readers judge by it)
    patches = tuple(dataclasses.replace(r, commit=by_fix.get(r.fix)) for r in decision.results)
    return ApplyReport(report.tree, version, base, commits[-1], status, patches, check, prefix, recovery)
