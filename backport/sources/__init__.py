"""Where SGLang source comes from: PyPI wheels, git commits, local paths, an installed package.

One small interface for the family (`Source.materialise(cache_root) -> Fetched`), one module per
spec form. SGLang code reaches the project only through these, at run time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

from backport import cache
from backport.errors import BadInput
from backport.releases import WheelPin, load_pins
from backport.sources.base import Fetched, Source
from backport.sources.gitrepo import GitSource
from backport.sources.local import InstalledSource, PathSource
from backport.sources.wheel import WheelSource, extract_wheel_package, unpinned_message
from backport.tree import package_root_of

__all__ = [
    "Fetched",
    "GitSource",
    "InstalledSource",
    "PathSource",
    "Source",
    "WheelPin",
    "WheelSource",
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
            raise BadInput(f"{spec}: {raw!r} is not a valid version") from None
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
    if re.match(r"^[A-Za-z][A-Za-z0-9_.-]*\s*(==|>=|<=|~=|!=|>|<)", spec):
        raise BadInput(f"{spec}: only sglang==VERSION is a package target")
    if not Path(spec).expanduser().exists():
        raise BadInput(f"{spec}: not a target spec (sglang==X, git+URL@SHA, installed) and no such path")
    package_root_of(Path(spec).expanduser())  # a path without an SGLang package is refused here, before any build
    return PathSource(spec, Path(spec))


def source_kind(source: Source) -> str:
    """wheel | git | path | installed: which form a parsed spec has."""
    return {WheelSource: "wheel", GitSource: "git", PathSource: "path", InstalledSource: "installed"}[type(source)]



def materialise(spec: str, *, allow_unpinned: bool = False, python: str | None = None,
                pins: dict[str, WheelPin] | None = None) -> Fetched:
    root = cache.cache_root()
    cache.clean_stale_staging(root / "trees")
    return parse_spec(spec, allow_unpinned=allow_unpinned, python=python, pins=pins).materialise(root)
