"""The decision loop: per fix, in series order, what the run does with it.

* ``not-applicable`` when the version is in ``fixed_in``;
* ``already-present`` when the fingerprint matches or the chosen variant
  reverse-applies cleanly (exact/offset, no fuzz; when no variant covers the
  version, any variant that reverse-applies counts);
* ``not-applicable`` (said out loud: the release stays exposed) when the
  fix's ``scope`` excludes the version; it satisfies no dependency;
* ``failed`` when no variant's Applies-To contains the version, or a
  dependency (the fix's ``depends_on``) was neither applied earlier in this
  run, present, nor not applicable;
* then the variant is placed on the overlay (later fixes see earlier ones):
  ``applied``, or ``failed`` with every conflict, or ``already-present``
  when it conflicts forward but reverse-applies with fuzz (a patch applied
  earlier with fuzz: a re-run must be nothing-to-do). A missing fix is worse
  than a loud failure, so the strict reverse check comes first and the fuzzy
  one only after forward placement failed.

A file the engine must not touch (``blocked``: local changes, a
skip-worktree or assume-unchanged entry) or that git does not track fails
the fix that would change it. Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from packaging.version import Version

from ..pack.model import Fix, Pack, PatchVariant
from ..vocab import PatchStatus
from .detect import fingerprint_match
from .overlay import Overlay, patch_file, reverse_applies
from .placement import CONFLICT
from .report import (
    APPLIED,
    DOES_NOT_PLACE,
    FAILED,
    MISSING_DEPENDENCY,
    NO_VARIANT,
    NOT_APPLICABLE,
    OUT_OF_SCOPE,
    PRESENT,
    SHIPPED,
    HunkResult,
    PatchResult,
)

Pending = tuple[Fix, PatchVariant, dict[str, "bytes | None"]]  # a fix to commit and the files it changes


@dataclass(frozen=True)
class Decision:
    results: tuple[PatchResult, ...]
    pending: tuple[Pending, ...]  # in series order
    overlay: Overlay  # the tree with every pending change (overlay.changes)
    state: Mapping[str, PatchStatus]  # fix id -> status

    @property
    def failed(self) -> bool:
        return FAILED in self.state.values()

    def changed_paths(self) -> list[tuple[str, bool]]:
        """(path under the package root, existed before the run) for every file the pending patches change."""
        return [
            (rel, self.overlay.disk(rel) is not None) for _, _, changes in self.pending for rel in changes
        ]

    def final_contents(self) -> dict[str, bytes | None]:
        """{path under the package root: content after the series, None = deleted}."""
        final: dict[str, bytes | None] = {}
        for _, _, changes in self.pending:
            final.update(changes)
        return final


def decide(repo: Path, prefix: str, pack: Pack, v: Version, selected: Sequence[str],
           blocked: Mapping[str, str], base_entries: Mapping[str, tuple[str, str]] | None) -> Decision:
    """Every fix's outcome, in memory. ``blocked``: {repo path: why the engine
    must not touch it}. ``base_entries`` None: the tracked-by-git check is
    left to the caller (which decides again when a changed file is untracked)."""
    ov = Overlay(repo / prefix)
    state: dict[str, PatchStatus] = {}
    out_of_scope: set[str] = set()  # not-applicable because the pack has no backport for v
    results: list[PatchResult] = []
    pending: list[tuple[Fix, PatchVariant, dict[str, bytes | None]]] = []

    def tracked(rel: str) -> bool:
        return base_entries is None or prefix + rel in base_entries

    def is_present(fix: Fix, variant: PatchVariant | None) -> tuple[bool, str]:
        fp_ok, how = fingerprint_match(fix, ov.read_text)
        if fp_ok:
            return True, how
        cands = [variant] if variant is not None else list(pack.variants.get(fix.id, ()))
        for pv in cands:
            if reverse_applies(ov, pv):
                return True, f"{pv.name} reverse-applies cleanly"
        return False, how

    for fid in selected:
        fix = pack.fixes[fid]
        if fix.is_fixed_in(v):
            state[fid] = NOT_APPLICABLE
            results.append(PatchResult(fid, None, NOT_APPLICABLE, f"{v} is in fixed_in {fix.fixed_in}",
                                       cause=SHIPPED))
            continue
        variant = pack.variant_for(fid, v)
        vname = variant.name if variant else None
        vsha = variant.sha256 if variant else None
        present, how = is_present(fix, variant)
        if present:
            state[fid] = PRESENT
            results.append(PatchResult(fid, vname, PRESENT, how, variant_sha256=vsha))
            continue
        if not fix.in_scope(v):
            state[fid] = NOT_APPLICABLE
            out_of_scope.add(fid)
            results.append(PatchResult(fid, None, NOT_APPLICABLE,
                                       f"no backport for sglang {v}: the pack carries {fid} for {fix.scope} "
                                       f"only; this release lacks the fix and stays exposed",
                                       cause=OUT_OF_SCOPE))
            continue
        if variant is None:
            have = ", ".join(f"{pv.name} ({pv.applies_to})" for pv in pack.variants.get(fid, ())) or "none"
            state[fid] = FAILED
            results.append(
                PatchResult(fid, None, FAILED, f"no variant applies to sglang {v}; variants: {have}",
                            cause=NO_VARIANT)
            )
            continue
        missing = []
        for dep in dict.fromkeys(fix.depends_on + variant.depends_on):
            st = state.get(dep)
            if dep in out_of_scope:
                missing.append(f"{dep} (no backport for {v})")
                continue
            if st in (APPLIED, PRESENT, NOT_APPLICABLE):
                continue
            if st == FAILED:
                missing.append(f"{dep} (failed)")
                continue
            dfix = pack.fixes.get(dep)
            if dfix is not None and dep not in state and (
                    dfix.is_fixed_in(v) or is_present(dfix, pack.variant_for(dep, v))[0]):
                continue  # outside this run (--only): fixed in the release, or there
            missing.append(f"{dep} (not present)" if dep not in selected else f"{dep} (not applied)")
        if missing:
            state[fid] = FAILED
            results.append(PatchResult(fid, vname, FAILED, "missing dependency: " + ", ".join(missing),
                                       variant_sha256=vsha, cause=MISSING_DEPENDENCY))
            continue
        hunk_results: list[HunkResult] = []
        changes: dict[str, bytes | None] = {}
        problems: list[str] = []
        untouchable = False  # a file the engine must not touch (local changes, untracked)
        for fp in variant.files:
            why = blocked.get(prefix + fp.path)
            if why is not None:
                hunk_results.append(HunkResult(fp.path, CONFLICT, reason=f"file has {why}"))
                problems.append(f"{fp.path}: {why}")
                untouchable = True
                continue
            if not fp.is_creation and fp.path not in ov.changes and not tracked(fp.path):
                hunk_results.append(HunkResult(fp.path, CONFLICT, reason="file is not tracked by git"))
                problems.append(f"{fp.path}: not tracked by git")
                untouchable = True
                continue
            hr, new, ok = patch_file(fp, ov, reverse=False)
            hunk_results.extend(hr)
            if ok:
                changes[fp.path] = new
                if fp.is_creation:
                    ov.modes[fp.path] = fp.new_mode or "100644"
            else:
                for h in hr:
                    if h.status == CONFLICT:
                        problems.append(
                            f"{h.file}:{h.line}: {h.reason}" if h.line else f"{h.file}: {h.reason}"
                        )
        if problems and not untouchable and reverse_applies(ov, variant, fuzz=2):
            # a patch applied earlier with fuzz: its new side is there (with
            # fuzz) and its old side is not; strict reverse-apply came first
            state[fid] = PRESENT
            results.append(
                PatchResult(
                    fid,
                    vname,
                    PRESENT,
                    f"{variant.name} reverse-applies with fuzz and does not apply forward",
                    variant_sha256=vsha,
                )
            )
            continue
        if problems:
            state[fid] = FAILED
            results.append(PatchResult(fid, vname, FAILED, "; ".join(problems), tuple(hunk_results),
                                       variant_sha256=vsha, cause=DOES_NOT_PLACE))
            continue
        ov.changes.update(changes)
        state[fid] = APPLIED
        pending.append((fix, variant, changes))
        results.append(PatchResult(fid, vname, APPLIED, "", tuple(hunk_results), variant_sha256=vsha))
    return Decision(tuple(results), tuple(pending), ov, MappingProxyType(state))
