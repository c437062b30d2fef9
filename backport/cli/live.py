"""`sglang-backport live TREE...`: the live tier, a real PD deployment per tree and the incident's scenarios.

Exit 0 when every scenario is safe or not applicable on every tree, 1 when one is unsafe or
error (or a server does not come up: one line with its log's tail), 2 for bad input.
"""

from __future__ import annotations

from pathlib import Path

from backport.cli import emit
from backport.tree import open_tree

FINDINGS = ("unsafe", "error")


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

    trees = [open_tree(Path(target)) for target in args.trees]  # bad input first, before anything starts
    env = ensure_serving_env(args.python)
    model = ensure_model(env.python)
    documents = run_live(env, model, [(str(t.path), Path(t.package_root), t.version) for t in trees],
                         keep_logs=Path(args.logs) if args.logs else None)
    emit(args, {"trees": documents}, render(documents))
    return 1 if any(s["verdict"] in FINDINGS for d in documents for s in d["scenarios"]) else 0


def register(sub) -> None:
    p = sub.add_parser("live", help="the live tier: a real PD pair per tree (prefill, decode, router), the "
                                    "incident's scenarios", description=__doc__.split("\n\n")[1])
    p.add_argument("trees", nargs="+", metavar="TREE")
    p.add_argument("--python", help="serving interpreter (default: the cached probe environment)")
    p.add_argument("--logs", metavar="DIR", help="keep the servers' logs in DIR (default: removed)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_live)
