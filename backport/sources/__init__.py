"""Where SGLang source comes from: PyPI wheels, git commits, local paths, an installed package.

One small interface for the family (`Source.materialise(cache_root) -> Fetched`), one module per
spec form. SGLang code reaches the project only through these, at run time.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

from backport import cache
from backport.errors import BadInput, Finding
from backport.gitops import CloneFailed
from backport.releases import WheelPin, load_pins
from backport.sources.base import Fetched, Source
from backport.sources.gitrepo import GitSource
from backport.sources.local import InstalledSource, PathSource
from backport.sources.wheel import WheelSource, extract_wheel_package, unpinned_message
from backport.tree import Tree, clone_tree, package_root_of

log = logging.getLogger("backport.sources")

__all__ = [
    "Fetched",
    "GitSource",
    "InstalledSource",
    "PathSource",
    "Source",
    "WheelPin",
    "WheelSource",
    "clone_pristine",
    "extract_wheel_package",
    "load_pins",
    "materialise",
    "parse_spec",
    "source_kind",
]


def parse_spec(spec: str, *, allow_unpinned: bool = False, python: str | None = None,
               pins: dict[str, WheelPin] | None = None) -> Source:
    spec = spec.strip()
    if spec == "installed":
        return InstalledSource(spec, python or sys.executable)
    if spec.startswith("sglang=="):
        raw = spec.removeprefix("sglang==")
        try:
            version = str(Version(raw))
        except InvalidVersion:
            hint = f"; did you mean sglang=={raw.lstrip('=')}?" if raw.startswith("=") else ""
            raise BadInput(f"{spec}: {raw!r} is not a valid version{hint}") from None
        pins = load_pins() if pins is None else pins
        pin = pins.get(version)
        if pin is None and not allow_unpinned:
            raise BadInput(unpinned_message(spec, version, list(pins)))
        return WheelSource(spec, version, pin)
    if spec.startswith("git+"):
        url, sep, commit = spec[4:].rpartition("@")
        if not sep or not url:
            raise BadInput(f"{spec}: a git target is git+URL@SHA")
        if not re.fullmatch(r"[0-9a-fA-F]{7,40}", commit):
            raise BadInput(f"{spec}: {commit!r} is not a commit id (a git target pins an exact commit)")
        return GitSource(spec, url, commit.lower())
    typo = re.fullmatch(r"sglang\s*(?:=|===|:|@)?\s*v?(\d[\w.+-]*)", spec)
    if typo and not Path(spec).expanduser().exists():
        raise BadInput(f"{spec}: not a target spec; did you mean sglang=={typo.group(1)}? (a release is "
                       f"sglang==VERSION, two equals signs)")
    if re.match(r"^[A-Za-z][A-Za-z0-9_.-]*\s*(==|>=|<=|~=|!=|>|<)", spec):
        raise BadInput(f"{spec}: only sglang==VERSION is a package target")
    if not Path(spec).expanduser().exists():
        raise BadInput(f"{spec}: not a target spec (sglang==X, git+URL@SHA, installed) and no such path")
    package_root_of(
        Path(spec).expanduser()
    )  # a path without an SGLang package is refused here, before any build
    return PathSource(spec, Path(spec))


def clone_pristine(source: Tree, parent: Path, dest: Path | None = None) -> Tree:
    """A fresh clone of a materialised tree. A cache entry whose git objects no longer read
    (the hit check hashes the files, not every blob: that would cost a second per hit) is
    moved aside, rebuilt from its spec and cloned once more; `dest` is left as it was found."""
    made = None
    dest = None if dest is None else Path(os.path.abspath(dest))
    if dest is not None and not dest.exists():
        # made first, so that a destination git cannot create is never taken for a damaged cache entry
        made = next((p for p in [dest, *dest.parents] if p.parent.exists()), dest)
        try:
            dest.mkdir(parents=True)
        except OSError as exc:
            raise BadInput(f"{dest}: cannot create the clone's directory ({exc.strerror})") from None
    try:
        return clone_tree(source, parent, dest)
    except CloneFailed as first:
        entry = source.path.parent
        if entry.parent != cache.cache_root() / "trees":
            _remove_made(made)
            raise  # a user's own checkout: their input
        log.warning("cache entry %s does not clone (%s); rebuilding it", entry.name, first)
        cache.discard_dir(entry)
        again = materialise(source.spec, allow_unpinned=source.unpinned).tree
        try:
            return clone_tree(again, parent, dest)
        except CloneFailed as second:
            _remove_made(made)
            raise Finding(f"{entry}: the rebuilt cache entry still does not clone ({second}); "
                          f"remove {cache.cache_root()} and fetch again") from None


def _remove_made(made: Path | None) -> None:
    """Remove the directories clone_pristine made for a clone that failed (empty again by then)."""
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


def source_kind(source: Source) -> str:
    """wheel | git | path | installed: which form a parsed spec has."""
    return {WheelSource: "wheel", GitSource: "git", PathSource: "path", InstalledSource: "installed"}[
        type(source)
    ]


def materialise(spec: str, *, allow_unpinned: bool = False, python: str | None = None,
                pins: dict[str, WheelPin] | None = None) -> Fetched:
    root = cache.cache_root()
    cache.clean_stale_staging(root / "trees")
    return parse_spec(spec, allow_unpinned=allow_unpinned, python=python, pins=pins).materialise(root)
