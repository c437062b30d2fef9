"""`sglang-backport live TREE...`: the live tier, a real PD deployment per tree and the incident's scenarios.

Exit 0 when every scenario is safe or not applicable on every tree, 1 when one is unsafe or
error (or a server does not come up: one line with its log's tail), 2 for bad input. With
--serve TREE: one pair kept up, its router URL printed, everything stopped on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from backport import cache
from backport.cli import emit
from backport.errors import BadInput, Finding, Interrupted
from backport.vocab import TreeVerdict

WATCH_SECONDS = 1.0

FINDINGS = (TreeVerdict.UNSAFE, TreeVerdict.ERROR)


def render(documents: list[dict]) -> str:
    lines = []
    for doc in documents:
        lines.append(f"{doc['tree']} (sglang {doc['version']}, serving after {doc['startup_seconds']:.0f} s)")
        for s in doc["scenarios"]:
            star = " [must-preserve]" if s["must_preserve"] else ""
            lines.append(f"  {s['verdict']:14} {s['scenario']}{star}: {s['observed']}")
    return "\n".join(lines)


def cmd_live(args) -> int:
    from backport.live import ensure_model, ensure_serving_env, run_live
    from backport.tree import open_tree

    if args.serve and len(args.trees) != 1:
        raise BadInput(f"live --serve keeps one pair up: give one TREE, not {len(args.trees)}")
    trees = [open_tree(Path(target)) for target in args.trees]  # bad input first, before anything starts
    if args.serve:
        return serve(args, trees[0])
    env = ensure_serving_env(args.python)
    model = ensure_model(env.python)
    results = run_live(env, model, [(str(t.path), Path(t.package_root), t.version) for t in trees],
                       keep_logs=Path(args.logs) if args.logs else None)
    documents = [result.to_json() for result in results]
    emit(args, {"trees": documents}, render(documents))
    return 1 if any(s["verdict"] in FINDINGS for d in documents for s in d["scenarios"]) else 0


def serve(args, tree) -> int:
    """One pair of `tree` up until Ctrl-C or SIGTERM (the pair's Processes stop everything on
    leaving, and the reaper covers a SIGKILL); exit 1 when a server dies meanwhile."""
    from backport.live import ensure_model, ensure_serving_env
    from backport.live.deployment import deployed
    from backport.live.servers import sigterm_raises

    env = ensure_serving_env(args.python)
    model = ensure_model(env.python)
    logs = Path(args.logs) if args.logs else None
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="live-serve-", dir=cache.work_root()) as tmp:
        try:
            with deployed(env, Path(tree.package_root), tree.version, model, logs or Path(tmp)) as dep:
                servers = (dep.prefill, dep.decode, dep.router)
                if args.json:
                    print(
                        json.dumps(
                            {
                                "router": dep.router_url,
                                "tree": str(tree.path),
                                "version": tree.version,
                                "prefill": dep.prefill.url,
                                "decode": dep.decode.url,
                                "startup_seconds": round(dep.startup_seconds, 1),
                            },
                            sort_keys=True,
                        )
                    )
                else:
                    print(dep.router_url)
                sys.stdout.flush()
                while all(s.alive() for s in servers):
                    time.sleep(WATCH_SECONDS)
                dead = next(s for s in servers if not s.alive())
                raise Finding(f"live --serve: {dead.name} exited with {dead.process.returncode}; "
                              "the pair is stopped")
        except (KeyboardInterrupt, Interrupted):  # Ctrl-C or SIGTERM: how --serve ends, after a clean stop
            print("sglang-backport: live --serve stopped; every server it started is ended", file=sys.stderr)
            return 0


def register(sub) -> None:
    p = sub.add_parser("live", help="the live tier: a real PD pair per tree (prefill, decode, router), the "
                                    "incident's scenarios", description=__doc__.split("\n\n")[1])
    p.add_argument("trees", nargs="+", metavar="TREE")
    p.add_argument("--serve", action="store_true",
                   help="keep one pair of the one TREE up and print its router URL (for audit --live URL); "
                        "Ctrl-C or SIGTERM stops it")
    p.add_argument("--python", help="serving interpreter (default: the cached probe environment)")
    p.add_argument("--logs", metavar="DIR", help="keep the servers' logs in DIR (default: removed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_live)
