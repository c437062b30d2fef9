"""Probe many trees from one interpreter: heavy imports once, then one forked child per tree.

Usage (run by the toolkit inside the probe environment; no tree on the path)::

    python PACKAGE/runtime/launch.py matrix --jobs 2 --out DIR --tree ROOT1 --tree ROOT2 ...

Importing one release's disaggregation modules costs 8-10 s, two thirds of it in third-party
packages every release shares (torch, transformers, openai, sympy, ...). This process imports
those once, then forks one child per tree. A child puts its tree on `sys.path`, imports that
tree's `sglang` and runs the ordinary harness (`harness.main`), so it sees exactly what a
single harness run sees: no `sglang` module exists before the fork, and the path order (stand-ins,
the tree) is the same. Children run `--jobs` at a time. Each writes
`DIR/<index>.json` (the harness document) and `DIR/<index>.log` (its stderr); the exit status of
this process is 0 when every child ran, 2 on bad input.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from .bytecode import install as install_bytecode_cache
from .generated_code import install as install_generated_code
from .preload import preload
from .source_blocks import install as install_source_blocks


def _child(tree: str, probes: list[str], coverage: list[str], out: str, log: str, bytecode: str | None,
           version: str | None = None) -> None:
    """In the forked child: this tree's path, stdout to the document, stderr to the log."""
    if bytecode:
        install_bytecode_cache(tree, bytecode)
    sys.path.append(tree)  # after the stand-ins, as in a single harness run
    os.environ["PYTHONPATH"] = os.pathsep.join([*os.environ.get("PYTHONPATH", "").split(os.pathsep), tree])
    fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    fd_log = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd_out, 1)
    os.dup2(fd_log, 2)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    from . import harness

    args = (["--tree", tree] + [a for name in probes for a in ("--probe", name)]
            + [a for rel in coverage for a in ("--coverage", rel)]
            + (["--version", version] if version and version != "unknown" else []))
    code = 1
    try:
        code = harness.main(args)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.py matrix")
    parser.add_argument("--tree", action="append", required=True, help="a directory that contains sglang/")
    parser.add_argument("--probe", action="append", default=[], help="probe to run (repeatable)")
    parser.add_argument("--coverage", action="append", default=[], metavar="FILE",
                        help="passed to every child's harness (relative to each tree)")
    parser.add_argument("--version", action="append", default=[],
                        help="each tree's release as the toolkit decided it, in --tree order (optional)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--bytecode", metavar="DIR", help="cache of the trees' compiled modules (probes/runtime/bytecode.py)"
    )
    parser.add_argument("--out", required=True, help="directory for <index>.json and <index>.log")
    args = parser.parse_args(argv)
    if args.jobs < 1 or not os.path.isdir(args.out) or len(args.version) not in (0, len(args.tree)):
        print(json.dumps({"error": "--jobs must be >= 1, --out an existing directory and --version given "
                                   "once per --tree or not at all"}))
        return 2
    versions = args.version or [None] * len(args.tree)
    started = time.monotonic()
    if args.bytecode:
        # the probes package and its stand-ins are compiled once too (the environment writes no
        # __pycache__); every child imports some 40 of their modules after the fork
        install_bytecode_cache(os.path.dirname(os.path.abspath(__file__)), args.bytecode)
    timings = preload()
    if args.bytecode:
        install_source_blocks(
            os.path.join(args.bytecode, "source-blocks")
        )  # triton reads its kernels' source
        install_generated_code(
            os.path.join(args.bytecode, "generated-code")
        )  # dataclasses' methods, ForwardRefs
    # Without this a child's first full collection walks every preloaded object (0.5 s on
    # 0.5.20 and later) and writes to each one's page, which the fork shared.
    gc.freeze()
    preload_seconds = round(time.monotonic() - started, 3)
    sys.stdout.flush()
    sys.stderr.flush()
    running: dict[int, tuple[int, float]] = {}  # pid -> (tree index, when it was forked)
    status: dict[int, int] = {}
    seconds: dict[int, float] = {}
    pending = list(enumerate(args.tree))
    while pending or running:
        while pending and len(running) < args.jobs:
            index, tree = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(
                    os.path.abspath(tree),
                    args.probe,
                    args.coverage,
                    os.path.join(args.out, f"{index}.json"),
                    os.path.join(args.out, f"{index}.log"),
                    args.bytecode,
                    versions[index],
                )
            running[pid] = (index, time.monotonic())
        pid, wait_status = os.wait()
        if pid in running:
            index, forked = running.pop(pid)
            status[index] = os.waitstatus_to_exitcode(wait_status)
            seconds[index] = round(time.monotonic() - forked, 3)
    print(json.dumps({"preload_seconds": preload_seconds, "preloaded": timings,
                      "exit_codes": [status[i] for i in range(len(args.tree))],
                      "seconds": [seconds[i] for i in range(len(args.tree))]}))
    return 0


# launch.py ends this process with os._exit once main returns (every child reaped, the summary written)
FAST_EXIT = True
