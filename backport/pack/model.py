"""The patch pack's model: fixes (``fixes.toml``), their patch variants and the
rules every path of a pack obeys.

A pack is confined to the package directory: every path a patch touches or
creates, and every file a fingerprint reads, is ``sglang/...`` relative to the
package root (the directory that contains ``sglang/``). The tree digest and the
receipt cover ``sglang/`` only; a file elsewhere (a root ``conftest.py``, a
sibling package) would be shipped unreviewed.
"""

from __future__ import annotations

import datetime as _dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from unidiff import PatchSet

from ..errors import BadInput

PACKAGE_DIR = "sglang"
FIX_ID = re.compile(r"^[a-z][a-z0-9_-]*[0-9a-z]$")


@dataclass(frozen=True)
class FingerprintRule:
    file: str  # relative to the package root (the directory containing sglang/)
    pattern: str  # Python regex, searched with re.MULTILINE
    absent: bool = False  # True: the rule holds when the pattern does NOT occur

    def describe(self) -> str:
        return f"{self.file}: {'no ' if self.absent else ''}/{self.pattern}/"


@dataclass(frozen=True)
class CoverageExclusion:
    """Added lines of `file` matching `pattern` are reported as excluded, with `reason`, and
    never counted as executed."""

    file: str
    pattern: str
    reason: str


@dataclass(frozen=True)
class Fix:
    id: str
    title: str
    pr: int | None  # None for a vendor fix (no upstream pull request)
    url: str
    upstream_commit: str
    fixed_in: SpecifierSet
    depends_on: tuple[str, ...] = ()
    fingerprint: tuple[FingerprintRule, ...] = ()
    upstream_tests: tuple[Any, ...] = ()  # { path, rev, sha256? } tables; sha256 absent: unpinned
    scope: SpecifierSet = field(default_factory=SpecifierSet)  # releases the pack backports to; "" = all
    origin: str = "upstream"  # "vendor": this pack's own fix; url is its design reference
    # added lines no CPU probe can run (a GPU kernel call, a transport library), each with its reason
    coverage_exclude: tuple[CoverageExclusion, ...] = ()
    bug: str = ""  # the report the fix answers (DEP-3 Bug:); "" -> the fix's url stands for it

    @property
    def first_release(self) -> str | None:
        """The first release `fixed_in` names (its `>=` bound; None: no release has the fix)."""
        bounds = [s.version for s in self.fixed_in if s.operator in (">=", "==")]
        return min(bounds, key=Version) if bounds else None

    @property
    def is_vendor(self) -> bool:
        return self.origin == "vendor"

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
        v = parse_version(version, "version")
        hits = [pv for pv in self.variants.get(fix_id, ()) if pv.applies(v)]
        if len(hits) > 1:
            names = ", ".join(h.name for h in hits)
            raise BadInput(f"{self.root / fix_id}: Applies-To of {names} overlap at {v}")
        return hits[0] if hits else None


@dataclass(frozen=True)
class Hunk:
    """One hunk. ``lines`` holds (tag, text) with tag in ' ', '-', '+' and
    text without its line ending. ``old_start``/``new_start`` are 1-based as
    in the header (0 for an empty side)."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[tuple[str, str], ...]
    old_no_eol: bool = False  # the old side's last line has no newline
    new_no_eol: bool = False  # the new side's last line has no newline

    @property
    def old_lines(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "+"]

    @property
    def new_lines(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "-"]

    @property
    def leading_context(self) -> int:
        n = 0
        for tag, _ in self.lines:
            if tag != " ":
                break
            n += 1
        return n

    @property
    def trailing_context(self) -> int:
        n = 0
        for tag, _ in reversed(self.lines):
            if tag != " ":
                break
            n += 1
        return n

    def reversed(self) -> Hunk:
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(
            old_start=self.new_start,
            old_len=self.new_len,
            new_start=self.old_start,
            new_len=self.old_len,
            lines=tuple((swap[tag], t) for tag, t in self.lines),
            old_no_eol=self.new_no_eol,
            new_no_eol=self.old_no_eol,
        )


# ------------------------------------------------------------ value rules


def parse_version(v: str | Version, what: str) -> Version:
    try:
        return Version(str(v))
    except InvalidVersion:
        raise BadInput(f"{what}: {v!r} is not a PEP 440 version") from None


def parse_spec(text: str, where: str, what: str) -> SpecifierSet:
    try:
        return SpecifierSet(text.strip())
    except InvalidSpecifier:
        raise BadInput(f"{where}: {what} {text!r} is not a PEP 440 specifier") from None


def check_rel_path(p: str, where: str) -> str:
    """A path of the pack must be relative, without ``..``, and not inside ``.git``."""
    if not p or any(c in p for c in "\0\n\r\t") or p.startswith('"'):
        raise BadInput(f"{where}: empty, quoted or control-character path {p!r}")
    if p.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[\\/]", p):
        raise BadInput(f"{where}: absolute path {p!r}")
    parts = [x for x in p.replace("\\", "/").split("/") if x]  # as PurePosixPath's parts: no empty part
    if ".." in parts:
        raise BadInput(f"{where}: path {p!r} contains '..'")
    if any(part.lower() == ".git" for part in parts):
        raise BadInput(f"{where}: path {p!r} touches .git/")
    if p.endswith("/"):
        raise BadInput(f"{where}: path {p!r} names a directory")
    return "/".join(x for x in parts if x != ".")


def check_confined(p: str, where: str) -> str:
    """A checked relative path that must also lie inside ``sglang/``."""
    rel = check_rel_path(p, where)
    if rel.split("/", 1)[0] != PACKAGE_DIR or "/" not in rel:
        raise BadInput(f"{where}: {rel} is outside the package directory {PACKAGE_DIR}/")
    return rel
