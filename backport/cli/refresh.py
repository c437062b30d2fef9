"""Subcommand `refresh`: quilt's refresh of a fix's variant for a new release (backport/refresh.py)."""

from __future__ import annotations

from pathlib import Path

from backport.cli import emit
from backport.cli.trees import load_series


def cmd_refresh(args) -> int:
    from backport.refresh import CONFLICTED, SERVED, WIDENED, continue_refresh, refresh

    pack = load_series(args)
    if args.continue_tree:
        result = continue_refresh(pack, args.fix, args.release, Path(args.continue_tree))
    else:
        result = refresh(
            pack,
            args.fix,
            args.release,
            work_dir=Path(args.work_dir) if args.work_dir else None,
            check=args.check,
        )
    lines = [f"{result.fix} for sglang {result.release} from {result.from_variant}: {result.status}"]
    lines += [f"  {h.file}:{h.line}: {h.status} offset={h.offset} fuzz={h.fuzz} {h.reason}".rstrip()
              for h in result.hunks]
    series = f" --series {args.series}" if args.series else ""
    if result.status == CONFLICTED and result.path:
        lines += [f"work tree: {result.path}",
                  ("carry each .rej into its file, delete the .rej files, commit, then run `sglang-backport "
                   f"refresh {result.fix} --release {result.release}{series} --continue {result.path}`")]
    elif result.status == WIDENED:
        lines.append(f"widened {result.path}: Applies-To is now {result.applies_to} (no file forked)")
    elif result.status == SERVED:
        lines.append(f"{result.from_variant} (Applies-To: {result.applies_to}) already serves "
                     f"{result.release} without fuzz: nothing written")
    elif result.path:
        lines.append(f"wrote {result.path} (Applies-To: {result.applies_to})")
        if result.narrowed:
            lines.append(f"{result.from_variant}: Applies-To is now {result.narrowed}")
    emit(args, result.to_json(), "\n".join(lines))
    return 1 if result.status == CONFLICTED else 0


def register(sub) -> None:
    p = sub.add_parser("refresh", help="regenerate a fix's nearest variant on release X's context")
    p.add_argument("fix", help="the fix id (fixes.toml)")
    p.add_argument("--release", required=True, metavar="X", help="a release pinned in the release matrix")
    p.add_argument("--series", help="patch series directory (default: the pack shipped with the toolkit)")
    p.add_argument("--work-dir", help="where the clone of X's tree goes (default: a new temporary directory)")
    p.add_argument("--check", action="store_true", help="place the nearest variant only; write nothing")
    p.add_argument("--continue", dest="continue_tree", metavar="WORKTREE",
                   help="write the variant from a conflicted refresh's work tree, resolved and committed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_refresh)
