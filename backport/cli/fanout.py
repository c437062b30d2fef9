"""`sglang-backport matrix` (CI fan-out: shards of the release matrix) and `merge` (fan-in).

matrix --json prints `{"include": [{"shard", "specs", "releases"}]}` on one line, the form a
GitHub Actions `strategy.matrix` reads with `fromJSON`; `specs` is the space-separated list a
job hands to `sglang-backport run`. merge DIR... verifies every bundle at or under the given
folders and writes the aggregate OpenVEX document, every attestation line and the summary
table (backport/evidence/merge.py); a bundle that does not verify stops it (exit 1). With
--fail-on finding (the default) a merge whose releases are not all a pass, or that lacks an
--expect'ed release, is written and then exits 1 naming each release and why.
"""

from __future__ import annotations

import json
from pathlib import Path

from backport.errors import Finding


def cmd_matrix(args) -> int:
    from backport.evidence.merge import shards
    from backport.releases import load_releases

    releases = load_releases(Path(args.releases) if args.releases else None)
    include = shards(list(releases), args.shard_size)
    if args.json:
        print(json.dumps({"include": include}, sort_keys=True, separators=(",", ":")))
    else:
        for item in include:
            print(f"{item['shard']}: {item['specs']}")
    return 0


def cmd_merge(args) -> int:
    from backport.evidence.merge import check_out, find_bundles, merge
    from backport.evidence.verify import verify_signed

    check_out(Path(args.out))  # a wrong --out is refused before any bundle is read
    bundles = find_bundles([Path(d) for d in args.dirs])
    failed = [(b, r) for b in bundles if not (r := verify_signed(b)[0]).ok]
    if failed:
        bundle, result = failed[0]
        exc = Finding(f"{bundle}: does not verify ({result.first}); nothing merged")
        exc.document = {
            "merged": None,
            # a result that does not verify has a first problem
            "failed": [{"bundle": str(b), "first": r.first and r.first.to_json()} for b, r in failed],
        }
        raise exc
    summary = merge(bundles, Path(args.out), expected=args.expect)
    failing = args.fail_on == "finding" and summary["failed"]
    if args.json and not failing:
        print(json.dumps(summary, indent=2, sort_keys=True))
    elif not args.json:
        print((Path(args.out) / "summary.md").read_text(), end="")
        print(
            f"merged {summary['bundles']} bundles into {args.out}: {summary['vex_statements']} VEX "
            "statements, "
            f"{summary['attestations']} attestations"
        )
    if failing:
        exc = Finding(f"{len(summary['failed'])} release(s) not a pass: "
                      + "; ".join(f"{f['release']} {f['result']} ({f['why']})" for f in summary["failed"]))
        exc.document = summary if args.json else None  # with --json the summary is the one document printed
        raise exc
    return 0


def register(sub) -> None:
    p = sub.add_parser("matrix", help="CI fan-out: the pinned releases in shards, as a GitHub Actions matrix")
    p.add_argument("--shard-size", type=int, default=4, metavar="K", help="releases per job (default 4)")
    p.add_argument("--releases", metavar="TOML", help="the release matrix (default: the one in force)")
    p.add_argument("--json", action="store_true", help='print {"include": [{"shard", "specs", "releases"}]}')
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser(
        "merge", help="CI fan-in: verify many bundles, write one aggregate VEX, attestations, summary"
    )
    p.add_argument(
        "dirs", nargs="+", metavar="DIR", help="bundles, or folders holding bundles (CI artifacts)"
    )
    p.add_argument(
        "--out", default="merged", metavar="DIR", help="where the merged files go (default ./merged)"
    )
    p.add_argument("--expect", action="extend", nargs="+", metavar="SPEC", default=[],
                   help="the specs that must each have a bundle (e.g. every spec of `matrix --json`); one "
                        "without is a `missing` row and counts as a finding")
    p.add_argument("--fail-on", choices=("finding", "never"), default="finding",
                   help="finding (default): exit 1 after writing the merge when any release is not a pass "
                        "or expected and missing, naming each and why; never: exit 0 whatever the results")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_merge)
