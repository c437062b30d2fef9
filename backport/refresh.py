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
5. every hunk exact or at an offset (no fuzz): the variant as it is serves X, so no file is
   forked (a second file with the same hunks at other line numbers would repeat it):
   ``served`` when its Applies-To already contains X (nothing written), ``widened`` when
   stretching its Applies-To over X claims no pinned release but X and the ones a variant
   for X would take (below); its header gets the range, Last-Update today and a
   Backport-Notes line. Otherwise (fuzz, or the range would claim other releases):
6. all hunks placed: the clone is committed and the variant written from its ``git diff``
   (``gitops.diff``) under the nearest variant's header with Applies-To ``>=X,<NEXT``,
   Last-Update today and a Backport-Notes line naming the source, offsets and fuzz. NEXT is
   the first pinned release after X (X's post releases ride with X) that a variant of the
   fix or its ``fixed_in`` already covers, else the first after X; none at all: ``>=X``.
   When the nearest variant contains X, X moves out of it: its ``>=X`` becomes ``>=NEXT``
   (X inside its range but not at its start is bad input: narrow it by hand);
7. a hunk conflicts: the hunks that place are written to the clone (uncommitted), a file's
   conflicting hunks beside it as ``<file>.rej`` (GNU patch's format), the clone is kept:
   ``conflict``, exit 1. Once the user has carried each ``.rej`` into its file, deleted it
   and committed, ``continue_refresh`` writes the variant from the commits as in 6 (the
   clone keeps its base commit and source variant in its git directory: ``STATE``).

A variant file is created, never replaced (exit 2), and only once it loads as a variant of
the fix (``load_variant``: the header agrees with ``fixes.toml``); a widened header is
rewritten only under the same check.
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
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import gitops
from .engine import apply_series
from .engine.overlay import Overlay, patch_file
from .engine.placement import CONFLICT, EXACT, FUZZ, OFFSET, FileImage, apply_hunks, place_hunks
from .engine.report import FAILED, HunkResult
from .errors import BadInput
from .pack.load import load_variant
from .pack.model import Fix, Pack, PatchVariant, parse_version
from .releases import default_path, load_pins
from .sources import clone_pristine, materialise
from .tree import commit_all
from .vocab import ApplyStatus

STATE = "sglang-backport-refresh.json"  # in the clone's git dir: what --continue needs
PLACED, CONFLICTED, WRITTEN = "placed", "conflict", "written"
SERVED, WIDENED = "served", "widened"  # the nearest variant places without fuzz: no file forked


@dataclass(frozen=True)
class RefreshResult:
    fix: str
    release: str
    from_variant: str
    status: str  # placed (check only) | conflict | written | widened | served
    path: Path | None  # the written or widened variant; on conflict the work tree
    hunks: tuple[HunkResult, ...]
    applies_to: str  # the written variant's Applies-To; widened: the nearest's new one
    narrowed: str = ""  # the nearest variant's new Applies-To when X moved out of it

    def to_json(self) -> dict:
        return {"fix": self.fix, "release": self.release, "from_variant": self.from_variant,
                "status": self.status, "path": str(self.path) if self.path else None,
                "applies_to": self.applies_to, "narrowed": self.narrowed or None,
                "hunks": [h.to_json() for h in self.hunks]}


def _plan(pack: Pack, fix_id: str, version: str) -> tuple[Version, PatchVariant, str, str, str]:
    """(X, the nearest variant, a forked variant's Applies-To, the nearest's new Applies-To or "",
    why no variant can be forked for X or "")."""
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
    after = pins[at + 1:]
    # the first later release something already serves ends the fork, a post release of X's own
    # included (skipping those claimed one twice: -0.4.10.post1 wrote <0.5.1 over -0.4.10.post2's
    # 0.4.10.post2); with none served, the fork reaches the next base version
    later = [r for r in after if Version(r).base_version != v.base_version]
    covered = [r for r in after if fix.is_fixed_in(r) or any(pv.applies(r) for pv in pack.variants[fix_id])]
    upper = covered[0] if covered else (later[0] if later else None)
    applies = f">={v},<{upper}" if upper else f">={v}"
    narrowed = refusal = ""
    if source.applies(v):
        specs = [str(s) for s in source.applies_to]
        if f">={v}" not in specs or upper is None or not any(source.applies(r) for r in later):
            refusal = (f"{source.name}: its Applies-To {source.applies_to} serves sglang {v} and does not "
                       f"start there alone; narrow it by hand first")
        else:
            narrowed = ",".join([f">={upper}"] + [s for s in specs if s != f">={v}"])
    return v, source, applies, narrowed, refusal


def _widened(pack: Pack, source: PatchVariant, v: Version, applies: str, pins: list[str]) -> str:
    """The nearest variant's Applies-To stretched over X, or "" when that would claim a pinned
    release a variant forked for X would not take (its range ``applies``) or another variant
    serves, or when the range is not a plain ``>=A[,<B]``."""
    lows = [s.version for s in source.applies_to if s.operator == ">="]
    highs = [s.version for s in source.applies_to if s.operator == "<"]
    if len(lows) != 1 or len(highs) > 1 or len(lows) + len(highs) != len(source.applies_to):
        return ""
    mine = SpecifierSet(applies)
    upper = [s.version for s in mine if s.operator == "<"]
    if Version(lows[0]) < v:  # X lies above the range: its top moves to where X's would end
        spec = ",".join([f">={lows[0]}"] + [f"<{u}" for u in upper])
    else:  # below: its bottom moves down to X
        spec = ",".join([f">={v}"] + [f"<{h}" for h in highs])
    gained = {r for r in pins if SpecifierSet(spec).contains(r, prereleases=True) and not source.applies(r)}
    others = {r for pv in pack.variants.get(source.fix, ()) if pv is not source
              for r in pins if pv.applies(r)}
    if gained & others or not gained <= {r for r in pins if mine.contains(r, prereleases=True)}:
        return ""
    return spec



def refresh(pack: Pack, fix_id: str, version: str, *, work_dir: Path | None = None,
            check: bool = False) -> RefreshResult:
    """Refresh ``fix_id``'s nearest variant for sglang ``version`` (module doc). ``work_dir``:
    where the clone goes (must not exist or be empty; default a new temporary directory).
    ``check``: place only, write nothing, keep no clone."""
    v, source, applies, narrowed, refusal = _plan(pack, fix_id, version)
    pins = load_pins(default_path(pack.root))
    pristine = materialise(f"sglang=={v}", pins=pins).tree
    own = work_dir is None
    if work_dir is None:
        dest = Path(tempfile.mkdtemp(prefix=f"sglang-refresh-{fix_id}-{v}-"))
    else:
        dest = Path(work_dir)
    try:
        tree = clone_pristine(pristine, dest.parent, dest)
        deps = _closure(pack, fix_id, v, source.depends_on)
        report = apply_series(tree.path, pack, str(v), package_prefix=tree.package_prefix, only=deps) \
            if deps else None
        if report is not None and report.status == ApplyStatus.FAILED:
            bad = ", ".join(p.fix for p in report.patches if p.status == FAILED)
            raise BadInput(f"{fix_id}: its dependency {bad} does not apply to sglang {v}; refresh it first")
        base = gitops.read_ref(tree.path, "HEAD") or ""
        hunks, rejects = _place(tree.package_root, source, write=not check)
        conflict = any(h.status == CONFLICT for h in hunks)
        unfuzzed = not check and all(h.status in (EXACT, OFFSET) for h in hunks)
        widened = _widened(pack, source, v, applies, sorted(pins, key=Version)) \
            if unfuzzed and not source.applies(v) else ""
        as_is = unfuzzed and (source.applies(v) or bool(widened))  # the source serves X as it is: no fork
        if refusal and not check and not as_is:
            raise BadInput(refusal)  # a variant must be forked for X and X cannot leave the source
    except BaseException:
        if own:
            shutil.rmtree(dest, ignore_errors=True)
        raise
    if check or as_is:
        if own:
            shutil.rmtree(dest)
        if check:
            return RefreshResult(fix_id, str(v), source.name, CONFLICTED if conflict else PLACED, None, hunks,
                                 applies, narrowed)
        if not widened:
            return RefreshResult(fix_id, str(v), source.name, SERVED, None, hunks,
                                 source.header["Applies-To"].strip())
        _widen(pack, source, widened, f"Widened to {v} by sglang-backport refresh: its hunks place there "
                                      f"{_summary(hunks)}, no fuzz, so {v} needs no variant of its own.")
        return RefreshResult(fix_id, str(v), source.name, WIDENED, source.path, hunks, widened)
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
    v, source, applies, narrowed, refusal = _plan(pack, fix_id, version)
    if refusal:
        raise BadInput(refusal)
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


def _closure(pack: Pack, fix_id: str, v: Version, extra: tuple[str, ...] = ()) -> list[str]:
    """The fix's dependencies and the source variant's own (``extra``), transitively, that release
    v does not already contain (series order)."""
    need: set[str] = set()
    todo = list(pack.fixes[fix_id].depends_on) + list(extra)
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
    for status, label in ((EXACT, "hunks exact"), (OFFSET, "at offset"), (FUZZ, "with fuzz")):
        if mine := [h for h in hunks if h.status == status]:
            offsets = "/".join(f"{o:+d}" for o in sorted({h.offset for h in mine}))
            fuzz = f" {max(h.fuzz for h in mine)} at offset {offsets}"
            parts.append(
                f"{len(mine)} of {len(hunks)} {label}"
                + {EXACT: "", OFFSET: f" {offsets}"}.get(status, fuzz)
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


def _widen(pack: Pack, source: PatchVariant, applies: str, note: str) -> None:
    """Rewrite the source's header with its widened Applies-To, Last-Update today and ``note``."""
    header, body = source.path.read_text().split("\n---\n", 1)
    text = _header(header, {"applies-to": applies, "last-update": _dt.date.today().isoformat()}, note)
    _put(source.path, text + "---\n" + body, pack.fixes[source.fix], replace=True)


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
