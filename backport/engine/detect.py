"""Fix detection in a tree: fingerprints first, then the release, then the patch.

``detect`` decides per fix, and says how:

* fingerprint rules (``fixes.toml``): all must hold (a rule holds when its
  regex occurs in the file, or, with ``absent = true``, when it does not).
  When a fix has rules, they decide.
* a fix without rules, when the caller gives the tree's version: present
  when the version is in ``fixed_in``, else when the variant for that
  version reverse-applies cleanly (exact or offset, no fuzz); else missing.
* no rules and no version: missing, "no fingerprint rules".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import BadInput
from ..pack.model import Fix, Pack
from ..tree import package_root_of
from .overlay import Overlay, reverse_applies

ReadText = Callable[[str], "str | None"]


@dataclass(frozen=True)
class Detection:
    fix: str
    present: bool
    how: str

    def to_json(self) -> dict:
        return {"fix": self.fix, "present": self.present, "how": self.how}


def fs_reader(pkgroot: Path) -> ReadText:
    """Read a file under the package root as text; None when it is missing.
    Symlinks are not followed out of the tree."""
    root = pkgroot.resolve()

    def read(rel: str) -> str | None:
        f = pkgroot / rel
        try:
            if not f.resolve().is_relative_to(root) or not f.is_file():
                return None
            return f.read_bytes().decode("utf-8", "surrogateescape")
        except OSError:
            return None

    return read


def fingerprint_match(fix: Fix, read: ReadText) -> tuple[bool | None, str]:
    """(True/False, how) from the fix's rules; (None, how) when it has none."""
    if not fix.fingerprint:
        return None, "no fingerprint rules"
    hit: list[str] = []
    miss: list[str] = []
    cache: dict[str, str | None] = {}
    for rule in fix.fingerprint:
        if rule.file not in cache:
            cache[rule.file] = read(rule.file)
        text = cache[rule.file]
        if text is None:
            miss.append(f"{rule.file}: file missing")
            continue
        found = re.search(rule.pattern, text, re.MULTILINE) is not None
        (hit if found != rule.absent else miss).append(rule.describe())
    n = len(fix.fingerprint)
    if not miss:
        return True, f"fingerprint: {n}/{n} rules matched ({'; '.join(hit)})"
    how = f"fingerprint: {len(hit)}/{n} rules matched; missed {'; '.join(miss)}"
    return False, how


def detect(repo_or_pkgroot: str | Path, pack: Pack, *, version: str | None = None,
           fixes: Iterable[str] | None = None) -> tuple[Detection, ...]:
    """Per fix of the series (or of ``fixes``): present or missing, and how."""
    root = package_root_of(repo_or_pkgroot)
    read = fs_reader(root)
    out = []
    for fid in (fixes if fixes is not None else pack.series):
        if fid not in pack.fixes:
            raise BadInput(f"{fid}: no such fix in {pack.root}")
        fix = pack.fixes[fid]
        present, how = fingerprint_match(fix, read)
        if present is None and version is not None:
            if fix.is_fixed_in(version):
                present, how = True, f"no fingerprint rules; {version} is in fixed_in {fix.fixed_in}"
            else:
                variant = pack.variant_for(fid, version)
                if variant is not None and reverse_applies(Overlay(root), variant):
                    present, how = True, f"no fingerprint rules; {variant.name} reverse-applies cleanly"
                else:
                    present, how = (
                        False,
                        "no fingerprint rules; not in fixed_in and the patch does not reverse-apply",
                    )
        out.append(Detection(fid, bool(present), how))
    return tuple(out)
