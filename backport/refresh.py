"""quilt's refresh for a new release: a fix's variant regenerated on release X's context.

``refresh(pack, fix, X)``:

1. checks: the fix is in the pack, X is pinned in the pack's release matrix and not in the
   fix's ``fixed_in``, and ``patches/<fix>/<fix>-X.patch`` does not exist;
2. the nearest variant: its Applies-To closest to X, in steps of the matrix's pinned
   releases (0 when it contains X; post releases are steps); a tie goes to the newer one;
3. X's pristine tree (the pinned wheel) is cloned; dependencies X lacks are applied first
   (``apply_series``), so the variant meets the tree a run gives it, outside its diff;
4. the variant is placed file by file with the engine's placement (exact, offset, fuzz up
   to 2: ``engine/placement.py``), whatever its Applies-To says;
5. all hunks placed: the clone is committed and the variant written from its ``git diff``
   (``gitops.diff``) under the nearest variant's header with Applies-To ``>=X,<NEXT``,
   Last-Update today and a Backport-Notes line naming the source, offsets and fuzz. NEXT is
   the first pinned release after X (X's post releases ride with X) that a variant of the
   fix or its ``fixed_in`` already covers, else the first after X; none at all: ``>=X``.
   When the nearest variant contains X, X moves out of it: its ``>=X`` becomes ``>=NEXT``
   (X inside its range but not at its start is bad input: narrow it by hand);
6. a hunk conflicts: the hunks that place are written to the clone (uncommitted), a file's
   conflicting hunks beside it as ``<file>.rej`` (GNU patch's format), the clone is kept:
   ``conflict``, exit 1. Once the user has carried each ``.rej`` into its file, deleted it
   and committed, ``continue_refresh`` writes the variant from the commits as in 5 (the
   clone keeps its base commit and source variant in its git directory: ``STATE``).

A variant file is created, never replaced (exit 2), and only once it loads as a variant of
the fix (``load_variant``: the header agrees with ``fixes.toml``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import git
from packaging.version import Version

from . import gitops
from .engine import apply_series
from .engine.overlay import Overlay, patch_file
from .engine.placement import CONFLICT, FileImage, apply_hunks, place_hunks
from .engine.report import FAILED, HunkResult
from .errors import BadInput
from .pack.load import load_variant
from .pack.model import Fix, Pack, PatchVariant, parse_version
from .releases import default_path, load_pins
from .sources import clone_pristine, materialise
from .tree import commit_all

STATE = "sglang-backport-refresh.json"  # in the clone's git dir: what --continue needs
PLACED, CONFLICTED, WRITTEN = "placed", "conflict", "written"


@dataclass(frozen=True)
class RefreshResult:
    fix: str
    release: str
    from_variant: str
    status: str  # placed (check only) | conflict | written
    path: Path | None  # the written variant; on conflict the work tree
    hunks: tuple[HunkResult, ...]
    applies_to: str
    narrowed: str = ""  # the nearest variant's new Applies-To when X moved out of it

    def to_json(self) -> dict:
        return {"fix": self.fix, "release": self.release, "from_variant": self.from_variant,
                "status": self.status, "path": str(self.path) if self.path else None,
                "applies_to": self.applies_to, "narrowed": self.narrowed or None,
                "hunks": [h.to_json() for h in self.hunks]}


def _plan(pack: Pack, fix_id: str, version: str) -> tuple[Version, PatchVariant, str, str]:
    """(X, the nearest variant, the new Applies-To, the nearest's new Applies-To or "")."""
    if (fix := pack.fixes.get(fix_id)) is None:
        raise BadInput(f"{fix_id}: no such fix in {pack.root / 'fixes.toml'}")
    v = parse_version(version, "--release")
    pins = sorted(load_pins(default_path(pack.root)), key=Version)
    if str(v) not in pins:
        raise BadInput(f"--release {v}: not pinned in the release matrix (pinned: {', '.join(pins)})")
    if fix.is_fixed_in(v):
        raise BadInput(f"{fix_id}: sglang {v} already contains the fix (fixed_in {fix.fixed_in})")
    if (target := pack.root / fix_id / f"{fix_id}-{v}.patch").exists():
        raise BadInput(f"{target}: exists; refresh never overwrites a variant")
    at = pins.index(str(v))

    def distance(pv: PatchVariant) -> tuple[int, int] | None:  # (steps to X, newest first)
        covered = [i for i, r in enumerate(pins) if pv.applies(r)]
        return (min(abs(i - at) for i in covered), -max(covered)) if covered else None
    ranked = sorted((d, pv.name, pv) for pv in pack.variants.get(fix_id, ()) if (d := distance(pv)))
    if not ranked:
        raise BadInput(f"{fix_id}: no variant covers a pinned release; nothing to refresh from")
    source = ranked[0][2]
    later = [r for r in pins[at + 1:] if Version(r).base_version != v.base_version]
    covered = [r for r in later if fix.is_fixed_in(r) or any(pv.applies(r) for pv in pack.variants[fix_id])]
    upper = (covered or later)[0] if covered or later else None
    applies = f">={v},<{upper}" if upper else f">={v}"
    narrowed = ""
    if source.applies(v):
        specs = [str(s) for s in source.applies_to]
        if f">={v}" not in specs or upper is None or not any(source.applies(r) for r in later):
            raise BadInput(
                f"{source.name}: its Applies-To {source.applies_to} serves sglang {v} and does not "
                f"start there alone; narrow it by hand first"
            )
        narrowed = ",".join([f">={upper}"] + [s for s in specs if s != f">={v}"])
    return v, source, applies, narrowed


def refresh(pack: Pack, fix_id: str, version: str, *, work_dir: Path | None = None,
            check: bool = False) -> RefreshResult:
    """Refresh ``fix_id``'s nearest variant for sglang ``version`` (module doc). ``work_dir``:
    where the clone goes (must not exist or be empty; default a new temporary directory).
    ``check``: place only, write nothing, keep no clone."""
    v, source, applies, narrowed = _plan(pack, fix_id, version)
    pristine = materialise(f"sglang=={v}", pins=load_pins(default_path(pack.root))).tree
    own = work_dir is None
    if work_dir is None:
        dest = Path(tempfile.mkdtemp(prefix=f"sglang-refresh-{fix_id}-{v}-"))
    else:
        dest = Path(work_dir)
    try:
        tree = clone_pristine(pristine, dest.parent, dest)
        deps = _closure(pack, fix_id, v)
        report = apply_series(tree.path, pack, str(v), package_prefix=tree.package_prefix, only=deps) \
            if deps else None
        if report is not None and report.status == FAILED:
            bad = ", ".join(p.fix for p in report.patches if p.status == FAILED)
            raise BadInput(f"{fix_id}: its dependency {bad} does not apply to sglang {v}; refresh it first")
        base = gitops.read_ref(tree.path, "HEAD") or ""
        hunks, rejects = _place(tree.package_root, source, write=not check)
    except BaseException:
        if own:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    conflict = any(h.status == CONFLICT for h in hunks)
    if check:
        if own:
            shutil.rmtree(dest)
        return RefreshResult(fix_id, str(v), source.name, CONFLICTED if conflict else PLACED, None, hunks,
                             applies, narrowed)
    if conflict:
        git_dir, _ = gitops.work_tree(tree.path)
        (git_dir / STATE).write_text(json.dumps({"fix": fix_id, "release": str(v), "base": base,
                                                 "from_variant": source.name, "prefix": tree.package_prefix}))
        with (git_dir / "info" / "exclude").open("a") as f:
            f.write("*.rej\n")  # a `git add -A` must not commit the rejects
        for rel, text in rejects.items():
            (tree.package_root / f"{rel}.rej").write_text(text)
        return RefreshResult(fix_id, str(v), source.name, CONFLICTED, tree.path, hunks, applies, narrowed)
    with git.Repo(tree.path) as repo:
        commit_all(repo, f"Refresh {source.name} for sglang {v}")
    path = _write(pack, source, str(v), tree.path, base, tree.package_prefix, applies, narrowed,
                  f"Refreshed for {v} from {source.name} by sglang-backport refresh: {_summary(hunks)}.")
    if own:
        shutil.rmtree(dest)
    return RefreshResult(fix_id, str(v), source.name, WRITTEN, path, hunks, applies, narrowed)


def continue_refresh(pack: Pack, fix_id: str, version: str, work_tree: Path) -> RefreshResult:
    """Write the variant from a conflicted refresh's clone once the user resolved and committed."""
    work_tree = Path(work_tree).resolve()
    git_dir, head = gitops.work_tree(work_tree)
    try:
        state = json.loads((git_dir / STATE).read_text())
    except (OSError, ValueError):
        raise BadInput(f"{work_tree}: not a work tree left by `sglang-backport refresh`") from None
    v, source, applies, narrowed = _plan(pack, fix_id, version)
    if (state["fix"], state["release"]) != (fix_id, str(v)):
        raise BadInput(
            f"{work_tree}: a refresh of {state['fix']} for {state['release']}, not {fix_id} for {v}"
        )
    if state["from_variant"] != source.name:
        raise BadInput(
            f"{work_tree}: refreshed from {state['from_variant']}; the nearest is now {source.name}"
        )
    if leftover := sorted(p.relative_to(work_tree).as_posix() for p in work_tree.rglob("*.rej")):
        raise BadInput(f"{work_tree}: {leftover[0]} is still there; carry it into its file and delete it")
    if dirty := gitops.uncommitted_paths(work_tree, f"{state['prefix']}sglang"):
        raise BadInput(f"{work_tree}: uncommitted changes (e.g. {min(dirty)}); commit the resolution first")
    if head == state["base"]:
        raise BadInput(f"{work_tree}: nothing committed since the refresh; resolve the .rej files and commit")
    path = _write(pack, source, str(v), work_tree, state["base"], state["prefix"], applies, narrowed,
                  f"Refreshed for {v} from {source.name} by sglang-backport refresh; its conflicting hunks "
                  f"were resolved by hand.")
    return RefreshResult(fix_id, str(v), source.name, WRITTEN, path, (), applies, narrowed)


def _closure(pack: Pack, fix_id: str, v: Version) -> list[str]:
    """The fix's dependencies, transitively, that release v does not already contain (series order)."""
    need: set[str] = set()
    todo = list(pack.fixes[fix_id].depends_on)
    while todo:
        dep = todo.pop()
        if dep not in need and not pack.fixes[dep].is_fixed_in(v):
            need.add(dep)
            todo.extend(pack.fixes[dep].depends_on)
    return [f for f in pack.series if f in need]


def _place(
    root: Path, variant: PatchVariant, *, write: bool
) -> tuple[tuple[HunkResult, ...], dict[str, str]]:
    """Place every file of the variant on the tree under ``root`` (the package root); with
    ``write``, write what places. Returns the hunk results and {file: reject text}."""
    ov = Overlay(root)
    results: list[HunkResult] = []
    rejects: dict[str, str] = {}  # file: its conflicting hunks in GNU patch's reject format
    for fp in variant.files:
        hr, new, ok = patch_file(fp, ov, reverse=False)
        results.extend(hr)
        dest = root / fp.path
        if ok:
            if write:
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.unlink() if new is None else dest.write_bytes(new)
            continue
        bad = list(fp.hunks)
        data = ov.read(fp.path)
        if data is not None and not fp.is_creation and not fp.is_deletion:
            img = FileImage.from_bytes(data)  # apply what places; reject the rest
            pls = place_hunks(img.lines, fp.hunks)
            good = [(h, p) for h, p in zip(fp.hunks, pls) if p.status != CONFLICT]
            bad = [h for h, p in zip(fp.hunks, pls) if p.status == CONFLICT]
            if write and good:
                dest.write_bytes(apply_hunks(img, [h for h, _ in good], [p for _, p in good]).to_bytes())
        out = [f"--- {'a/' + fp.old_path if fp.old_path else '/dev/null'}",
               f"+++ {'b/' + fp.new_path if fp.new_path else '/dev/null'}"]
        for h in bad:
            out += [f"@@ -{h.old_start},{h.old_len} +{h.new_start},{h.new_len} @@"] + [
                t + x for t, x in h.lines
            ]
        rejects[fp.path] = "\n".join(out) + "\n"
    return tuple(results), rejects


def _summary(hunks: tuple[HunkResult, ...]) -> str:
    """'2 of 8 hunks exact, 5 of 8 at offset -51/+3, 1 of 8 with fuzz 2 at offset +4'."""
    parts = []
    for status, label in (("exact", "hunks exact"), ("offset", "at offset"), ("fuzz", "with fuzz")):
        if mine := [h for h in hunks if h.status == status]:
            offsets = "/".join(f"{o:+d}" for o in sorted({h.offset for h in mine}))
            fuzz = f" {max(h.fuzz for h in mine)} at offset {offsets}"
            parts.append(
                f"{len(mine)} of {len(hunks)} {label}"
                + {"exact": "", "offset": f" {offsets}"}.get(status, fuzz)
            )
    return ", ".join(parts)


def _write(pack: Pack, source: PatchVariant, version: str, root: Path, base: str, prefix: str,
           applies: str, narrowed: str, note: str) -> Path:
    """Create ``<fix>-<version>.patch`` from the clone's diff under the source's header, checked
    against fixes.toml; then move the release out of the source's Applies-To when asked."""
    if not (body := gitops.diff(root, base, "HEAD", prefix)).strip():
        raise BadInput(f"{root}: no change under sglang/ since the refresh began")
    fix = pack.fixes[source.fix]
    target = pack.root / source.fix / f"{source.fix}-{version}.patch"
    header, _ = source.path.read_text().split("\n---\n", 1)
    text = _header(header, {"applies-to": applies, "last-update": _dt.date.today().isoformat()}, note)
    _put(target, text + "---\n" + body, fix)
    if narrowed:  # the new file exists: only now may the release leave the source
        head = _header(header, {"applies-to": narrowed}, "")
        _put(source.path, head + "---\n" + source.path.read_text().split("\n---\n", 1)[1], fix, replace=True)
    return target


def _header(raw: str, fields: dict[str, str], note: str) -> str:
    """The DEP-3 header ``raw`` with ``fields`` (lower-case name: value) replaced and ``note``
    appended to Backport-Notes; every other field is kept as written."""
    blocks: list[list[str]] = []
    for line in filter(str.strip, raw.splitlines()):  # a blank line only ends a field
        if line[0] in " \t" and blocks:
            blocks[-1].append(line)
        else:
            blocks.append([line])
    wrapped = textwrap.wrap(note, 88)
    out, noted = [], not note
    for block in blocks:
        name = block[0].split(":", 1)[0].strip()
        if name.lower() in fields:
            block = [f"{name}: {fields[name.lower()]}"]
        elif name.lower() == "backport-notes" and note:
            block, noted = block + [" " + w for w in wrapped], True
        out += block
    if not noted:
        out += [f"Backport-Notes: {wrapped[0]}"] + [" " + w for w in wrapped[1:]]
    return "\n".join(out) + "\n"


def _put(target: Path, text: str, fix: Fix, *, replace: bool = False) -> None:
    """Write ``text`` at ``target`` only when it loads as a variant of the fix (Description,
    Origin, Bug, Depends-On agree with fixes.toml); unless ``replace``, only when ``target``
    does not exist (a hard link fails where a rename would replace)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        load_variant(tmp, fix.id, fix)
        if replace:
            os.replace(tmp, target)
            return
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise BadInput(f"{target}: exists; refresh never overwrites a variant") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
