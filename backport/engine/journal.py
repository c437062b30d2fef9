"""The apply journal and recovery from an interrupted apply (see write.py for
the order of the writes it guards).

``<git dir>/sglang-backport-apply.json``::

    {"schema": "sglang-backport/apply-journal/1", "pid": 123, "proc_start": "...",
     "phase": "objects" | "files", "base": SHA, "target": SHA | null,
     "message": "sglang-backport: apply N patch(es)",
     "files": [{"path": "sglang/...", "before": SHA256 | null, "after": SHA256 | null,
                "mode_before": 420 | null, "mode_after": 420 | null}],
     "token": "9f...", "pack": "pack-<id>" | null, "locks": [path, ...], "locks_at": 1.7e9}

It is written whole (a temporary file renamed into place), so it is either
the old or the new version, never torn. The last four name what the run
creates in ``.git`` before it creates it (leftovers.py): its temporary pack
files (by the token), the pack (once named, when this run creates it), and
the ref locks git takes for the commit point; recovery removes those and
nothing else. A journal without them (an earlier version's) recovers as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import gitops
from ..errors import BadInput
from . import index_refs, leftovers

JOURNAL_NAME = "sglang-backport-apply.json"
NEXT_INDEX = "sglang-backport-index"
SCHEMA = "sglang-backport/apply-journal/1"
OBJECTS, FILES = "objects", "files"
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def tmp_name(name: str) -> str:
    """The temporary file a file is written to before it is renamed over ``name``."""
    return f".{name}.sglang-backport.tmp"


@dataclass(frozen=True)
class FileMove:
    path: str  # relative to the repository root
    before: str | None  # sha256 of the bytes before; None: the file did not exist
    after: str | None  # sha256 of the bytes after; None: the series deletes it
    mode_before: int | None  # permission bits
    mode_after: int | None


@dataclass(frozen=True)
class Journal:
    pid: int
    proc_start: str  # the process's start time, so a reused pid is not taken for a live run
    phase: str  # objects | files
    base: str
    target: str | None
    message: str
    files: tuple[FileMove, ...] = ()
    token: str = ""  # names this run's temporary pack files
    pack: str | None = None  # the pack this run creates, once named
    locks: tuple[str, ...] = field(default=())  # the ref locks git takes for the commit point
    locks_at: float = 0.0  # when they were named: a lock older than this is not this run's

    @classmethod
    def start(cls, base: str, message: str) -> Journal:
        return cls(
            os.getpid(), _proc_start(os.getpid()), OBJECTS, base, None, message, token=secrets.token_hex(8)
        )

    def with_files(self, target: str, files: tuple[FileMove, ...], locks: list[Path]) -> Journal:
        return replace(self, phase=FILES, target=target, files=files, locks=tuple(map(str, locks)),
                       locks_at=_now())

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "pid": self.pid, "proc_start": self.proc_start, "phase": self.phase,
                "base": self.base, "target": self.target, "message": self.message,
                "files": [vars(f) for f in self.files], "token": self.token, "pack": self.pack,
                "locks": list(self.locks), "locks_at": self.locks_at}

    def _write_tmp(self, git_dir: Path) -> Path:
        tmp = git_dir / f"{JOURNAL_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return tmp

    def create(self, git_dir: Path) -> None:
        """Write the journal where none exists (a link never replaces a file:
        the journal is also the lock against a second apply)."""
        tmp = self._write_tmp(git_dir)
        try:
            os.link(tmp, git_dir / JOURNAL_NAME)
        except FileExistsError:
            raise BadInput(f"{git_dir / JOURNAL_NAME}: another sglang-backport apply is writing this "
                           f"checkout") from None
        finally:
            tmp.unlink()

    def save(self, git_dir: Path) -> None:
        os.replace(self._write_tmp(git_dir), git_dir / JOURNAL_NAME)

    @classmethod
    def read(cls, git_dir: Path) -> Journal | None:
        path = git_dir / JOURNAL_NAME
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise BadInput(f"{path}: unreadable journal of an interrupted apply ({e}); check the tree "
                           f"by hand, then remove it") from None
        try:
            if doc["schema"] != SCHEMA or doc["phase"] not in (OBJECTS, FILES):
                raise KeyError("schema")
            files = tuple(FileMove(**f) for f in doc["files"])
            return cls(int(doc["pid"]), str(doc["proc_start"]), doc["phase"], doc["base"], doc["target"],
                       doc["message"], files, str(doc.get("token") or ""), doc.get("pack"),
                       tuple(map(str, doc.get("locks") or ())), float(doc.get("locks_at") or 0))
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"{path}: not a journal this version understands ({e}); check the tree by "
                           f"hand, then remove it") from None


def _now() -> float:
    return time.time()


def _proc_start(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); "" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(journal: Journal) -> bool:
    """Is the run that wrote the journal still running (another process)?"""
    if journal.pid == os.getpid():
        return False
    try:
        os.kill(journal.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not journal.proc_start or _proc_start(journal.pid) == journal.proc_start


def _sha256_of(f: Path) -> str | None:
    try:
        return hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() and not f.is_symlink() else None
    except OSError:
        return None


def put_file(repo: Path, path: str, data: bytes | None, mode: int | None) -> None:
    """Replace a file whole (a new inode: other hard links, such as a cache's,
    never change), or delete it and the directories it leaves empty."""
    f = repo / path
    if data is None:
        if os.path.lexists(f):
            f.unlink()
        _prune_dirs(f.parent, repo)
        return
    folder, name = os.path.split(f)
    tmp = os.path.join(folder, tmp_name(name))
    try:
        fd = os.open(tmp, _NEW_FILE, 0o600)  # a link left at the temporary name is refused, never followed
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, _NEW_FILE, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, mode if mode is not None else 0o644)
    finally:
        os.close(fd)
    os.replace(tmp, f)


def _prune_dirs(d: Path, stop: Path) -> None:
    stop = stop.resolve()
    while d.resolve() != stop and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


def _unlink(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def recover(repo: Path, git_dir: Path, pending_ref: str) -> str:
    """Finish or roll back an interrupted apply; what was done ("" when there
    was nothing to do). BadInput, changing nothing, when another apply is
    running or a file changed since the interruption."""
    path = git_dir / JOURNAL_NAME
    journal = Journal.read(git_dir)
    if journal is None:
        stale = [p for p in (git_dir / NEXT_INDEX, git_dir / f"{NEXT_INDEX}.lock") if p.exists()]
        _unlink(*stale)
        if gitops.read_ref(repo, pending_ref):
            index_refs.delete_ref(repo, pending_ref)
            stale.append(Path(pending_ref))
        return (
            f"removed leftovers of an interrupted apply ({', '.join(p.name for p in stale)})" if stale else ""
        )
    if _alive(journal):
        raise BadInput(f"{path}: another sglang-backport apply (pid {journal.pid}) is writing this checkout")
    head = gitops.read_ref(repo, "HEAD")
    if journal.phase == OBJECTS or head == journal.base:
        forward = False
    elif head == journal.target:
        forward = True
    else:
        raise BadInput(f"{path}: HEAD is {head}, neither the base {journal.base} nor the series "
                       f"{journal.target} of the interrupted apply; check the tree by hand")
    todo = []
    for mv in journal.files:  # check every file before writing any
        want, cur = (mv.after if forward else mv.before), _sha256_of(repo / mv.path)
        if cur == want:
            continue
        if cur not in (mv.before, mv.after):
            raise BadInput(f"{repo / mv.path}: changed since the interrupted apply (neither its old nor its "
                           f"new content); {path} is kept: restore the file, then run again")
        todo.append(mv)
    rev = journal.target if forward else journal.base
    specs = [f"{rev}:{mv.path}" for mv in todo if (mv.after if forward else mv.before) is not None]
    blobs = gitops.read_blobs(repo, specs) if specs else {}
    for mv in todo:
        want = mv.after if forward else mv.before
        data = None if want is None else blobs.get(f"{rev}:{mv.path}")
        if want is not None and (data is None or hashlib.sha256(data).hexdigest() != want):
            short = (rev or "")[:12]
            raise BadInput(f"{path}: cannot recover {mv.path}: {short} does not hold the recorded content")
        put_file(repo, mv.path, data, mv.mode_after if forward else mv.mode_before)
    for mv in journal.files:
        f = repo / mv.path
        _unlink(f.with_name(tmp_name(f.name)))
    cleared = leftovers.clear(git_dir, token=journal.token, pack=journal.pack, locks=list(journal.locks),
                              locks_at=journal.locks_at, target=journal.target, forward=forward)
    nxt = git_dir / NEXT_INDEX
    if forward:
        index_refs.index_twin(git_dir / "index", nxt)
        index_refs.update_index(repo, [mv.path for mv in journal.files], nxt)
        index_refs.swap_index(nxt, git_dir / "index")
    _unlink(nxt, git_dir / f"{NEXT_INDEX}.lock")
    if gitops.read_ref(repo, pending_ref):
        index_refs.delete_ref(repo, pending_ref)
    path.unlink()
    also = f"; removed its {', '.join(cleared)}" if cleared else ""
    if forward:
        return (f"finished an interrupted apply: {len(journal.files)} file(s) and the index moved to "
                f"{journal.target}{also}")
    return f"rolled back an interrupted apply: the tree is as at {journal.base}{also}"
