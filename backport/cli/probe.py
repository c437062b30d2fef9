"""Subcommands about probing: `env` (the CPU probe environment) and `probe` (per-case verdicts)."""

from __future__ import annotations

from pathlib import Path

from backport import resources
from backport.cli import emit
from backport.errors import BadInput
from backport.vocab import TreeVerdict


def cmd_env(args) -> int:
    from backport.probing import ensure_env

    python = ensure_env(args.python)
    emit(args, {"python": str(python)}, str(python))
    return 0


def cmd_probe(args) -> int:
    from backport.probing import ensure_env, run_harness
    from backport.tree import open_tree

    # Bad input is refused before the probe environment is built.
    trees = [open_tree(Path(target)) for target in args.trees]
    cases_dir = resources.probes_dir() / "cases"
    for name in args.probe or ():
        # a probe is a module of probes/cases/, or a package of scenario modules (probes/cases/prefill_drain/)
        found = (cases_dir / f"{name}.py").is_file() or (cases_dir / name / "__init__.py").is_file()
        if name.startswith("_") or not found:
            raise BadInput(f"--probe {name}: no such probe in {cases_dir}")
    python = str(ensure_env(args.python))
    documents = [
        run_harness(python, tree.package_root, args.probe or None, version=tree.version) for tree in trees
    ]
    unsafe = [(d["tree"], c["probe"], c["case"]) for d in documents for c in d["cases"]
              if c["verdict"] in (TreeVerdict.UNSAFE, TreeVerdict.ERROR)]
    lines = []
    for d in documents:
        lines.append(f"{d['tree']} (sglang {d['version']})")
        lines += [
            f"  {c['verdict']:14} {c['probe']}/{c['case']}"
            + (" [must-preserve]" if c["must_preserve"] else "")
            for c in d["cases"]
        ]
    emit(args, {"trees": documents}, "\n".join(lines))
    return 1 if unsafe else 0


def register(sub) -> None:
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
