"""`sglang-backport audit [--python EXE | TREE] [--server URL ...] [--report FILE] [--json]`.

Exit codes: 0 when every gate is `pass` or `warn`, 1 when any gate fails or is `unknown` (not
verified is never a pass; `--allow-unknown` lets unknown gates exit 0), 2 for bad input (one line, or with
--json one document `{"error": {"code": 2, "message": ...}}`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from backport.errors import BadInput

API_KEY_ENV = "SGLANG_BACKPORT_API_KEY"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "audit", help="the four operator gates for a running PD deployment",
        description=("Check an SGLang deployment against the four gates of the incident analysis: "
                     "1 pool versus context (each server's /server_info), 2 rejection at admission "
                     "(the code, by fingerprint and by the admission and prefill-retirement probes), "
                     "3 transfer covers read (the handoff checksum on both sides), 4 page lifetime "
                     "(the fixes, deferred release, the backend's capability, the timeout, both sides). "
                     "Exit 1 when any gate fails or is unknown (not verified), unless --allow-unknown."))
    p.add_argument("tree", nargs="?", metavar="TREE",
                   help="an SGLang tree the servers run (checkout or unpacked release)")
    p.add_argument("--python", metavar="EXE",
                   help="the interpreter of the serving environment; its sglang package is audited")
    p.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="a server's base URL, e.g. http://prefill-0:30000 (repeat for every node of the pair)",
    )
    p.add_argument(
        "--live",
        metavar="URL",
        help="also send gates 1 and 2's negative case (a prompt within the context, above the prefill "
        "pool) to this router, --live-count times (it sends traffic)",
    )
    p.add_argument(
        "--live-count", type=int, default=3, metavar="N", help="negative requests to send (1-10, default 3)"
    )
    p.add_argument("--report", metavar="FILE", help="write the Markdown report here")
    p.add_argument(
        "--series", metavar="DIR", help="patch pack directory (default: the pack shipped with the toolkit)"
    )
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds per HTTP request, the whole answer included (default 10)")
    p.add_argument("--total-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="seconds for all HTTP requests of the audit together (default 120)")
    p.add_argument("--max-prompt-tokens", type=int, default=1_048_576, metavar="N",
                   help="the longest prompt --live may build (default 1,048,576, the incident's context); a "
                        "deployment whose prefill pool is larger is left unknown until this is raised")
    p.add_argument("--api-key", metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' to every server and the router (default: the "
                        f"environment variable {API_KEY_ENV}, if set)")
    p.add_argument("--allow-unknown", action="store_true",
                   help="exit 0 when no gate fails even if some are unknown (not verified: no server given, "
                        "unreadable); by default an unknown gate exits 1")
    p.add_argument(
        "--launch-flags",
        metavar="FLAGS",
        help="the servers' launch flags as one argument, joined with '=' since they start with "
        "'--' (e.g. --launch-flags='--disaggregation-mode prefill --host 0.0.0.0 "
        "--enable-custom-logit-processor'): the advisories table reads them when no --server was read",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=cmd_audit)
    return p


def _pack(series: str | None):
    from backport.pack import load_pack

    if series:
        root = Path(series)
    else:
        try:
            from backport.resources import pack_dir
        except ImportError:  # older layout

            def pack_dir() -> Path:
                return Path(__file__).resolve().parents[2] / "patches"
        root = pack_dir()
    if not root.is_dir():
        raise BadInput(f"{root}: no such patch series directory")
    return load_pack(root)


def _audit(args) -> tuple[int, dict, str]:
    from backport.audit import advisories, gates, remedies, report
    from backport.audit.code import inspect_code
    from backport.audit.fetch import Limits
    from backport.audit.servers import check_url, fetch_servers

    if args.tree and args.python:
        raise BadInput("audit: give either --python EXE or a TREE, not both")
    if not (args.tree or args.python or args.server or args.live):
        raise BadInput("audit: nothing to audit: give --server URL and/or --python EXE or a TREE")
    for flag, value in (("--timeout", args.timeout), ("--total-timeout", args.total_timeout),
                        ("--max-prompt-tokens", args.max_prompt_tokens)):
        if not value > 0:
            raise BadInput(f"{flag} {value}: must be positive")
    urls = [check_url(u) for u in args.server]
    if args.live is not None:
        check_url(args.live, "--live")
        if not 1 <= args.live_count <= 10:
            raise BadInput(f"--live-count {args.live_count}: must be 1 to 10")
    if len(set(urls)) != len(urls):
        raise BadInput("--server: the same URL is given twice")
    if args.report and not Path(args.report).resolve().parent.is_dir():
        raise BadInput(f"--report {args.report}: its directory does not exist")
    if args.tree and not Path(args.tree).is_dir():
        raise BadInput(f"{args.tree}: not a directory")
    launch = advisories.parse_launch_flags(args.launch_flags) if args.launch_flags is not None else None
    pack = _pack(args.series)
    # the code first: its probes take minutes, and --total-timeout bounds the network alone
    code = inspect_code(pack, tree=args.tree, python=args.python) if (args.tree or args.python) else None
    limits = Limits(args.timeout, args.total_timeout, args.api_key or os.environ.get(API_KEY_ENV) or None)
    servers = fetch_servers(urls, limits)
    results = gates.evaluate(code, servers, pack)
    if args.live is not None:
        from backport.audit.live import apply_live

        results = apply_live(results, args.live, count=args.live_count, limits=limits,
                             max_prompt=args.max_prompt_tokens)
    results = remedies.attach(results, code, servers, args)
    # what else is open on this release: information beside the gates, never part of the exit code
    table = advisories.rows(pack, code, servers, launch)
    if args.report:
        Path(args.report).write_text(report.markdown(results, code, servers, table))
    allow = args.allow_unknown
    return (report.exit_code(results, allow_unknown=allow),
            report.to_json(results, code, servers, allow_unknown=allow, advisories=table),
            report.terminal(results, servers, table))


def cmd_audit(args) -> int:
    # BadInput propagates: the CLI's main turns it into exit 2 and one line (one JSON document
    # `{"error": {"code": 2, "message": ...}}` with --json).
    code, document, human = _audit(args)
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(human)
    if args.report:
        print(f"report: {args.report}", file=sys.stderr)
    return code
