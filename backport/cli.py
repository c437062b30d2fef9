"""`sglang-backport`: a thin CLI that wires sources, the engine, probes and evidence together.

Exit codes (DESIGN.md): 0 success or safe, 1 a finding, 2 bad input (one line, no traceback).
With --json every reporting subcommand prints exactly one JSON document on stdout; progress
and human output go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from backport import __version__, cache
from backport.errors import BadInput, Finding

DEFAULT_SERIES = Path(__file__).resolve().parent.parent / "patches"


def _emit(args, document: dict, human: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(human)


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-unpinned", action="store_true",
                   help="fetch a sglang==X that patches/targets.toml does not pin (recorded as unpinned)")
    p.add_argument("--python", help="for the 'installed' spec: the interpreter whose sglang to take")


def _fetch(spec: str, args):
    from backport.sources import materialise

    return materialise(spec, allow_unpinned=args.allow_unpinned, python=args.python)


def _pack(args):
    from backport.series import load_pack

    series = Path(args.series) if getattr(args, "series", None) else DEFAULT_SERIES
    if not series.is_dir():
        raise BadInput(f"{series}: no such patch series directory")
    return load_pack(series)


# ---- fetch / status ---------------------------------------------------------------------------


def cmd_fetch(args) -> int:
    fetched = _fetch(args.spec, args)
    tree = fetched.tree
    _emit(args, fetched.to_json(),
          f"{tree.path}\nversion {tree.version}  tree {tree.tree_digest}  "
          f"artifact {tree.artifact_sha256 or '-'}  {'cache hit' if fetched.cached else 'fetched'}")
    return 0


def cmd_status(args) -> int:
    from backport.detect import detect
    from backport.tree import open_tree

    path = Path(args.target)
    if path.is_dir():
        tree = open_tree(path)
    else:
        # Describe the fetched tree as it is now (its recorded digest is of the pristine tree).
        fetched = _fetch(args.target, args).tree
        tree = open_tree(fetched.path, spec=fetched.spec)
    pack = _pack(args)
    found = detect(tree.package_root, pack, version=tree.version)
    document = {**tree.to_json(), "fixes": [d.to_json() for d in found]}
    lines = [f"{tree.path}: sglang {tree.version}, tree digest {tree.tree_digest}"]
    lines += [f"  {d.fix:10} {'present' if d.present else 'missing':8} {d.how}" for d in found]
    _emit(args, document, "\n".join(lines))
    return 0


# ---- apply ------------------------------------------------------------------------------------


def prepare_work_tree(target: str, args):
    """(tree to patch, in_place). A spec or a snapshot is cloned fresh; a user's checkout is used in place."""
    import git

    from backport.tree import Tree, open_tree

    path = Path(target)
    if path.is_dir() and (path / ".git").exists():
        return open_tree(path), True
    fetched = _fetch(target, args).tree
    if getattr(args, "out", None):
        out = Path(args.out)
    else:
        work = cache.cache_root() / "work"
        work.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"sglang-{fetched.version}-", dir=work))
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"{out}: --out directory exists and is not empty")
    git.Repo.clone_from(str(fetched.path), str(out)).close()
    clone = Tree(out.resolve(), fetched.package_prefix, fetched.version, fetched.spec,
                 fetched.artifact_sha256, fetched.tree_digest, fetched.base_commit, fetched.unpinned)
    return clone, False


def apply_to(tree, pack, args):
    from backport.apply import apply_series

    return apply_series(tree.path, pack, tree.version, package_prefix=tree.package_prefix,
                        only=args.only or None, check=args.check, allow_dirty=args.allow_dirty)


def cmd_apply(args) -> int:
    pack = _pack(args)
    if args.check and not (Path(args.target).is_dir() and (Path(args.target) / ".git").exists()):
        # --check on a spec: compute the report against the cached pristine tree, changing nothing.
        tree = _fetch(args.target, args).tree
    else:
        tree, _ = prepare_work_tree(args.target, args)
    report = apply_to(tree, pack, args)
    document = report.to_json()
    lines = [f"{tree.path}: sglang {tree.version} -> {report.status}"]
    for patch in report.patches:
        lines.append(f"  {patch.fix:10} {patch.status:16} {patch.variant or ''} {patch.reason or ''}".rstrip())
        for hunk in patch.hunks:
            lines.append(f"      {hunk.file}: {hunk.status} offset={hunk.offset} fuzz={hunk.fuzz}")
    _emit(args, document, "\n".join(lines))
    return 1 if report.status == "failed" else 0


# ---- probes -----------------------------------------------------------------------------------


def cmd_env(args) -> int:
    from backport.probeenv import ensure_env

    python = ensure_env(args.python)
    _emit(args, {"python": str(python)}, str(python))
    return 0


def cmd_probe(args) -> int:
    from backport.probeenv import ensure_env
    from backport.probing import run_harness
    from backport.tree import open_tree

    python = str(ensure_env(args.python))
    documents = []
    for target in args.trees:
        tree = open_tree(Path(target))
        documents.append(run_harness(python, tree.package_root, args.probe or None))
    unsafe = [(d["tree"], c["probe"], c["case"]) for d in documents for c in d["cases"]
              if c["verdict"] in ("unsafe", "error")]
    lines = []
    for d in documents:
        lines.append(f"{d['tree']} (sglang {d['version']})")
        lines += [f"  {c['verdict']:14} {c['probe']}/{c['case']}" + (" [must-preserve]" if c["must_preserve"] else "")
                  for c in d["cases"]]
    _emit(args, {"trees": documents}, "\n".join(lines))
    return 1 if unsafe else 0


# ---- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-backport", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sglang-backport {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch", help="materialise a target into the cache")
    p.add_argument("spec", help="sglang==X | git+URL@SHA | PATH | installed")
    _target_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fetch)

    p = sub.add_parser("status", help="which fixes a tree has, by fingerprint")
    p.add_argument("target", help="a spec or a path")
    _target_args(p)
    p.add_argument("--series", help="patch series directory (default: the pack shipped with the toolkit)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("apply", help="apply the series for the tree's version")
    p.add_argument("target", help="a spec (worked on in a fresh clone) or a git checkout (in place)")
    _target_args(p)
    p.add_argument("--series")
    p.add_argument("--only", action="append", metavar="FIX", help="apply only this fix (repeatable)")
    p.add_argument("--check", action="store_true", help="compute the whole report, change nothing")
    p.add_argument("--out", help="where the fresh clone of a spec's tree goes")
    p.add_argument("--allow-dirty", action="store_true",
                   help="patch a checkout with uncommitted changes (files with changes are never touched)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("env", help="build (once) and print the CPU probe environment")
    p.add_argument("--python", help="use this interpreter instead of the cached environment")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("probe", help="run the differential probes on each tree")
    p.add_argument("trees", nargs="+", metavar="TREE")
    p.add_argument("--probe", action="append", help="run only this probe (repeatable)")
    p.add_argument("--python", help="probe interpreter (default: the cached probe environment)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_probe)

    for module in ("backport.cli_run", "backport.cli_upstream"):
        try:
            __import__(module, fromlist=["register"]).register(sub)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"sglang-backport: error: {exc}", file=sys.stderr)
        return 2
    except Finding as exc:
        print(f"sglang-backport: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
