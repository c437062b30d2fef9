"""What a release is expected to show, derived from three facts instead of written out per release.

1. What the engine does with each fix (`apply`), from the pack alone, in the engine's own order
   (backport/engine/decide.py): `not-applicable` when the release is in the fix's `fixed_in`
   (shipped) or outside its `scope` (no backport: the release stays exposed); `failed` when a
   dependency in the series has no backport there or no variant's Applies-To covers the release;
   else `applied`. Only a tree can say `already-present` (a fingerprint that matches a release
   outside `fixed_in`): that is an exception.
2. Which fixes a tree has: on the pristine tree those shipped (`fixed_in`); on the patched tree
   those too, plus every fix the engine applied or found present. A release where a fix fails
   (the pack cannot serve it) has no patched tree: `run` makes an exposure bundle, whose head is
   the pristine tree itself, so its "patched" column is the pristine one.
3. What each probe case needs and proves (`@case(proves=..., needs=...)` where the case is
   registered): a case whose code is missing (a `needs` range the release is outside, or a
   `needs` fix the tree lacks) is `not-applicable`; else a case missing a fix it proves is
   `unsafe`; else `safe`.

A release row then states only what differs from that rule (`exceptions`, each with its reason):
a case upstream itself fails, code a release shipped outside any fix record. An exception that
says what the rule already derives is refused, so every exception stays news.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache as memoize
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from backport import resources
from backport.errors import BadInput
from backport.vocab import PatchStatus, TreeVerdict

if TYPE_CHECKING:  # releases.py imports this module
    from backport.releases import Release

APPLIED, PRESENT = PatchStatus.APPLIED, PatchStatus.PRESENT
NOT_APPLICABLE, FAILED = PatchStatus.NOT_APPLICABLE, PatchStatus.FAILED
SAFE, UNSAFE = TreeVerdict.SAFE, TreeVerdict.UNSAFE
ROLES = ("pristine", "patched")


@dataclass(frozen=True)
class CaseRule:
    """One registered probe case as the matrix sees it (probes/__init__.py `Case`)."""

    key: str  # "probe/case"
    must_preserve: bool
    proves: tuple[str, ...]
    needs_fixes: tuple[str, ...]
    needs_releases: tuple[SpecifierSet, ...]


@dataclass(frozen=True)
class StatedException:
    """One stated exception of a release row: a case's verdict on one or both trees, or a fix's
    apply outcome, that the rule does not derive."""

    reason: str
    case: str | None = None
    fix: str | None = None
    pristine: str | None = None
    patched: str | None = None
    apply: str | None = None


@dataclass(frozen=True)
class Expected:
    apply: Mapping[str, str]  # fix -> outcome, in series order
    verdicts: Mapping[tuple[str, str], str]  # (role, probe/case) -> verdict, every case


@memoize
def case_rules() -> tuple[CaseRule, ...]:
    """Every registered case, in registration order. Probe modules import only the standard
    library at module level, so the registry is read here without the probe environment."""
    rules = []
    for c in _registered_cases(resources.probes_dir()):
        key = f"{c.probe}/{c.name}"
        ranges, fixes = [], []
        for need in c.needs:
            if need[:1] in "<>=!~":
                try:
                    ranges.append(SpecifierSet(need))
                except InvalidSpecifier:
                    raise BadInput(f"probe case {key}: needs {need!r} is not a PEP 440 range") from None
            else:
                fixes.append(need)
        rules.append(CaseRule(key, c.must_preserve, tuple(c.proves), tuple(fixes), tuple(ranges)))
    return tuple(rules)


def outside_release(key: str, version: str | None) -> bool:
    """The case `key` ("probe/case") declares a release range in its `needs` that `version` is
    outside: not-applicable there by design, not a case that could not run (the toolkit's side of
    the harness's `outside_needs`)."""
    from packaging.version import InvalidVersion

    try:
        release = Version(version or "")
    except InvalidVersion:
        return False
    return any(rule.key == key and any(release not in spec for spec in rule.needs_releases)
               for rule in case_rules())


def _registered_cases(directory: Path) -> list:
    """The cases of the probe package in `directory` (its registry, read in this process)."""
    module = _probe_package(Path(directory).resolve())
    return [c for name in module.PROBE_NAMES for c in module.cases_of(name)]


@memoize
def _probe_package(directory: Path) -> ModuleType:
    """The probe package in `directory`, imported from that folder under a name of this toolkit's own,
    one per folder (a checkout's probes/ and an installed copy are the same code by two paths). The
    package imports itself relatively, so no name (`probes` in the probe child) is borrowed or replaced
    here; nothing already imported is touched."""
    name = f"sglang_backport_probes_{hashlib.sha256(str(directory).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, directory / "__init__.py",
                                                  submodule_search_locations=[str(directory)])
    if spec is None or spec.loader is None:
        raise BadInput(f"{directory}: not a probe package (no __init__.py to load)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def check_rules(series: Sequence[str], rules: Sequence[CaseRule] | None = None) -> list[str]:
    """Problems with the cases' declarations against a pack's series (none: [])."""
    problems = []
    for rule in case_rules() if rules is None else rules:
        for fix in [alt for either in rule.proves for alt in either.split("|")] + list(rule.needs_fixes):
            if fix not in series:
                problems.append(f"{rule.key}: names {fix!r}, which is not a fix of the series")
    return problems


def planned_apply(pack, version: str) -> dict[str, str]:
    """What the engine does with each fix of the series on this release's pristine tree, as far
    as the pack alone says (decide.py's order, without the fingerprint a tree would add)."""
    v = Version(version)
    state: dict[str, str] = {}
    out_of_scope: set[str] = set()
    for fid in pack.series:
        fix = pack.fixes[fid]
        if fix.is_fixed_in(v):
            state[fid] = NOT_APPLICABLE
        elif not fix.in_scope(v):
            state[fid] = NOT_APPLICABLE
            out_of_scope.add(fid)
        else:
            variant = pack.variant_for(fid, v)
            deps = fix.depends_on + (variant.depends_on if variant else ())
            broken = any(d in out_of_scope or state.get(d) == FAILED for d in deps)
            state[fid] = FAILED if variant is None or broken else APPLIED
    return state


def derive(pack, version: str, exceptions: Sequence[StatedException] = (),
           rules: Sequence[CaseRule] | None = None, where: str = "") -> Expected:
    """The expected apply outcome and every case's verdict on both trees of `version`."""
    rules = case_rules() if rules is None else rules
    v = Version(version)
    apply = planned_apply(pack, version)
    by_key = {r.key: r for r in rules}
    for exc in exceptions:
        if exc.fix is not None:
            if exc.fix not in apply:
                raise BadInput(f"{where}: exception for {exc.fix!r}, which is not a fix of the series")
            if exc.apply is None:
                raise BadInput(f"{where}: exception for {exc.fix!r} names no apply outcome")
            if apply[exc.fix] == exc.apply:
                raise BadInput(f"{where}: exception {exc.fix} = {exc.apply!r} is what the rule derives")
            apply[exc.fix] = exc.apply
    shipped = {fid for fid in pack.series if pack.fixes[fid].is_fixed_in(v)}
    # a release the pack cannot serve (a fix failed: no variant) gets no patched tree; its
    # exposure run reads the pristine tree as its own head (evidence/verdicts.py)
    served = FAILED not in apply.values()
    has = {"pristine": shipped, "patched": shipped | {f for f, s in apply.items() if s in (APPLIED, PRESENT)}
           if served else shipped}
    verdicts: dict[tuple[str, str], str] = {}
    for rule in rules:
        for role in ROLES:
            tree = has[role]
            verdict: TreeVerdict
            if not all(v in spec for spec in rule.needs_releases) or not set(rule.needs_fixes) <= tree:
                verdict = TreeVerdict.NOT_APPLICABLE
            elif not all(set(fix.split("|")) & tree for fix in rule.proves):  # "a|b": either fix
                verdict = UNSAFE
            else:
                verdict = SAFE
            verdicts[(role, rule.key)] = verdict
    for exc in exceptions:
        if exc.case is None:
            continue
        if exc.case not in by_key:
            raise BadInput(f"{where}: exception for {exc.case!r}, which no probe registers")
        for role in ROLES:
            stated = getattr(exc, role)
            if stated is None:
                continue
            if verdicts[(role, exc.case)] == stated:
                raise BadInput(f"{where}: exception {exc.case} {role} = {stated!r} is what the rule derives")
            verdicts[(role, exc.case)] = stated
    return Expected(apply, verdicts)


@memoize
def pack_at(root: Path):
    from backport.pack import load_pack

    return load_pack(root)


def epochs(pack, releases: Mapping[str, Release]) -> list[list[str]]:
    """The measured releases grouped into code epochs, oldest first: releases that get the same
    variant of every fix (or the same outcome where none applies) and whose derived table is the
    same. The suite runs the matrix tests on every release and the other real-tree tests on one
    representative per epoch (`representatives`): within an epoch the pack's code and what the
    cases must show do not change."""
    groups: dict[tuple, list[str]] = {}
    for version, release in releases.items():
        derived = release.derived
        if not release.measured or derived is None:  # a measured row always derives
            continue
        variants = tuple((fid, status, getattr(pack.variant_for(fid, version), "name", None)
                          if status == APPLIED else None) for fid, status in derived.apply.items())
        table = tuple(sorted(derived.verdicts.items()))
        groups.setdefault((variants, table), []).append(version)
    return sorted(groups.values(), key=lambda versions: Version(versions[0]))


def representatives(pack, releases: Mapping[str, Release]) -> list[str]:
    """The newest release of each code epoch (see `epochs`)."""
    return [versions[-1] for versions in epochs(pack, releases)]
