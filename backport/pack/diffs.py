"""The diff of a patch file, parsed by ``unidiff`` and held to the pack's rules.

unidiff (1.x) parses the diff and reports what a file entry is: binary, a
rename, its git modes (so symlinks and submodules), and counts each hunk's
lines against its header (a hunk shorter than its header says is an error).
Checked here, because unidiff is lenient about them:

* every line of the diff belongs somewhere: free text is allowed before the
  first file (quilt style) and blank lines at the end; a line after a
  complete hunk that is neither a hunk header, a file header nor a
  ``\\ No newline`` marker means the hunk's counts lie (unidiff would drop it);
* a git header carries only the lines git writes for a content change;
* the diff ends with a newline: a patch cut in the middle of its last line
  has complete hunk counts but a broken last line, and would apply;
* only regular files (100644, 100755), no mode change, no rename or copy;
* paths: ``a/``/``b/`` prefixes, relative, no ``..``, nothing in ``.git``,
  and inside the package directory ``sglang/`` (model.check_confined).

Creation and deletion are decided by ``/dev/null`` on one side, as git apply
does (unidiff's ``is_added_file`` also calls an edit of an existing empty
file an addition).
"""

from __future__ import annotations

from unidiff import PatchedFile, PatchSet
from unidiff.constants import DEV_NULL
from unidiff.errors import UnidiffParseError

from ..errors import BadInput
from .model import FilePatch, Hunk, check_confined

REGULAR_MODES = ("100644", "100755")
_GIT_HEADER_LINES = ("index ", "new file mode ", "deleted file mode ", "old mode ", "new mode ",
                     "similarity index ", "dissimilarity index ", "rename from ", "rename to ",
                     "copy from ", "copy to ", "--- ", "+++ ")


def parse_diff(body: str, where: str) -> tuple[PatchSet, tuple[FilePatch, ...]]:
    """The diff's unidiff PatchSet and its files, or BadInput naming the problem."""
    if not body.strip():
        raise BadInput(f"{where}: no diff after the header")
    if not body.endswith("\n"):
        raise BadInput(f"{where}: the diff's last line has no newline (truncated in the middle of a line?)")
    _check_git_header_names(body.split("\n"), where)
    try:
        ps = PatchSet(body)
    except UnidiffParseError as e:
        raise BadInput(f"{where}: {_parse_error(str(e))}") from None
    if not ps:
        raise BadInput(f"{where}: no diff after the header")
    for pf in ps:
        _check_kind(pf, where)
    _check_every_line(ps, body.split("\n")[:-1], where)
    files: list[FilePatch] = []
    seen: set[str] = set()
    for pf in ps:
        fp = _file_patch(pf, where)
        if fp.path in seen:
            raise BadInput(f"{where}: {fp.path} appears twice in the diff")
        seen.add(fp.path)
        files.append(fp)
    return ps, tuple(files)


def _check_git_header_names(lines: list[str], where: str) -> None:
    """The names in a ``diff --git a/X b/Y`` line are the ones its ``---``/``+++`` lines give.

    git apply refuses a patch whose header and file lines disagree ("inconsistent
    filename"); unidiff keeps one of them depending on its version, so the patch
    could name one file in one place and change another. Checked before parsing.
    """
    for n, text in enumerate(lines, 1):
        if not text.startswith("diff --git "):
            continue
        names: dict[str, str | None] = {"--- ": None, "+++ ": None}
        for follow in lines[n:]:
            if follow.startswith(("diff --git ", "@@")):
                break
            if follow[:4] in names and names[follow[:4]] is None:
                names[follow[:4]] = follow[4:].split("\t", 1)[0]
        old, new = names["--- "], names["+++ "]
        if old is None or new is None:
            continue  # a header-only entry (mode change, binary): _check_kind judges it
        a = old if old != DEV_NULL else "a/" + new.removeprefix("b/")
        b = new if new != DEV_NULL else "b/" + old.removeprefix("a/")
        if text[len("diff --git "):] != f"{a} {b}":
            raise BadInput(f"{where}: diff line {n}: inconsistent file names: {text[:80]!r} "
                           f"disagrees with '--- {old}' / '+++ {new}'")


def _parse_error(msg: str) -> str:
    if "shorter than expected" in msg:
        return "truncated hunk (fewer lines than its header counts)"
    if "longer than expected" in msg:
        return "hunk line counts do not match its header"
    if msg.startswith("Unexpected hunk") or "binary patch marker" in msg:
        return "hunk or binary data before any file header"
    return f"malformed diff ({msg.strip()[:80]})"


def _check_every_line(ps: PatchSet, lines: list[str], where: str) -> None:
    """Every line of the diff is a file header line, a hunk line, preamble
    before the first file, or a blank line at the end (line numbers 1-based)."""
    role: dict[int, str] = {}
    starts: list[int] = []
    for pf in ps:
        hunk_headers = [min(ln.diff_line_no for ln in h if ln.diff_line_no) - 1 for h in pf]
        header_line = pf.diff_line_no
        assert header_line is not None  # unidiff numbers every file it parsed
        is_git = _line(lines, header_line).startswith("diff --git ")
        start = header_line if is_git else header_line - 1
        starts.append(start)
        if not is_git:
            role[start] = role[start + 1] = "header"
        for h, head in zip(pf, hunk_headers):
            last = max(ln.diff_line_no for ln in h if ln.diff_line_no)
            for n in range(head, last + 1):
                role[n] = "hunk"
        if is_git:
            end = hunk_headers[0] - 1 if hunk_headers else None
            role[start] = "header"
            n = start + 1
            while n <= len(lines) and n not in role and (end is None or n <= end):
                text = _line(lines, n)
                if text.startswith("diff --git ") or (end is None and not text.strip()):
                    break
                if not text.startswith(_GIT_HEADER_LINES):
                    if text.startswith("@@"):
                        raise BadInput(f"{where}: diff line {n}: malformed hunk header {text[:60]!r}")
                    raise BadInput(f"{where}: diff line {n}: unexpected line in git header: {text[:60]!r}")
                side = {"--- ": pf.source_file, "+++ ": pf.target_file}.get(text[:4])
                if side is not None and text[4:].split("\t", 1)[0] != side:
                    raise BadInput(f"{where}: diff line {n}: {text[:60]!r} disagrees with the git header "
                                   f"({side})")
                role[n] = "header"
                n += 1
    first = min(starts)
    last_hunk = 0
    for n in range(first, len(lines) + 1):
        if n in role:
            last_hunk = n if role[n] == "hunk" else 0
            continue
        text = _line(lines, n)
        if text.startswith("\\") and last_hunk == n - 1:
            last_hunk = n
            continue
        if not text.strip() and all(not x.strip() for x in lines[n - 1:]):
            return
        if text.startswith("@@"):
            raise BadInput(f"{where}: diff line {n}: malformed hunk header {text[:60]!r}")
        raise BadInput(f"{where}: diff line {n}: stray line after a hunk (wrong line counts in the hunk "
                       f"before it?): {text[:60]!r}")


def _line(lines: list[str], n: int) -> str:
    return lines[n - 1] if 0 < n <= len(lines) else ""


def _strip_prefix(name: str, prefix: str, where: str) -> str | None:
    if name == DEV_NULL:
        return None
    if name.startswith('"'):
        raise BadInput(f"{where}: quoted path {name!r} not supported")
    if not name.startswith(prefix):
        if name.startswith("/"):
            raise BadInput(f"{where}: absolute path {name!r}")
        raise BadInput(f"{where}: path {name!r} lacks the {prefix!r} prefix")
    return check_confined(name[len(prefix):], where)


def _check_kind(pf: PatchedFile, where: str) -> None:
    """A content change of one regular file, as unidiff reports the entry."""
    name = pf.path
    if pf.is_binary_file:
        raise BadInput(f"{where}: binary hunk in {name}")
    if pf.is_rename:
        raise BadInput(f"{where}: {pf.source_file} -> {pf.target_file}: renames and copies are not supported")
    for mode in (pf.source_mode, pf.target_mode):
        if mode is not None and mode not in REGULAR_MODES:
            kind = " (a symlink)" if pf.is_symlink else " (a submodule)" if pf.is_submodule else ""
            raise BadInput(f"{where}: {name}: file mode {mode}{kind}: only regular files")
    if pf.source_mode and pf.target_mode and pf.source_mode != pf.target_mode:
        raise BadInput(
            f"{where}: {name}: mode changes are not supported ({pf.source_mode} -> {pf.target_mode})"
        )


def _file_patch(pf: PatchedFile, where: str) -> FilePatch:
    old = _strip_prefix(pf.source_file, "a/", where)
    new = _strip_prefix(pf.target_file, "b/", where)
    if old is None and new is None:
        raise BadInput(f"{where}: file entry with /dev/null on both sides")
    path = new or old
    if not len(pf) and old is not None and new is not None:
        raise BadInput(f"{where}: {path}: file without hunks")
    hunks = tuple(_hunk(h, path, where) for h in pf)  # type: ignore[arg-type]
    if old is None and any(h.old_len for h in hunks):
        raise BadInput(f"{where}: creation of {path} has a hunk with old lines")
    if new is None and any(h.new_len for h in hunks):
        raise BadInput(f"{where}: deletion of {path} has a hunk with new lines")
    return FilePatch(old, new, hunks, (pf.target_mode or "100644") if old is None else None)


def _hunk(h, path: str, where: str) -> Hunk:
    lines: list[tuple[str, str]] = []
    old_no_eol = new_no_eol = False
    prev = None
    for ln in h:
        t = ln.line_type
        if t == "\\":
            old_no_eol = old_no_eol or prev in (" ", "-")
            new_no_eol = new_no_eol or prev in (" ", "+")
            continue
        if t == "":  # a blank line after the hunk, kept by unidiff as an "empty" line
            continue
        lines.append((t, ln.value.removesuffix("\n").removesuffix("\r")))
        prev = t
    if not any(t != " " for t, _ in lines):
        raise BadInput(f"{where}: hunk in {path} changes nothing")
    return Hunk(h.source_start, h.source_length, h.target_start, h.target_length, tuple(lines),
                old_no_eol, new_no_eol)
