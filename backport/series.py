"""The patch pack's data model: ``patches/series``, ``patches/fixes.toml`` and
``patches/<fix>/*.patch`` (quilt layout, DEP-3 headers).

``series``: one fix id a line, in application order; ``#`` starts a comment.

``fixes.toml``: one table per fix, either ``[fixes.pr36988]`` or an
``[[fix]]`` entry with ``id = "pr36988"``. Keys::

    title = "..."                       # required
    pr = 36988                          # required (int)
    url = "https://github.com/..."      # default: the sglang pull URL of pr
    upstream_commit = "febb360519"      # required (alias: commit)
    fixed_in = ">=0.5.20"               # releases that already contain it; "" = none
    scope = ">=0.5.19"                  # releases the pack backports it to; default: all
    depends_on = ["pr36988"]            # fix ids, default []
    fingerprint = [{ file = "sglang/...", pattern = "regex" }]   # all must match;
                                        # a rule with absent = true must NOT match
    upstream_tests = ["test/registered/..."]                  # free-form, default []

A patch file is a DEP-3 header (``Field: value``, continuation lines start
with a space) ended by a line ``---``, then a unified diff whose paths are
relative to the directory that contains ``sglang/`` with ``a/`` ``b/``
prefixes. Required fields: Description, Origin, Applies-To, Depends-On,
Last-Update (YYYY-MM-DD). Everything malformed raises ``BadInput`` with one
line naming the file and the problem.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from unidiff import PatchSet
from unidiff.errors import UnidiffParseError

from .errors import BadInput
from .placement import Hunk

REQUIRED_FIELDS = ("Description", "Origin", "Applies-To", "Depends-On", "Last-Update")
OPTIONAL_FIELDS = ("Backport-Notes", "Bug")
FIX_ID = re.compile(r"^[a-z][a-z0-9_-]*[0-9a-z]$")
_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_ALLOWED_MODES = {"100644", "100755"}


@dataclass(frozen=True)
class FingerprintRule:
    file: str  # relative to the package root (the directory containing sglang/)
    pattern: str  # Python regex, searched with re.MULTILINE
    absent: bool = False  # True: the rule holds when the pattern does NOT occur

    def describe(self) -> str:
        return f"{self.file}: {'no ' if self.absent else ''}/{self.pattern}/"


@dataclass(frozen=True)
class Fix:
    id: str
    title: str
    pr: int
    url: str
    upstream_commit: str
    fixed_in: SpecifierSet
    depends_on: tuple[str, ...] = ()
    fingerprint: tuple[FingerprintRule, ...] = ()
    upstream_tests: tuple[Any, ...] = ()
    scope: SpecifierSet = field(default_factory=SpecifierSet)  # releases the pack backports to; "" = all

    def in_scope(self, version: str | Version) -> bool:
        """True when the pack carries a backport of this fix for the release
        (``scope`` in fixes.toml; empty or absent: every release)."""
        if not str(self.scope):
            return True
        return self.scope.contains(Version(str(version)), prereleases=True)

    def is_fixed_in(self, version: str | Version) -> bool:
        """True when this release already contains the fix. An empty
        ``fixed_in`` means no release does (an empty SpecifierSet would
        otherwise contain every version)."""
        if not str(self.fixed_in):
            return False
        return self.fixed_in.contains(Version(str(version)), prereleases=True)


@dataclass(frozen=True)
class FilePatch:
    """One file of a diff. ``old_path``/``new_path`` are relative to the
    package root, None for /dev/null (creation / deletion)."""

    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]
    new_mode: str | None = None  # "100644" / "100755" for a created file

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]

    @property
    def is_creation(self) -> bool:
        return self.old_path is None

    @property
    def is_deletion(self) -> bool:
        return self.new_path is None


@dataclass(frozen=True)
class PatchVariant:
    fix: str
    path: Path
    sha256: str
    header: Mapping[str, str] = field(compare=False, hash=False)
    applies_to: SpecifierSet = field(default_factory=SpecifierSet)
    depends_on: tuple[str, ...] = ()
    patchset: PatchSet | None = field(default=None, compare=False, hash=False, repr=False)
    files: tuple[FilePatch, ...] = field(default=(), compare=False, hash=False, repr=False)
    last_update: _dt.date = _dt.date(1970, 1, 1)

    @property
    def name(self) -> str:
        return self.path.name

    def applies(self, version: str | Version) -> bool:
        return self.applies_to.contains(Version(str(version)), prereleases=True)


@dataclass(frozen=True)
class Pack:
    root: Path
    fixes: Mapping[str, Fix]
    series: tuple[str, ...]
    variants: Mapping[str, tuple[PatchVariant, ...]] = field(default_factory=dict)

    def variant_for(self, fix_id: str, version: str | Version) -> PatchVariant | None:
        """The one variant whose Applies-To contains version, None when none
        does. Two variants containing the same version: BadInput (the pack is
        ambiguous, never a guess)."""
        v = _version(version, "version")
        hits = [pv for pv in self.variants.get(fix_id, ()) if pv.applies(v)]
        if len(hits) > 1:
            names = ", ".join(h.name for h in hits)
            raise BadInput(f"{self.root / fix_id}: Applies-To of {names} overlap at {v}")
        return hits[0] if hits else None


# ----------------------------------------------------------------- loading


def _version(v: str | Version, what: str) -> Version:
    try:
        return Version(str(v))
    except InvalidVersion:
        raise BadInput(f"{what}: {v!r} is not a PEP 440 version") from None


def _spec(text: str, where: str, what: str) -> SpecifierSet:
    try:
        return SpecifierSet(text.strip())
    except InvalidSpecifier:
        raise BadInput(f"{where}: {what} {text!r} is not a PEP 440 specifier") from None


def _ids(value: str, where: str, what: str) -> tuple[str, ...]:
    value = value.strip()
    if value.lower() in ("", "none", "-"):
        return ()
    out = tuple(x.strip() for x in value.split(",") if x.strip())
    for x in out:
        if not FIX_ID.match(x):
            raise BadInput(f"{where}: {what} names {x!r}, not a fix id")
    return out


def load_pack(root: str | Path) -> Pack:
    """Load ``root/series``, ``root/fixes.toml`` and every ``root/<fix>/*.patch``."""
    root = Path(root)
    series_file, fixes_file = root / "series", root / "fixes.toml"
    for f in (series_file, fixes_file):
        if not f.is_file():
            raise BadInput(f"{f}: missing (a pack needs series and fixes.toml)")
    fixes = _load_fixes(fixes_file)
    series: list[str] = []
    for n, raw in enumerate(series_file.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line not in fixes:
            raise BadInput(f"{series_file}:{n}: {line!r} has no entry in fixes.toml")
        if line in series:
            raise BadInput(f"{series_file}:{n}: {line!r} listed twice")
        series.append(line)
    variants: dict[str, tuple[PatchVariant, ...]] = {}
    for fid in series:
        fix = fixes[fid]
        for d in fix.depends_on:
            if d not in fixes:
                raise BadInput(f"{fixes_file}: {fid} depends on {d!r}, which has no entry")
            if d in series and series.index(d) > series.index(fid):
                raise BadInput(f"{series_file}: {fid} is listed before its dependency {d}")
        d = root / fid
        files = sorted(d.glob("*.patch")) if d.is_dir() else []
        vs = tuple(load_variant(p, fid) for p in files)
        for v in vs:
            for dep in v.depends_on:
                if dep not in fixes:
                    raise BadInput(f"{v.path}: Depends-On names {dep!r}, which has no entry in fixes.toml")
                if dep in series and series.index(dep) > series.index(fid):
                    raise BadInput(f"{v.path}: depends on {dep}, listed after {fid} in series")
        variants[fid] = vs
    return Pack(root=root, fixes=MappingProxyType(fixes), series=tuple(series),
                variants=MappingProxyType(variants))


def _load_fixes(path: Path) -> dict[str, Fix]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not valid TOML ({e})") from None
    entries: list[tuple[str, dict]] = []
    if isinstance(data.get("fixes"), dict):
        entries += list(data["fixes"].items())
    if isinstance(data.get("fix"), list):
        for e in data["fix"]:
            if not isinstance(e, dict) or "id" not in e:
                raise BadInput(f"{path}: a [[fix]] entry has no id")
            entries.append((e["id"], e))
    if not entries and data:
        raise BadInput(f"{path}: no [fixes.<id>] tables or [[fix]] entries")
    out: dict[str, Fix] = {}
    for fid, e in entries:
        where = f"{path} [{fid}]"
        if not isinstance(fid, str) or not FIX_ID.match(fid):
            raise BadInput(f"{path}: {fid!r} is not a valid fix id")
        if fid in out:
            raise BadInput(f"{path}: fix {fid} defined twice")
        if not isinstance(e, dict):
            raise BadInput(f"{where}: not a table")
        for k in ("title", "pr"):
            if k not in e:
                raise BadInput(f"{where}: missing {k}")
        commit = e.get("upstream_commit", e.get("commit", e.get("merge_commit")))
        if not commit or not isinstance(commit, str):
            raise BadInput(f"{where}: missing upstream_commit")
        try:
            pr = int(e["pr"])
        except (TypeError, ValueError):
            raise BadInput(f"{where}: pr {e['pr']!r} is not a number") from None
        deps = e.get("depends_on", [])
        if isinstance(deps, str):
            deps = list(_ids(deps, where, "depends_on"))
        if not isinstance(deps, list) or not all(isinstance(x, str) for x in deps):
            raise BadInput(f"{where}: depends_on must be a list of fix ids")
        rules = []
        for r in e.get("fingerprint", []) or []:
            if not isinstance(r, dict) or not isinstance(r.get("file"), str) or not isinstance(r.get("pattern"), str):
                raise BadInput(f"{where}: a fingerprint rule needs file and pattern strings")
            try:
                re.compile(r["pattern"])
            except re.error as err:
                raise BadInput(f"{where}: fingerprint pattern {r['pattern']!r}: {err}") from None
            check_rel_path(r["file"], where)
            rules.append(FingerprintRule(r["file"], r["pattern"], bool(r.get("absent", False))))
        tests = tuple(MappingProxyType(dict(t)) if isinstance(t, dict) else t for t in e.get("upstream_tests", []) or [])
        out[fid] = Fix(
            id=fid,
            title=str(e["title"]),
            pr=pr,
            url=str(e.get("url") or f"https://github.com/sgl-project/sglang/pull/{pr}"),
            upstream_commit=commit,
            fixed_in=_spec(str(e.get("fixed_in", "")), where, "fixed_in"),
            depends_on=tuple(deps),
            fingerprint=tuple(rules),
            upstream_tests=tests,
            scope=_spec(str(e.get("scope", "")), where, "scope"),
        )
    return out


# ------------------------------------------------------------ patch files


def check_rel_path(p: str, where: str) -> str:
    """A patch path must be relative, without ``..``, and not inside ``.git``."""
    if not p or any(c in p for c in "\0\n\r\t") or p.startswith('"'):
        raise BadInput(f"{where}: empty, quoted or control-character path {p!r}")
    if p.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[\\/]", p):
        raise BadInput(f"{where}: absolute path {p!r}")
    parts = PurePosixPath(p.replace("\\", "/")).parts
    if ".." in parts:
        raise BadInput(f"{where}: path {p!r} contains '..'")
    if any(part.lower() == ".git" for part in parts):
        raise BadInput(f"{where}: path {p!r} touches .git/")
    if p.endswith("/"):
        raise BadInput(f"{where}: path {p!r} names a directory")
    return "/".join(x for x in parts if x != ".")


def parse_header(text: str, where: str) -> tuple[dict[str, str], str]:
    """Split a patch file into its DEP-3 header fields and the diff text."""
    lines = text.splitlines(keepends=True)
    fields: dict[str, str] = {}
    canon = {f.lower(): f for f in REQUIRED_FIELDS + OPTIONAL_FIELDS}
    cur: str | None = None
    for i, raw in enumerate(lines):
        line = raw.rstrip("\r\n")
        if line.rstrip() == "---":
            body = "".join(lines[i + 1:])
            break
        if not line.strip():
            cur = None
            continue
        if line[0] in " \t":
            if cur is None:
                raise BadInput(f"{where}:{i + 1}: continuation line without a field")
            cont = line.strip()
            fields[cur] += "\n" + ("" if cont == "." else cont)
            continue
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):(.*)$", line)
        if not m and line.startswith(("--- ", "+++ ", "diff ", "@@", "Index: ")):
            raise BadInput(f"{where}: no '---' line ends the header before the diff at line {i + 1}")
        if not m:
            raise BadInput(f"{where}:{i + 1}: header line is not 'Field: value': {line[:60]!r}")
        name = canon.get(m.group(1).lower(), m.group(1))
        if name in fields:
            raise BadInput(f"{where}:{i + 1}: field {name} given twice")
        fields[name] = m.group(2).strip()
        cur = name
    else:
        raise BadInput(f"{where}: no '---' line ends the header")
    missing = [f for f in REQUIRED_FIELDS if not fields.get(f, "").strip()]
    if missing:
        raise BadInput(f"{where}: missing header field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    return fields, body


def _strip_prefix(name: str, prefix: str, where: str) -> str | None:
    name = name.split("\t", 1)[0].rstrip()
    if name == "/dev/null":
        return None
    if name.startswith('"'):
        raise BadInput(f"{where}: quoted path {name!r} not supported")
    if not name.startswith(prefix):
        if name.startswith("/"):
            raise BadInput(f"{where}: absolute path {name!r}")
        raise BadInput(f"{where}: path {name!r} lacks the {prefix!r} prefix")
    return check_rel_path(name[len(prefix):], where)


def validate_diff(body: str, where: str) -> None:
    """Strict structural check that unidiff is too lenient for: exact hunk
    line counts, nothing stray after a hunk, no binary, rename, copy or mode
    change, nothing but regular files."""
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i, n = 0, len(lines)
    seen_file = False
    # free text before the first file header is allowed (quilt style)
    while i < n and not (lines[i].startswith("diff --git ") or lines[i].startswith("--- ")):
        if lines[i].startswith("@@ ") or lines[i].startswith("GIT binary patch") or lines[i].startswith("Binary files "):
            raise BadInput(f"{where}: diff line {i + 1}: hunk or binary data before any file header")
        i += 1
    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            seen_file = True
            i += 1
            while i < n and not lines[i].startswith(("--- ", "diff --git ")):
                x = lines[i]
                if x.startswith(("GIT binary patch", "Binary files ")):
                    raise BadInput(f"{where}: diff line {i + 1}: binary hunk")
                if x.startswith(("rename ", "copy ", "similarity index", "dissimilarity index")):
                    raise BadInput(f"{where}: diff line {i + 1}: renames and copies are not supported")
                if x.startswith(("old mode", "new mode")):
                    raise BadInput(f"{where}: diff line {i + 1}: mode changes are not supported")
                m = re.match(r"^(new|deleted) file mode (\d+)$", x)
                if m:
                    if m.group(2) not in _ALLOWED_MODES:
                        raise BadInput(f"{where}: diff line {i + 1}: file mode {m.group(2)} (only regular files)")
                elif x.startswith("index "):
                    pass
                elif x.startswith("@@"):
                    raise BadInput(f"{where}: diff line {i + 1}: hunk without ---/+++ file lines")
                else:
                    raise BadInput(f"{where}: diff line {i + 1}: unexpected line in git header: {x[:60]!r}")
                i += 1
            continue
        if line.startswith("--- "):
            seen_file = True
            if i + 1 >= n or not lines[i + 1].startswith("+++ "):
                raise BadInput(f"{where}: diff line {i + 1}: '---' without '+++'")
            i += 2
            if i >= n or not lines[i].startswith("@@"):
                raise BadInput(f"{where}: diff line {i + 1}: file without hunks")
            while i < n and lines[i].startswith("@@"):
                m = _HUNK_HEADER.match(lines[i])
                if not m:
                    raise BadInput(f"{where}: diff line {i + 1}: malformed hunk header {lines[i][:60]!r}")
                old_len = int(m.group(2)) if m.group(2) is not None else 1
                new_len = int(m.group(4)) if m.group(4) is not None else 1
                start = i
                i += 1
                while old_len > 0 or new_len > 0:
                    if i >= n:
                        raise BadInput(f"{where}: diff line {start + 1}: truncated hunk "
                                       f"({old_len} old and {new_len} new lines missing)")
                    x = lines[i]
                    tag = x[:1]
                    if tag == " " or x == "":
                        old_len -= 1
                        new_len -= 1
                    elif tag == "-":
                        old_len -= 1
                    elif tag == "+":
                        new_len -= 1
                    elif tag == "\\":
                        pass
                    else:
                        raise BadInput(f"{where}: diff line {i + 1}: truncated hunk or wrong line counts "
                                       f"(hunk at line {start + 1})")
                    if old_len < 0 or new_len < 0:
                        raise BadInput(f"{where}: diff line {start + 1}: hunk line counts do not match its header")
                    i += 1
                if i < n and lines[i].startswith("\\"):
                    i += 1
                if i < n and not lines[i].startswith(("@@", "diff --git ", "--- ")):
                    if all(not x.strip() for x in lines[i:]):
                        return
                    raise BadInput(f"{where}: diff line {i + 1}: stray line after a hunk "
                                   f"(wrong line counts in the hunk at line {start + 1}?)")
            continue
        if not line.strip() and all(not x.strip() for x in lines[i:]):
            break
        raise BadInput(f"{where}: diff line {i + 1}: unexpected line {line[:60]!r}")
    if not seen_file:
        raise BadInput(f"{where}: no diff after the header")


def parse_diff(body: str, where: str) -> tuple[PatchSet, tuple[FilePatch, ...]]:
    validate_diff(body, where)
    try:
        ps = PatchSet(body)
    except UnidiffParseError as e:
        raise BadInput(f"{where}: malformed diff ({e})") from None
    files: list[FilePatch] = []
    seen: set[str] = set()
    for pf in ps:
        if pf.is_binary_file:
            raise BadInput(f"{where}: binary hunk in {pf.path}")
        info = str(pf.patch_info or "")
        old = _strip_prefix(pf.source_file, "a/", where)
        new = _strip_prefix(pf.target_file, "b/", where)
        m = re.search(r"^diff --git a/(\S+) b/(\S+)$", info, re.MULTILINE)
        if m:
            for g in m.groups():
                check_rel_path(g, where)
        if old is None and new is None:
            raise BadInput(f"{where}: file entry with /dev/null on both sides")
        if old is not None and new is not None and old != new:
            raise BadInput(f"{where}: {old} -> {new}: renames are not supported")
        path = new or old
        if path in seen:
            raise BadInput(f"{where}: {path} appears twice in the diff")
        seen.add(path)  # type: ignore[arg-type]
        mm = re.search(r"^new file mode (\d+)$", info, re.MULTILINE)
        hunks = []
        for h in pf:
            lines: list[tuple[str, str]] = []
            old_no_eol = new_no_eol = False
            prev = None
            for ln in h:
                t = ln.line_type
                if t == "\\":
                    if prev in (" ", "-"):
                        old_no_eol = True
                    if prev in (" ", "+"):
                        new_no_eol = True
                    continue
                if t not in (" ", "-", "+"):
                    raise BadInput(f"{where}: unexpected line type {t!r} in {path}")
                text = ln.value
                text = text.removesuffix("\n")
                text = text.removesuffix("\r")
                lines.append((t, text))
                prev = t
            if not any(t != " " for t, _ in lines):
                raise BadInput(f"{where}: hunk in {path} changes nothing")
            hunks.append(Hunk(h.source_start, h.source_length, h.target_start, h.target_length,
                              tuple(lines), old_no_eol, new_no_eol))
        if old is None and any(h.old_len for h in hunks):
            raise BadInput(f"{where}: creation of {path} has a hunk with old lines")
        if new is None and any(h.new_len for h in hunks):
            raise BadInput(f"{where}: deletion of {path} has a hunk with new lines")
        files.append(FilePatch(old, new, tuple(hunks), (mm.group(1) if mm else None) if old is None else None))
    if not files:
        raise BadInput(f"{where}: no diff after the header")
    return ps, tuple(files)


def load_variant(path: str | Path, fix_id: str | None = None) -> PatchVariant:
    path = Path(path)
    where = str(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{where}: not UTF-8 text") from None
    if "\0" in text:
        raise BadInput(f"{where}: contains NUL bytes (binary?)")
    fields, body = parse_header(text, where)
    applies = _spec(fields["Applies-To"], where, "Applies-To")
    if not str(applies):
        raise BadInput(f"{where}: Applies-To is empty")
    try:
        last = _dt.date.fromisoformat(fields["Last-Update"].strip())
    except ValueError:
        raise BadInput(f"{where}: Last-Update {fields['Last-Update']!r} is not YYYY-MM-DD") from None
    deps = _ids(fields["Depends-On"], where, "Depends-On")
    ps, files = parse_diff(body, where)
    return PatchVariant(
        fix=fix_id or path.parent.name,
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        header=MappingProxyType(fields),
        applies_to=applies,
        depends_on=deps,
        patchset=ps,
        files=files,
        last_update=last,
    )
