"""Hunk placement on a list of lines: exact, offset, fuzz, or conflict.

The rules, in the order they are tried for every hunk:

1. ``exact``: the hunk's old lines (context + removed) match at the line the
   hunk header states, shifted by the offset the previous hunk of the same
   file needed (GNU patch does the same: code that moved, moved together).
   The reported ``offset`` is always relative to the line the header states.
2. ``offset``: the nearest position where the full old side matches. The
   search runs in both directions; nearest wins; two matches at the same
   nearest distance are a ``conflict`` (``ambiguous``), never a guess.
3. ``fuzz`` 1, then 2: as GNU patch, drop up to that many outer context lines
   from each end (fewer on a side that was already short of context, and a
   hunk that is short of leading context because it sits at line 1 stays
   anchored to the start of the file; short of trailing context, to the end).
   Same nearest/ambiguity rule. A fuzz level that would leave nothing to
   match is skipped.
4. ``conflict``: reported with the nearest best partial match (most equal
   lines, then nearest) and the expected versus actual lines.

Hunks of one file are placed against the file as it was before the patch, in
order, and may not overlap or go backwards (as GNU patch and git apply).
Lines are compared without their line endings, so a CRLF file matches an LF
patch; lines a hunk keeps keep their own ending, lines it adds get the file's
dominant ending. ``\\ No newline at end of file`` is honoured when writing and
ignored when matching.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..pack.model import Hunk  # the patch's hunk; placement decides where it goes
from ..vocab import HunkStatus

EXACT, OFFSET, FUZZ, CONFLICT = HunkStatus.EXACT, HunkStatus.OFFSET, HunkStatus.FUZZ, HunkStatus.CONFLICT

MAX_FUZZ = 2


@dataclass
class FileImage:
    """A text file as lines without endings plus each line's own ending
    ("\\n", "\\r\\n", or "" for a last line without newline). Bytes that are
    not UTF-8 survive a round trip (surrogateescape)."""

    lines: list[str]
    eols: list[str]

    @classmethod
    def from_bytes(cls, data: bytes) -> FileImage:
        text = data.decode("utf-8", "surrogateescape")
        if "\r" not in text:  # fast path: plain LF file
            split = text.split("\n")
            if split[-1] == "":
                split.pop()
                return cls(split, ["\n"] * len(split))
            return cls(split, ["\n"] * (len(split) - 1) + [""])
        lines: list[str] = []
        eols: list[str] = []
        parts = text.split("\n")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if last:
                if part:
                    lines.append(part)
                    eols.append("")
                break
            if part.endswith("\r"):
                lines.append(part[:-1])
                eols.append("\r\n")
            else:
                lines.append(part)
                eols.append("\n")
        return cls(lines, eols)

    def to_bytes(self) -> bytes:
        eols, n = self.eols, len(self.eols)
        lf = eols.count("\n")
        if n and (lf == n or (lf == n - 1 and eols[-1] == "")):  # fast path: plain LF
            text = "\n".join(self.lines) + ("\n" if lf == n else "")
        else:
            text = "".join(line + e for line, e in zip(self.lines, eols))
        return text.encode("utf-8", "surrogateescape")

    @property
    def eol(self) -> str:
        """The file's dominant line ending (LF on a tie or an empty file)."""
        crlf = self.eols.count("\r\n")
        if not crlf:
            return "\n"
        return "\r\n" if crlf > self.eols.count("\n") else "\n"


@dataclass(frozen=True)
class Placement:
    """Where one hunk goes. ``pos`` is the 0-based index of the first matched
    line (after fuzz trimmed ``trim_lead`` lines); ``line`` is the 1-based line
    where the whole hunk starts (for a conflict: the nearest candidate)."""

    status: HunkStatus
    offset: int = 0
    fuzz: int = 0
    line: int = 0
    pos: int = 0
    trim_lead: int = 0
    trim_trail: int = 0
    expected: list[str] | None = None
    actual: list[str] | None = None
    reason: str = ""


class _Index:
    """Candidate search over a file's lines (``list.index`` runs in C: no
    per-file dictionary to build, which matters for the many files that
    are only looked at once)."""

    def __init__(self, lines: Sequence[str]):
        self.lines = lines if isinstance(lines, list) else list(lines)

    def matches_at(self, p: int, pat: Sequence[str]) -> bool:
        lines = self.lines
        if p < 0 or p + len(pat) > len(lines):
            return False
        return all(lines[p + i] == want for i, want in enumerate(pat))

    def candidates(self, pat: Sequence[str], lo: int, hi: int) -> list[int]:
        """All p in [lo, hi] where pat matches."""
        if hi < lo:
            return []
        if not pat:
            return list(range(lo, hi + 1))
        out: list[int] = []
        lines, first = self.lines, pat[0]
        p = lo
        while True:
            try:
                p = lines.index(first, p, hi + 1)
            except ValueError:
                return out
            if self.matches_at(p, pat):
                out.append(p)
            p += 1


def _nearest(cands: list[int], expected: int) -> tuple[int | None, list[int]]:
    """Nearest candidate to expected; second value lists all tied at that distance."""
    if not cands:
        return None, []
    best = min(abs(c - expected) for c in cands)
    tied = sorted(c for c in cands if abs(c - expected) == best)
    return tied[0], tied


def _trim(h: Hunk, fuzz: int) -> tuple[int, int, bool, bool]:
    """GNU patch's fuzz arithmetic: how many context lines to drop at each end
    and whether the hunk is anchored to the start/end of the file."""
    pre, suf = h.leading_context, h.trailing_context
    context = max(pre, suf)
    pre_f = fuzz + pre - context
    suf_f = fuzz + suf - context
    anchor_start = anchor_end = False
    if pre_f < 0:
        pre_f = 0
        anchor_start = h.old_start <= 1
    if suf_f < 0:
        suf_f = 0
        anchor_end = True
    pre_f = min(pre_f, pre)
    suf_f = min(suf_f, suf)
    return pre_f, suf_f, anchor_start, anchor_end


def place_hunk(
    index: _Index, h: Hunk, expected: int, lo: int, *, max_fuzz: int = MAX_FUZZ, detail: bool = True
) -> Placement:
    """Place one hunk. ``expected`` is the 0-based position to search from,
    ``lo`` the first line it may start at (end of the previous hunk).
    ``detail=False`` skips the search for the nearest partial match."""
    n = len(index.lines)
    old = h.old_lines
    stated = max(h.old_start - 1, 0) if h.old_len else h.old_start  # insertion after line old_start
    tried: set[tuple[int, int, bool, bool]] = set()
    for fuzz in range(max_fuzz + 1):
        lead, trail, a_start, a_end = _trim(h, fuzz)
        if (lead, trail, a_start, a_end) in tried:
            continue  # this level drops nothing more than the previous one
        tried.add((lead, trail, a_start, a_end))
        pat = old[lead: len(old) - trail]
        if not pat and old:
            continue  # would match everywhere: never a guess
        lo_p, hi_p = lo, n - len(pat)
        exp_p = expected + lead
        if a_start:
            lo_p, hi_p = max(lo_p, 0), min(hi_p, 0)
        if a_end:
            lo_p = max(lo_p, n - len(pat))
        if pat and lo_p <= exp_p <= hi_p and index.matches_at(exp_p, pat):
            cands = [exp_p]  # distance 0 is unique: no search needed
        elif not pat:  # pure insertion into an empty old side
            p = min(max(exp_p, lo_p), max(hi_p, lo_p))
            if hi_p < lo_p:
                break
            cands = [p]
        else:
            cands = index.candidates(pat, lo_p, hi_p)
        best, tied = _nearest(cands, exp_p)
        if best is None:
            continue
        start = best - lead
        if len(tied) > 1:
            lines_ = " and ".join(str(c - lead + 1) for c in tied)
            return Placement(
                CONFLICT,
                offset=start - stated,
                fuzz=fuzz,
                line=start + 1,
                pos=best,
                expected=old,
                actual=list(index.lines[start: start + len(old)]),
                reason=f"ambiguous: the context matches equally near at lines {lines_}",
            )
        offset = start - stated
        status = FUZZ if fuzz else (EXACT if offset == 0 else OFFSET)
        return Placement(status, offset=offset, fuzz=fuzz, line=start + 1, pos=best,
                         trim_lead=lead, trim_trail=trail)
    if not detail:
        return Placement(CONFLICT, line=expected + 1, reason="context not found")
    return _conflict(index, h, expected, stated)


def _conflict(index: _Index, h: Hunk, expected: int, stated: int) -> Placement:
    """The nearest best partial match: most equal lines, then nearest to expected."""
    lines = index.lines
    old = h.old_lines
    m, n = len(old), len(lines)
    # best_d is compared only once a score ties, which the first candidate (score >= 0 > -1) never does
    best_p, best_score, best_d = max(0, min(expected, max(n - m, 0))), -1, sys.maxsize
    if m:
        for p in range(max(n - m, 0) + 1):
            score = 0
            for i in range(min(m, n - p)):
                if lines[p + i] == old[i]:
                    score += 1
            d = abs(p - expected)
            if score > best_score or (score == best_score and d < best_d):
                best_p, best_score, best_d = p, score, d
    actual = list(lines[best_p: best_p + m])
    if best_score <= 0:
        reason = f"context not found (expected near line {expected + 1})"
    else:
        reason = f"context not found; nearest candidate at line {best_p + 1} ({best_score}/{m} lines equal)"
    return Placement(CONFLICT, offset=best_p - stated, fuzz=0, line=best_p + 1, pos=best_p,
                     expected=old, actual=actual, reason=reason)


def place_hunks(lines: Sequence[str], hunks: Sequence[Hunk], *, max_fuzz: int = MAX_FUZZ,
                detail: bool = True) -> list[Placement]:
    """Place every hunk of one file, in order, against the file before the patch.
    With ``detail=False`` (a yes/no check) it stops at the first conflict."""
    index = _Index(lines)
    out: list[Placement] = []
    delta = 0
    lo = 0
    for h in hunks:
        stated = max(h.old_start - 1, 0) if h.old_len else h.old_start
        pl = place_hunk(index, h, stated + delta, lo, max_fuzz=max_fuzz, detail=detail)
        out.append(pl)
        if pl.status == CONFLICT and not detail:
            break
        if pl.status != CONFLICT:
            delta = pl.offset
            lo = pl.pos + len(h.old_lines) - pl.trim_lead - pl.trim_trail
    return out


def apply_hunks(image: FileImage, hunks: Sequence[Hunk], placements: Sequence[Placement]) -> FileImage:
    """Build the new image from placements that are all non-conflict."""
    eol = image.eol
    new_lines: list[str] = []
    new_eols: list[str] = []
    cur = 0
    for h, pl in zip(hunks, placements):
        assert pl.status != CONFLICT
        body = list(h.lines)
        # drop the fuzzed-away outer context: the file's own lines stay there
        body = body[pl.trim_lead: len(body) - pl.trim_trail]
        new_lines.extend(image.lines[cur: pl.pos])
        new_eols.extend(image.eols[cur: pl.pos])
        p = pl.pos
        n_new = sum(1 for tag, _ in body if tag != "-")
        emitted = 0
        for tag, text in body:
            if tag == " ":
                new_lines.append(image.lines[p])
                new_eols.append(image.eols[p])
                p += 1
                emitted += 1
            elif tag == "-":
                p += 1
            else:
                emitted += 1
                last_new = emitted == n_new and pl.trim_trail == 0
                new_lines.append(text)
                new_eols.append("" if (last_new and h.new_no_eol) else eol)
        cur = p
    new_lines.extend(image.lines[cur:])
    new_eols.extend(image.eols[cur:])
    # a line that lost its "last line" status must get a newline again (list.index: the scan runs in C)
    i = -1
    while True:
        try:
            i = new_eols.index("", i + 1, len(new_eols) - 1)
        except ValueError:
            break
        new_eols[i] = eol
    # the patch says the new last line ends without newline: honour it at EOF
    if new_lines and hunks and placements:
        h, pl = hunks[-1], placements[-1]
        if h.new_no_eol and pl.trim_trail == 0:
            end = pl.pos + len(h.old_lines) - pl.trim_lead
            if end == len(image.lines):
                new_eols[-1] = ""
            # else: drifted away from EOF: keep the newline (safe choice)
        elif h.old_no_eol and not h.new_no_eol and pl.trim_trail == 0 and new_eols[-1] == "":
            end = pl.pos + len(h.old_lines) - pl.trim_lead
            if end == len(image.lines):
                new_eols[-1] = eol
    return FileImage(new_lines, new_eols)
