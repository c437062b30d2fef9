"""The tree as the series sees it: files on disk plus the changes of the
patches placed so far, all in memory (nothing is written here).

``patch_file`` places one file of a patch on the overlay (forward, or in
reverse to ask whether the tree already holds the patched state);
``reverse_applies`` is that question for a whole variant, used by the
decision loop and by ``detect``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ..pack.model import FilePatch, Hunk, PatchVariant
from .placement import CONFLICT, EXACT, FileImage, apply_hunks, place_hunks
from .report import HunkResult


class Overlay:
    """The tree under the package root, as files on disk plus pending changes."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._disk: dict[str, tuple[bytes, int] | None] = {}  # (bytes, permission bits) of a regular file
        self.changes: dict[str, bytes | None] = {}
        self.modes: dict[str, str] = {}  # mode of files created by the series
        self._images: dict[str, tuple[bytes, FileImage]] = {}

    def disk(self, rel: str) -> bytes | None:
        """The bytes of the regular file at rel (None: absent, a symlink, or not a regular file)."""
        if rel not in self._disk:
            self._disk[rel] = _read_regular(os.path.join(self.root, rel))
        got = self._disk[rel]
        return None if got is None else got[0]

    def disk_mode(self, rel: str) -> int | None:
        """The permission bits of the regular file at rel, as read with its bytes."""
        self.disk(rel)
        got = self._disk[rel]
        return None if got is None else got[1]

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


_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a symlink fails, a FIFO never blocks


def _read_regular(path: str) -> tuple[bytes, int] | None:
    try:
        fd = os.open(path, _READ)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        chunks = []
        while chunk := os.read(fd, max(st.st_size, 1 << 16) + 1):
            chunks.append(chunk)
        return b"".join(chunks), stat.S_IMODE(st.st_mode)
    except OSError:
        return None
    finally:
        os.close(fd)


def _lines_bytes(lines: Sequence[str], no_eol: bool) -> bytes:
    img = FileImage(list(lines), ["\n"] * len(lines))
    if lines and no_eol:
        img.eols[-1] = ""
    return img.to_bytes()


def patch_file(
    fp: FilePatch, ov: Overlay, *, reverse: bool, fuzz: int = 2
) -> tuple[list[HunkResult], bytes | None, bool]:
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
        return (
            [HunkResult(path, CONFLICT, line=0, expected=expected, actual=actual, reason=reason)],
            None,
            False,
        )

    if creation:
        if ov.exists(path):
            return fail("file to create already exists")
        new = [line for h in hunks for line in h.new_lines]
        no_eol = bool(hunks) and hunks[-1].new_no_eol
        return [HunkResult(path, EXACT, line=1) for _ in hunks] or [HunkResult(path, EXACT, line=1)], \
            _lines_bytes(new, no_eol), True
    if cur is None:
        return fail("file to patch does not exist" if not ov.exists(path) else "not a regular file")
    img = ov.image(path, cur)
    if deletion:
        old = [line for h in hunks for line in h.old_lines]
        if img.lines != old:
            return fail("file to delete differs from the patch's old content", old, img.lines[: len(old) + 3])
        return (
            [HunkResult(path, EXACT, line=1) for _ in hunks] or [HunkResult(path, EXACT, line=1)],
            None,
            True,
        )
    pls = place_hunks(img.lines, hunks, max_fuzz=fuzz, detail=not reverse)
    results = [
        HunkResult(path, p.status, p.offset, p.fuzz, p.line, p.expected, p.actual, p.reason) for p in pls
    ]
    if any(p.status == CONFLICT for p in pls):
        return results, None, False
    return results, apply_hunks(img, hunks, pls).to_bytes(), True


def reverse_applies(ov: Overlay, variant: PatchVariant, fuzz: int = 0) -> bool:
    """True when every file of the variant reverse-applies (by default
    cleanly: exact or offset, no fuzz, no ambiguity): the tree already holds
    the patched state."""
    for fp in variant.files:
        _, _, ok = patch_file(fp, ov, reverse=True, fuzz=fuzz)
        if not ok:
            return False
    return True
