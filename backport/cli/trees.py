"""Subcommands about trees: `fetch`, `status`, `apply`, `gc`."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from backport import cache, resources
from backport.cli import emit
from backport.errors import BadInput
from backport.vocab import ApplyStatus

if TYPE_CHECKING:  # the library is imported by the commands that use it: --help and bad input stay light
    from backport.tree import Tree


def version_arg(p) -> None:
    p.add_argument(
        "--version",
        metavar="X",
        help="the release of a checkout, directory or git target when its tag and version file say "
        "none, or disagree (a wheel's version is its own)",
    )


def target_args(p) -> None:
    p.add_argument("--allow-unpinned", action="store_true",
                   help="fetch a sglang==X that patches/releases.toml does not pin (recorded as unpinned)")
    p.add_argument("--python", help="for the 'installed' spec: the interpreter whose sglang to take")


def fetch_tree(spec: str, args) -> Tree:
    """Fetch with the pins of the release matrix in force (a --series pack's own, if it has one);
    the version is --version's, or the tree's own (none: bad input saying how to give one)."""
    from backport.releases import default_path, load_pins
    from backport.sources import materialise, parse_spec, source_kind
    from backport.tree import decided_version

    series = getattr(args, "series", None)
    pins = load_pins(default_path(Path(series))) if series else None
    version = getattr(args, "version", None)
    kind = source_kind(parse_spec(spec, allow_unpinned=args.allow_unpinned, python=args.python, pins=pins))
    if version is not None and kind in ("wheel", "installed"):
        raise BadInput(
            f"--version {version}: only for a checkout, a directory or a git target ({spec} says its "
            f"own version)"
        )
    tree = materialise(spec, allow_unpinned=args.allow_unpinned, python=args.python, pins=pins).tree
    return replace(tree, version=decided_version(tree, version, "git" if kind == "git" else "path"))


def load_series(args):
    from backport.pack import load_pack

    series = Path(args.series) if getattr(args, "series", None) else resources.pack_dir()
    if not series.is_dir():
        raise BadInput(f"{series}: no such patch series directory")
    return load_pack(series)


def is_checkout(target: str) -> bool:
    path = Path(target)
    return path.is_dir() and (path / ".git").exists()


def cmd_fetch(args) -> int:
    from backport.sources import materialise

    fetched = materialise(args.spec, allow_unpinned=args.allow_unpinned, python=args.python)
    tree = fetched.tree
    emit(args, fetched.to_json(),
         f"{tree.path}\nversion {tree.version}  tree {tree.tree_digest}  "
         f"artifact {tree.artifact_sha256 or '-'}  {'cache hit' if fetched.cached else 'fetched'}")
    return 0


def cmd_status(args) -> int:
    from backport.engine import detect
    from backport.export.installed import describe_installed, rollout
    from backport.tree import open_tree

    pack = load_series(args)
    path = Path(args.target)
    if path.is_dir():
        tree = open_tree(path, version=args.version)
    else:
        # Describe the fetched tree as it is now (its recorded digest is of the pristine tree).
        fetched = fetch_tree(args.target, args)
        tree = open_tree(fetched.path, spec=fetched.spec, version=fetched.version)
    found = detect(tree.package_root, pack, version=tree.version)
    document = {**tree.to_json(), "fixes": [d.to_json() for d in found]}
    lines = [f"{tree.path}: sglang {tree.version}, tree digest {tree.tree_digest}"]
    lines += [f"  {d.fix:10} {'present' if d.present else 'missing':8} {d.how}" for d in found]
    if args.target == "installed":
        installed = describe_installed(args.python or sys.executable, tree.package_root,
                                       [Path(b) for b in args.bundle or ()])
        document["installed"] = installed.to_json()
        document["installed"]["rollout"] = advice = rollout(installed, {d.fix for d in found if d.present})
        lines += installed_lines(installed, bool(args.bundle))
        lines.append("  rollout: " + advice["order"] + (
            "; the PD peer must run this patch set too" if advice["peer_must_be_patched"] else ""))
        if advice["rollback"]:
            lines.append(
                f"  rollback: {advice['rollback']}  (a plain `pip install sglang==X` keeps this build)"
            )
    elif args.bundle or args.require_patched:
        raise BadInput(
            f"{'--bundle' if args.bundle else '--require-patched'}: only with the 'installed' target"
        )
    emit(args, document, "\n".join(lines))
    # A rollout gate: 1 unless this node runs a whole exported build (record, label and tree agree).
    return 1 if args.require_patched and not installed.patched else 0


def installed_lines(installed, asked: bool) -> list[str]:
    record = installed.provenance
    if record is None:
        lines = [
            f"installed: sglang {installed.version}, not a wheel exported by sglang-backport: NOT patched"
        ]
    else:
        lines = [
            (
                f"installed: sglang {installed.version}, exported by sglang-backport from "
                f"{record.get('spec')} "
                f"(patch set {str(record.get('patch_set_sha256'))[:12]}, {len(record.get('commits') or [])} "
                "commits)"
            ),
            "  the installed package "
            + (
                "is the tree its record names"
                if installed.digest_matches
                else f"is NOT the tree its record names ({record.get('tree_digest')})"
            ),
            f"  sglang.__version__ says {installed.package_version}: "
            + ("patched" if installed.patched else "NOT a whole patched build"),
        ]
    for match in installed.bundles:
        lines.append(f"  described by {match['bundle']}: "
                     + ("verifies" if match["verifies"] else f"does NOT verify ({match['problem']})"))
    if asked and not installed.bundles:
        lines.append("  no given bundle has this tree as its subject")
    return lines


def work_tree(args) -> Tree:
    """The tree `apply` changes: a user's checkout in place, else a fresh clone (of the fetched spec,
    or with --out of the checkout's HEAD, leaving the checkout as it is)."""
    from backport.sources import clone_pristine
    from backport.tree import clone_tree, decided_version, open_tree

    out = out_dir(args.out) if args.out else None
    if is_checkout(args.target):
        checkout = open_tree(Path(args.target), version=args.version)
        checkout = replace(checkout, version=decided_version(checkout, args.version, "checkout"))
        return checkout if out is None else clone_tree(checkout, out.parent, out)
    source = fetch_tree(args.target, args)
    return clone_pristine(source, out.parent if out else cache.work_root(), out)


def out_dir(value: str) -> Path:
    """`apply --out DIR`, checked before any work: absolute (git clones from DIR's parent, so a
    relative DIR would nest), absent or an empty directory, in a parent a directory can be made in
    (tried, then removed: os.access says yes to root on /proc)."""
    out = Path(os.path.abspath(Path(value).expanduser()))  # `..` resolved here, as git is then given it
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"--out {value}: exists and is not an empty directory")
    parent = _existing_parent(out if out.exists() else out.parent)
    if not parent.is_dir():
        raise BadInput(f"--out {value}: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sglang-backport-out-", dir=parent))
    except OSError as exc:
        raise BadInput(f"--out {value}: cannot create a directory in {parent} ({exc.strerror})") from None
    return out


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def cmd_apply(args) -> int:
    if args.check and args.out:
        raise BadInput(f"--out {args.out}: --check changes nothing and makes no clone; drop one of them")
    if args.out:
        out_dir(args.out)  # refused before the pack is read or anything is fetched or cloned
    from backport.engine import apply_series
    from backport.tree import decided_version, open_tree

    pack = load_series(args)
    if args.check and not is_checkout(args.target):
        tree = fetch_tree(args.target, args)  # --check on a spec: the cached pristine tree, unchanged
    elif args.check:
        tree = open_tree(Path(args.target), version=args.version)
        tree = replace(tree, version=decided_version(tree, args.version, "checkout"))
    else:
        tree = work_tree(args)
    report = apply_series(tree.path, pack, tree.version, package_prefix=tree.package_prefix,
                          only=args.only or None, check=args.check, allow_dirty=args.allow_dirty)
    lines = [f"{tree.path}: sglang {tree.version} -> {report.status}"]
    for patch in report.patches:
        lines.append(
            f"  {patch.fix:10} {patch.status:16} {patch.variant or ''} {patch.reason or ''}".rstrip()
        )
        for hunk in patch.hunks:
            lines.append(f"      {hunk.file}: {hunk.status} offset={hunk.offset} fuzz={hunk.fuzz}")
    if not args.check and not is_checkout(args.target) and not args.out:
        lines.append(f"(a work clone under {cache.work_root()}; `sglang-backport gc` removes old ones)")
    emit(args, report.to_json(), "\n".join(lines))
    return 1 if report.status == ApplyStatus.FAILED else 0


def cmd_gc(args) -> int:
    if args.older_than < 0:
        raise BadInput(f"--older-than {args.older_than}: must be zero or more days")
    result = cache.gc(older_than_days=args.older_than)
    emit(args, result, f"removed {len(result['removed'])} item(s) from {result['cache']}"
         + "".join(f"\n  {p}" for p in result["removed"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("fetch", help="materialise a target into the cache")
    p.add_argument("spec", help="sglang==X | git+URL@SHA | PATH | installed")
    target_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("status", help="which fixes a tree has, by fingerprint")
    p.add_argument("target", help="a spec or a path")
    target_args(p)
    version_arg(p)
    p.add_argument("--series", help="patch series directory (default: the pack shipped with the toolkit)")
    p.add_argument("--bundle", action="append", metavar="PATH",
                   help="for 'installed': an evidence bundle, or a folder of bundles, to match the installed "
                        "tree against (repeatable)")
    p.add_argument(
        "--require-patched",
        action="store_true",
        help="for 'installed': exit 1 unless the environment runs a wheel exported by sglang-backport, "
        "whole (its record, its sglang.__version__ label and its measured tree agree)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("apply", help="apply the series for the tree's version")
    p.add_argument("target", help="a spec (worked on in a fresh clone) or a git checkout (in place)")
    target_args(p)
    version_arg(p)
    p.add_argument("--series")
    p.add_argument("--only", action="append", metavar="FIX", help="apply only this fix (repeatable)")
    p.add_argument("--check", action="store_true", help="compute the whole report, change nothing")
    p.add_argument("--out", help="where the fresh clone goes: of a spec's tree, or of a checkout's HEAD (the "
                                 "checkout itself is then left as it is); absent or an empty directory")
    p.add_argument("--allow-dirty", action="store_true",
                   help="patch a checkout whose index has staged changes, or whose files the series touches "
                        "have uncommitted changes (those files are never touched: their fix fails); unstaged "
                        "edits to other files never stop an apply")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("gc", help="remove old work clones, snapshots of installed packages and leftovers of "
                                  "killed runs from the cache")
    p.add_argument("--older-than", type=float, default=7.0, metavar="DAYS",
                   help="remove work clones and snapshots of installed packages not modified for this many "
                        "days (default 7; 0 removes all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)
