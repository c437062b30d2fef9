"""Writing a decided series into a git work tree, so that no signal or crash
leaves it half-patched.

The order (each step a crash point the next run recovers from):

1. create the journal ``<git dir>/sglang-backport-apply.json`` (O_EXCL: it is
   also the lock against a second apply), phase ``objects``;
2. every blob, tree and commit is written, as one pack (objects.py); nothing
   points at them and nothing in the work tree moves yet. Its temporary files
   carry the journal's token, and the journal names the pack before it is
   renamed into place, so recovery removes both (leftovers.py);
3. the journal becomes phase ``files``: base and series commits, per path
   the sha256 of its bytes before and after and its modes, and the ref locks
   step 6's git will take (a SIGKILL while git holds them leaves them: recovery
   removes these, never a lock the journal does not name);
4. each file is replaced whole (a temporary file renamed over it: a file is
   always either as before or as after, never torn), one after the other (threads
   measured slower: the other core hashes each file for the index as it lands);
   deletions unlink;
5. a second name of the index gets the new entries (``GIT_INDEX_FILE``: git's own
   ``index.lock`` is never taken, so none can be left behind; git writes an index to
   ``<name>.lock`` and renames it, so the index itself is never written through the
   hard link): ``git update-index`` is started before step 2, and it is given each path
   once its file is whole, so git's start and the hashing overlap the writes;
6. one ref transaction moves HEAD from the base to the last commit: this is
   the commit point (``git update-ref`` too is started before step 2, and is given the
   transaction here);
7. the new index replaces the old (rename), the journal is removed.

Recovery (``recover``: the next run, or this one after an error) reads the
journal: before the commit point (HEAD at the base) every file goes back to
its old bytes and the index was never replaced; after it (HEAD at the
series) every file goes to its new bytes and the index is rebuilt. Contents
come from the commits themselves; a file whose bytes are neither the old nor
the new ones (edited after the crash) is never overwritten: BadInput, and
the journal stays. SIGINT, SIGTERM and SIGHUP are held during steps 1-7 and
delivered after them. A power loss is not covered (nothing is fsynced).

``SGLANG_BACKPORT_FAULT_LOG`` / ``SGLANG_BACKPORT_FAULT_PAUSE`` are the
fault-injection seam of the tests: each step is logged, and the run pauses
at step N (``N`` or ``N:seconds``) so that a test can kill it there.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

from .. import gitops
from ..errors import BadInput
from ..pack.model import Fix, PatchVariant
from . import index_refs
from .decide import Decision
from .journal import JOURNAL_NAME, NEXT_INDEX, FileMove, Journal, put_file, recover
from .leftovers import ref_locks
from .objects import Trees, write_commits

PENDING_REF = (
    "refs/sglang-backport/pending"  # an earlier version kept its objects here: recovery still drops it
)
AUTHOR = "sglang-backport <sglang-backport@localhost>"
UPSTREAM_REPO = "sgl-project/sglang"
VENDOR_TRAILER = "Vendor-Fix:"  # tree.py knows a toolkit commit by this or Backport-Of:
FAULT_LOG, FAULT_PAUSE = "SGLANG_BACKPORT_FAULT_LOG", "SGLANG_BACKPORT_FAULT_PAUSE"
log = logging.getLogger("backport.engine")


def commit_message(fix: Fix, variant: PatchVariant) -> str:
    desc = variant.header.get("Description", "").strip()
    notes = variant.header.get("Backport-Notes", "").strip()
    title = f"sglang-backport {fix.id}: {fix.title}" if fix.is_vendor else f"Backport #{fix.pr}: {fix.title}"
    parts = [title, desc]
    if notes:
        parts.append("Backport notes: " + notes)
    if fix.is_vendor:  # this pack's own fix: nothing upstream to point at but its design
        parts.append(f"{VENDOR_TRAILER} {fix.id}\n"
                     f"Design-Reference: {fix.url}\n"
                     f"Backport-Variant: {variant.name}")
    else:
        parts.append(f"Backport-Of: {UPSTREAM_REPO}#{fix.pr}\n"
                     f"Upstream-Commit: {fix.upstream_commit}\n"
                     f"Backport-Variant: {variant.name}")
    return "\n\n".join(p for p in parts if p) + "\n"


def _epoch(d: _dt.date) -> int:
    return int(_dt.datetime(d.year, d.month, d.day, tzinfo=_dt.UTC).timestamp())


def _sha256(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _mode_bits(mode: str) -> int:
    return 0o755 if mode == "100755" else 0o644


def plan_commits(prefix: str, decision: Decision, trees: Trees) -> list[tuple]:
    """The series' commits for objects.write_commits: (author, message, epoch,
    {repo path: (mode, data) | None}); a file keeps its mode in the base
    commit, a created file gets the patch's."""
    paths = [prefix + rel for _, _, changes in decision.pending for rel in changes]
    modes = {p: m for p, (m, _) in trees.entries(paths).items()}
    commits = []
    for fix, variant, changes in decision.pending:
        cc: dict[str, tuple[str, bytes] | None] = {}
        for rel, data in changes.items():
            rp = prefix + rel
            if data is None:
                cc[rp] = None
                modes.pop(rp, None)
            else:
                modes.setdefault(rp, decision.overlay.modes.get(rel, "100644"))
                cc[rp] = (modes[rp], data)
        commits.append((AUTHOR, commit_message(fix, variant), _epoch(variant.last_update), cc))
    return commits


def plan_moves(prefix: str, decision: Decision) -> tuple[FileMove, ...]:
    moves = []
    for rel, after in decision.final_contents().items():
        before = decision.overlay.disk(rel)
        mode_before = decision.overlay.disk_mode(rel)
        mode_after = (
            mode_before if mode_before is not None else _mode_bits(decision.overlay.modes.get(rel, ""))
        )
        moves.append(FileMove(prefix + rel, _sha256(before), _sha256(after), mode_before,
                              None if after is None else mode_after))
    return tuple(moves)


def write_series(repo: Path, git_dir: Path, prefix: str, base: str, decision: Decision,
                 trees: Trees) -> list[str]:
    """Commit the decided series and move the work tree, index and HEAD to it
    (see the module docstring); the commits' ids, in series order."""
    commits = plan_commits(prefix, decision, trees)
    moves = plan_moves(prefix, decision)
    final = {prefix + rel: data for rel, data in decision.final_contents().items()}
    message = f"sglang-backport: apply {len(commits)} patch(es)"
    journal = Journal.start(base, message)
    steps = _Steps()
    shas: list[str] = []

    def name_pack(name: str) -> None:  # before the pack exists: recovery removes it if it rolls back
        nonlocal journal
        journal = replace(journal, pack=name)
        journal.save(git_dir)

    with _HeldSignals():
        journal.create(git_dir)
        try:
            steps("objects")
            next_index = git_dir / NEXT_INDEX
            # both gits start (exec, config, the index loaded) while the objects are written
            index = index_refs.IndexUpdate(repo, git_dir / "index", next_index)
            refs = None
            try:
                refs = index_refs.RefUpdate(repo, message)
                shas = write_commits(gitops.objects_dir(git_dir), base, trees, commits, token=journal.token,
                                     on_named=name_pack)
                steps("journal")
                journal = journal.with_files(shas[-1], moves, ref_locks(git_dir))
                journal.save(git_dir)
                for mv in moves:  # in order: a pause at one step stops the files after it
                    steps(f"file {mv.path}")
                    put_file(repo, mv.path, final[mv.path], mv.mode_after)
                    index.add(mv.path)  # git hashes it while the next one is written
                steps("index")
                index.finish()
                steps("head")
                refs.commit([("HEAD", shas[-1], base)])
            finally:
                index.reap()
                if refs is not None:
                    refs.reap()
            steps("swap index")
            index_refs.swap_index(next_index, git_dir / "index")
            steps("done")
            (git_dir / JOURNAL_NAME).unlink()
        except BaseException as exc:
            try:
                outcome = recover(repo, git_dir, PENDING_REF)
            except (
                OSError,
                BadInput,
                gitops.GitError,
            ) as again:  # the first error matters; the journal stays
                log.error("recovery after %s failed: %s", type(exc).__name__, again)
                raise exc from None
            if not (shas and gitops.read_ref(repo, "HEAD") == shas[-1]):
                raise
            log.warning("%s after the commit point: %s", exc, outcome)
    return shas


class _Steps:
    """The fault-injection seam (see the module docstring); free when unset."""

    def __init__(self):
        self.log = os.environ.get(FAULT_LOG)
        pause = os.environ.get(FAULT_PAUSE, "")
        at, _, secs = pause.partition(":")
        self.pause_at = int(at) if at.isdigit() else 0
        self.secs = float(secs) if secs else 60.0
        self.n = 0

    def __call__(self, name: str) -> None:
        if not self.log:
            return
        self.n += 1
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(f"{self.n} {name}\n")
        if self.n == self.pause_at:
            time.sleep(self.secs)


class _HeldSignals:
    """Hold SIGINT/SIGTERM/SIGHUP while the work tree moves; deliver them after."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self.saved: dict[int, object] = {}
        self.got: list[int] = []
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.saved[sig] = signal.signal(sig, lambda signum, _frame: self.got.append(signum))
        return self

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        for sig in dict.fromkeys(self.got):
            signal.raise_signal(sig)
        return False
