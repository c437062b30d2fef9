"""Which upstream test files a fix lists: `upstream_tests` in `patches/fixes.toml`, read
through the pack loader (never parsed here), each at the revision the pack names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from backport import resources
from backport.errors import BadInput
from backport.pack import load_pack
from backport.upstream.names import pack_added_names, pack_fix_names, patch_added_names

DEFAULT_SERIES = resources.pack_dir()

_REV_RE = re.compile(r"[0-9a-fA-F]{7,40}")


@dataclass(frozen=True)
class TestRef:
    """One upstream test file at one revision (`patches/fixes.toml`, `upstream_tests`)."""

    __test__ = False  # not a pytest test class

    path: str                       # repository-relative, e.g. test/registered/unit/.../test_x.py
    rev: str                        # the upstream commit to take it from
    fix: str | None = field(default=None, compare=False)
    # Names the pack adds or its fingerprints name: a tree that lacks one of these lacks a
    # fix, which is a failure, not an incompatibility.
    fix_names: frozenset[str] = field(default=frozenset(), compare=False)
    # The file's sha256 as fixes.toml pins it; None: unpinned (an ad-hoc --test, or no pin yet).
    sha256: str | None = field(default=None, compare=False)
    # The pack's Fix the file is listed for (its fingerprint says whether a tree has it), and the
    # names only this pack's own fixes add (no upstream test double can know them).
    fix_record: Any = field(default=None, compare=False, repr=False)
    own_names: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def pinned(self) -> bool:
        return self.sha256 is not None


def load_refs(series_dir: Path | None = None, fixes: list[str] | None = None,
              rev: str | None = None) -> list[TestRef]:
    """The upstream test files `fixes.toml` lists for `fixes` (all fixes when None).

    `rev` replaces every file's revision, which drops the pins (a pin names the file at its
    listed revision). The pack's fix names are attached to each ref.
    """
    series_dir = Path(series_dir or DEFAULT_SERIES)
    pack = load_pack(series_dir)
    fixes_toml = series_dir / "fixes.toml"
    for fix in fixes or []:
        if fix not in pack.fixes:
            raise BadInput(f"--fix {fix}: not a fix in {fixes_toml} (known: {', '.join(sorted(pack.fixes))})")
    names = pack_fix_names(pack)
    own = own_names(pack)
    refs: list[TestRef] = []
    for fix_id in (fixes or sorted(pack.fixes)):
        for entry in pack.fixes[fix_id].upstream_tests:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("path"), str) or (
                    rev is None and not isinstance(entry.get("rev"), str)):
                raise BadInput(f"{fixes_toml}: {fix_id}: each upstream_tests entry needs path and rev")
            pin = None if rev is not None else entry.get("sha256")
            ref = TestRef(entry["path"], rev or entry["rev"], fix_id, names, pin, pack.fixes[fix_id], own)
            if ref not in refs:
                refs.append(ref)
                continue
            listed = refs[refs.index(ref)]
            if listed.sha256 != pin and None not in (listed.sha256, pin):
                raise BadInput(f"{fixes_toml}: {ref.path}@{ref.rev} is pinned to {listed.sha256} by "
                               f"{listed.fix} and to {pin} by {fix_id}")
            if listed.sha256 is None and pin is not None:
                refs[refs.index(ref)] = replace(listed, sha256=pin)
    return refs


def own_names(pack) -> frozenset[str]:
    """Names only this pack's own fixes (origin "vendor") add, not any upstream fix's patch."""
    def added(fixes):
        return {name for fix in fixes for variant in pack.variants.get(fix.id, ())
                if variant.patchset is not None for name in patch_added_names(variant.patchset)}
    vendor = [f for f in pack.fixes.values() if f.is_vendor]
    return frozenset(added(vendor) - added([f for f in pack.fixes.values() if not f.is_vendor]))


def ad_hoc_refs(series_dir: Path | None, paths: list[str], rev: str) -> list[TestRef]:
    """Test files named on the command line, with the pack's fix names when there is a pack."""
    series_dir = Path(series_dir or DEFAULT_SERIES)
    names = pack_fix_names(load_pack(series_dir)) if series_dir.is_dir() else frozenset()
    return [TestRef(path, rev, None, names) for path in paths]


def series_added_names(series_dir: Path) -> frozenset[str]:
    """Every name the patches of the pack at `series_dir` add."""
    return pack_added_names(load_pack(series_dir))


def check_ref(ref: TestRef) -> str | None:
    """None when the ref is well formed, else one line naming what is wrong."""
    if not _REV_RE.fullmatch(ref.rev or ""):
        return f"{ref.path}@{ref.rev}: the revision must be a commit id (7 to 40 hex digits)"
    path = PurePosixPath(ref.path)
    if (not ref.path or path.is_absolute() or ".." in path.parts or "\\" in ref.path
            or path.suffix != ".py"):
        return f"{ref.path}@{ref.rev}: not a repository-relative path to a .py file"
    return None


def with_rev(refs: list[TestRef], rev: str) -> list[TestRef]:
    return [replace(ref, rev=rev) for ref in refs]
