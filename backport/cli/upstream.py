"""`sglang-backport upstream-tests`: upstream SGLang's own CPU unit tests against trees.

The handler raises BadInput (exit 2) or Finding (exit 1, carrying the JSON document) and
the main turns them into exit codes; progress goes to the `backport.upstream` logger.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from backport.errors import BadInput, Finding

if TYPE_CHECKING:  # imported by the handler: the package pulls requests and git, which --help need not pay
    from backport import upstream

# What --help says the default is; test_startup holds them to backport.upstream's own constants.
BASE_URL_ENV = "SGLANG_BACKPORT_UPSTREAM_URL"
DEFAULT_BASE_URL = "https://raw.githubusercontent.com/sgl-project/sglang"

log = logging.getLogger("backport.upstream")


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "upstream-tests",
        help="run upstream SGLang's own CPU unit tests for the fixes against each tree",
        description=(
            "Obtain the upstream test files patches/fixes.toml lists for each fix, at their "
            "revision (from an upstream checkout, the cache, or {base_url}/{rev}/{path}), and run "
            "them with pytest in the probe environment against each tree. Outcomes: passed, "
            "failed (also: the tree lacks a name a fix adds or fingerprints), error, skipped, "
            "incompatible (the tree lacks a name the test needs that no fix adds), stale-test (the "
            "failure is in the test's own stand-ins, types.SimpleNamespace doubles included, or a "
            "signature the release predates; never a pass), unavailable (the file was not fetched: "
            "why), refused (its bytes do not match the pin in fixes.toml: never run). Each file runs "
            "on its own: one unavailable or refused file does not stop the others. Exit 1 when any "
            "test failed or errored, or any file was refused; exit 0 with a skipped section when no "
            "file could be fetched. A file fixes.toml pins (sha256 beside rev) is checked against its "
            "pin on every download and cache hit, whichever server served it; an unpinned file is "
            "reported as unpinned and trusted only from the server that served it. --print-pins "
            "measures the pins."),
    )
    parser.add_argument("trees", nargs="*", metavar="TREE",
                        help="a package root containing sglang/, or an upstream checkout (python/sglang/); "
                             "at least one unless --print-pins")
    parser.add_argument("--fix", action="append", metavar="FIX",
                        help="only this fix's test files (repeatable; default: every fix)")
    parser.add_argument("--rev", metavar="SHA", help="take every test file at this upstream commit instead")
    parser.add_argument(
        "--test",
        action="append",
        metavar="PATH",
        help="an upstream test file path to run instead of fixes.toml's (needs --rev; repeatable)",
    )
    parser.add_argument("--base-url", metavar="URL",
                        help=f"raw-file base URL (default ${BASE_URL_ENV} or {DEFAULT_BASE_URL})")
    parser.add_argument(
        "--python", metavar="EXE", help="probe interpreter (default: the cached probe environment)"
    )
    parser.add_argument(
        "--series", metavar="DIR", type=Path, help="the patch pack directory (default: patches/)"
    )
    parser.add_argument(
        "--print-pins",
        action="store_true",
        help="download each listed test file from the base URL (never the cache), and print its "
        "sha256 as the upstream_tests lines of fixes.toml; runs no test and changes no file",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.set_defaults(func=handle)
    return parser


def _refs(args) -> list[upstream.TestRef]:
    from backport import upstream

    if args.test:
        if not args.rev:
            raise BadInput("--test needs --rev (the upstream commit to take the file from)")
        refs = upstream.ad_hoc_refs(args.series, args.test, args.rev)
    else:
        refs = upstream.load_refs(args.series, args.fix, args.rev)
    for ref in refs:
        problem = upstream.check_ref(ref)
        if problem:
            raise BadInput(problem)
    return refs


def render(document: dict) -> str:
    from backport import upstream

    if document["skipped"]:
        return f"upstream tests skipped: {document['skipped']}\n"
    lines: list[str] = []
    labels = [t["tree"] for t in document["trees"]]
    table: dict[str, dict[str, dict]] = {}
    for tree in document["trees"]:
        for test in tree["tests"]:
            table.setdefault(test["nodeid"], {})[tree["tree"]] = test
    for nodeid, per_tree in table.items():
        lines.append(nodeid)
        for label in labels:
            test = per_tree.get(label)
            if test is None:
                whole = table.get(nodeid.split("::", 1)[0], {}).get(label)
                lines.append(
                    f"  {label}: (whole file: {whole['outcome']})" if whole else f"  {label}: (not run)"
                )
                continue
            reason = f"  ({test['reason']})" if test["reason"] else ""
            lines.append(f"  {label}: {test['outcome']}{reason}")
    for f in document.get("files") or []:
        where = f"{f['path']}@{f['rev'][:12]}"
        if f.get("refused"):
            lines.append(f"{where}: refused: {f['refused']}")
        elif f.get("unavailable"):
            lines.append(f"{where}: unavailable: {f['unavailable']}")
        elif f.get("sha256"):
            status = ("pinned: matches fixes.toml" if f.get("pinned")
                      else f"unpinned, from {f['source']}")
            lines.append(f"{where}: sha256 {f['sha256']} ({status})")
    for tree in document["trees"]:
        counts: dict[str, int] = {}
        for test in tree["tests"]:
            counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
        summary = ", ".join(f"{counts[o]} {o}" for o in upstream.OUTCOMES if o in counts) or "no tests"
        sub: dict[str, int] = {}
        for per_file in (tree.get("subtests") or {}).values():
            for outcome, n in per_file.items():
                sub[outcome] = sub.get(outcome, 0) + n
        if sub:
            summary += "; subtests: " + ", ".join(f"{n} {o}" for o, n in sorted(sub.items()))
        lines.append(f"{tree['tree']}: {summary}")
    return "\n".join(lines) + "\n"


def print_pins(args, roots: list[tuple[str, Path]], refs: list[upstream.TestRef], base_url: str) -> int:
    """`--print-pins`: each file's sha256 as served now, as toml lines to paste into fixes.toml."""
    from backport import upstream

    measured = upstream.measure_pins(roots, refs, base_url=base_url)
    bad = [m.error or m.refused or m.unavailable for m in measured if m.error or m.refused or m.unavailable]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise BadInput(f"--print-pins: {bad[0]}{more}")
    pins = [{"fix": m.ref.fix, "path": m.ref.path, "rev": m.ref.rev, "sha256": m.sha256, "source": m.source,
             "pinned": m.ref.sha256} for m in measured]
    if args.json:
        print(json.dumps({"pins": pins}, indent=2, sort_keys=True))
        return 0
    fix = object()
    for pin in pins:
        if pin["fix"] != fix:
            fix = pin["fix"]
            print(f"# {fix or 'ad-hoc --test'}: upstream_tests = [")
        print(f'    {{ path = "{pin["path"]}", rev = "{pin["rev"]}", sha256 = "{pin["sha256"]}" }},'
              f"  # from {pin['source']}")
    return 0


def handle(args) -> int:
    from backport import upstream
    from backport.probing import ensure_env
    from backport.tree import package_root_of

    if not args.trees and not args.print_pins:
        raise BadInput("upstream-tests needs at least one TREE (or --print-pins)")
    roots = [(spec, package_root_of(spec)) for spec in args.trees]
    refs = _refs(args)
    if args.print_pins:
        return print_pins(args, roots, refs, upstream.resolve_base_url(args.base_url))
    base_url = upstream.resolve_base_url(args.base_url)
    python = str(ensure_env(args.python))
    # A file that cannot be fetched or is refused is that file's outcome; the others still run.
    fetched = upstream.fetch_refs(roots, refs, base_url=base_url)
    document = upstream.run_upstream_tests(roots, refs, python=python, base_url=base_url, fetched=fetched)
    text = json.dumps(document, indent=2, sort_keys=True) if args.json else render(document).rstrip("\n")
    if document["skipped"]:
        print(text)
        log.warning("upstream-tests: section skipped: %s", document["skipped"])
        return 0
    failing = [(t["tree"], x["nodeid"]) for t in document["trees"] for x in t["tests"]
               if x["outcome"] in ("failed", "error", "refused")]
    if failing:
        finding = Finding(f"{len(failing)} upstream test result(s) failed, errored or were refused "
                          f"(first: {failing[0][1]} on {failing[0][0]})")
        if args.json:
            finding.document = document  # the main prints it as the one JSON document
        else:
            print(text)
        raise finding
    print(text)
    return 0
