"""`sglang-backport run` (the main job, `backport.job.run`); `verify` is backport/cli/verify.py.

run SPEC: fetch the target, apply the pack on a fresh clone, probe the pristine tree, the
patched tree and the reference (upstream's first pinned release that has every fix), run
upstream's own unit tests for the fixes, and write an evidence bundle. Exit 0 when no case
regressed or errored and every case outside the must-preserve set is fixed or held (or not
applicable); 1 otherwise; 2 for bad input. A release the pack cannot serve (a fix with no
variant for it) is said in one line to stay exposed; its pristine tree alone is probed and the
bundle shows the exposure (exit 1). A variant that does not place writes no bundle (exit 1).

With --head SPEC the pack is not applied: SPEC is the base and the head is another tree
(upstream's own before/after commits of a fix, `patches/pairs.toml`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from backport.errors import BadInput

if TYPE_CHECKING:  # the evidence package (jsonschema, cyclonedx) is imported where a run needs it
    from backport.evidence import Bundle


def render_summary(bundle: Bundle, written: Path, previous: Path | None = None) -> str:
    from backport import evidence
    from backport.evidence.scope import covers_line, receipt_apply, reference_comparison

    p = bundle.statement["predicate"]
    roles = [r for r in evidence.ROLES if r in p["probes"]]
    exposure = (
        [evidence.exposure_line(p["inputs"]["target"]["version"], receipt_apply(p))]
        if p["mode"] == "exposure"
        else []
    )
    lines = exposure + [f"{'case':58} " + " ".join(f"{r:14}" for r in roles) + " pair"]
    for row in p["cases"]:
        name = f"{row['probe']}/{row['case']}" + (" *" if row["must_preserve"] else "")
        mark = "  <- finding" if evidence.is_finding(row["pair"], row["must_preserve"]) else ""
        lines.append(f"{name:58} " + " ".join(f"{row['verdicts'].get(r) or '-':14}" for r in roles)
                     + f" {row['pair']}{mark}")
    for row in (p.get("live") or {}).get("scenarios", []):
        name = f"live/{row['scenario']}" + (" *" if row["must_preserve"] else "")
        mark = "  <- finding" if evidence.is_finding(row["pair"], row["must_preserve"]) else ""
        lines.append(f"{name:58} " + " ".join(f"{row['verdicts'].get(r) or '-':14}" for r in roles)
                     + f" {row['pair']}{mark}")
    s = p["summary"]
    counts = ", ".join(f"{n} {v}" for v, n in s["pair_verdicts"].items() if n)
    lines.append(f"\n{s['result'].upper()}: {s['cases']} cases ({counts}); {reference_comparison(p)}")
    lines.append(f"bundle: {written}  (check: sglang-backport verify {written})")
    if previous is not None:
        lines.append(f"previous bundle kept whole (it held files this run does not rewrite): {previous}")
    export = p.get("export")
    if export:
        lines.append(
            f"exported: {written / export['wheel']['file']} (version {export['wheel']['version']}) and "
            f"{len(export['patches'])} patches in {written / 'export' / 'patches'}"
        )
    lines.append(covers_line(p))  # last: what the result rests on, and what it does not judge
    return "\n".join(lines)


def vuln_aliases(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`--vuln-alias CLASS=ID` pairs, checked against the shipped pack's classes before anything runs."""
    from backport import resources
    from backport.evidence.vulnerabilities import add_aliases, load_classes

    pairs = []
    for value in values or []:
        key, sep, alias = value.partition("=")
        if not sep or not key or not alias:
            raise BadInput(f"--vuln-alias {value!r}: expected CLASS=ID (e.g. SBP-2026-0001=CVE-2026-12345)")
        pairs.append((key, alias))
    if pairs:
        grouped: dict[str, list[str]] = {}
        for key, alias in pairs:
            grouped.setdefault(key, []).append(alias)
        add_aliases(load_classes(resources.pack_dir()), grouped)
    return tuple(pairs)


def options_from(args) -> list:
    """One RunOptions per spec; with several specs --out is the folder their bundles go in."""
    from backport.job import RunOptions

    several = len(args.spec) > 1
    if several and args.head:
        raise BadInput("--head compares two given trees: give one SPEC with it")
    out = Path(args.out) if args.out else None
    return [RunOptions(spec=spec, out=None if several else out, reference=args.reference, head=args.head,
                       series=Path(args.series) if args.series else None, python=args.python,
                       allow_unpinned=args.allow_unpinned, upstream_base_url=args.upstream_base_url,
                       upstream_tests=not args.no_upstream_tests, keep_trees=args.keep_trees,
                       bundle_root=out if several else None, min_coverage=args.min_coverage,
                       export=args.export, force=args.force, vuln_aliases=vuln_aliases(args.vuln_alias),
                       live=args.live, version=args.version)
            for spec in args.spec]


def _document(outcome) -> dict:
    from backport import evidence
    from backport.evidence.scope import receipt_apply

    p = outcome.bundle.statement["predicate"]
    return {
        "bundle": str(outcome.written),
        "result": outcome.summary["result"],
        "exit_code": outcome.exit_code,
        "mode": p["mode"],
        "exposure": evidence.exposure_line(p["inputs"]["target"]["version"], receipt_apply(p))
        if p["mode"] == "exposure"
        else None,
        "receipt_sha256": outcome.receipt_sha256,
        "summary": outcome.summary,
        "subject": outcome.bundle.statement["subject"],
        "previous_bundle": None if outcome.previous is None else str(outcome.previous),
    }


def cmd_run(args) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise BadInput(f"--jobs {args.jobs}: must be 1 or more")
    from backport.job import SeriesDoesNotApply, run_many  # after the checks that need none of it

    try:
        outcomes = run_many(options_from(args), jobs=args.jobs)
    except SeriesDoesNotApply as exc:
        exc.document = {"result": "apply-failed", "bundle": None, "apply": exc.report.to_json()}
        raise
    code = max(outcome.exit_code for outcome in outcomes)
    if args.json:
        document = (
            _document(outcomes[0])
            if len(outcomes) == 1
            else {
                "exit_code": code,
                "runs": [{"spec": spec, **_document(o)} for spec, o in zip(args.spec, outcomes)],
            }
        )
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print("\n\n".join(render_summary(o.bundle, o.written, o.previous) for o in outcomes))
    return code


def register(sub) -> None:
    p = sub.add_parser(
        "run",
        help="the main job: fetch, apply, probe pristine/patched/reference, write a bundle",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("spec", nargs="+", help="sglang==X | git+URL@SHA | PATH | installed (several: one bundle "
                                           "each, every tree probed in one probe matrix)")
    p.add_argument(
        "--out",
        help="bundle directory (default: evidence/<target>/ under the current directory); "
        "with several SPECs the folder that holds their bundles",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="--out may hold an evidence bundle already: replace it (a bundle holding anything the "
        "toolkit did not write, a signature or notes, is moved aside whole and the new path "
        "printed); a directory that is not a bundle is never written into",
    )
    p.add_argument("--jobs", type=int, metavar="N", help="trees probed at once (default: the core count)")
    p.add_argument("--min-coverage", type=float, metavar="PCT",
                   help="make it a finding (exit 1) when fewer than PCT%% of the executable lines the pack "
                        "adds ran under a probe case")
    p.add_argument("--reference", metavar="SPEC",
                   help="the upstream-fixed tree to compare with, or 'none' (default: the first pinned "
                        "release whose version is in every fix's fixed_in)")
    p.add_argument(
        "--head",
        metavar="SPEC",
        help="probe this tree as the head instead of applying the pack (upstream before/after pairs)",
    )
    p.add_argument("--series", help="patch series directory (default: the pack shipped with the toolkit)")
    p.add_argument("--python", metavar="EXE",
                   help="probe interpreter (default: the cached probe environment); for the 'installed' spec "
                        "also the interpreter whose sglang is taken")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="fetch a sglang==X that patches/releases.toml does not pin (recorded as unpinned)")
    p.add_argument(
        "--version",
        metavar="X",
        help="the release of a checkout, directory or git target when its tag and version file say "
        "none, or disagree (a wheel's version is its own)",
    )
    p.add_argument("--upstream-base-url", metavar="URL", help="raw-file base URL for upstream's test files")
    p.add_argument("--no-upstream-tests", action="store_true", help="do not run upstream's unit tests")
    p.add_argument("--keep-trees", action="store_true", help="keep the patched work tree (path on stderr)")
    p.add_argument(
        "--export",
        action="store_true",
        help="put the patched wheel (export/sglang-X+backport.N-<tags>.whl) and the git format-patch "
        "series (export/patches/) in the bundle, as its subjects (sglang==X targets)",
    )
    p.add_argument("--vuln-alias", action="append", metavar="CLASS=ID",
                   help="name a CVE or GHSA id for a vulnerability class (its SBP-... id or name, "
                        "patches/vulnerabilities.toml) in the bundle's VEX documents; repeatable")
    p.add_argument("--live", action="store_true",
                   help="also run the live tier: a real PD deployment (prefill, decode, smg router, Mooncake "
                        "over TCP) per tree on loopback, the incident's scenarios (live/<role>.json)")
    p.add_argument("--json", action="store_true", help="print one JSON document (summary and bundle path)")
    p.set_defaults(func=cmd_run)
