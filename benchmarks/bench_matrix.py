"""The probe matrix against one harness run per tree, and against the floor of one import per tree.

`run` of one release probes three trees (pristine, patched, reference); a matrix of releases
probes every release's pristine and patched tree and the reference once. This measures, in the
same run and on the same cached trees:

  (a) singles: `run_harness` once per tree, one after the other (what N separate `run`s pay);
  (b) matrix:  `run_matrix` over all trees (shared imports once, a forked child per tree);
  (c) floor:   a fresh interpreter per tree that only imports the harness's SGLang modules;
  (d) one run: the three trees of one release through `run_matrix` (what `run SPEC` pays).

and prints (b)/(a), (b)/(c) and (b)/(d). Goal (issue "reach"): the whole matrix, warm, under 3x
the time of one `run` on 2 cores.

    python benchmarks/bench_matrix.py [VERSION ...] [--jobs N] [--matrix-only] [--repeat N]
    (default: every measured release; --repeat: paired runs of (b) and (d) in alternating order)

`--matrix-only` measures (b) and (d) alone: the goal's ratio, without the singles and the floor,
which take about as long again per tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from backport.engine import apply_series
    from backport.pack import load_pack
    from backport.probing import ensure_env, run_harness, run_matrix
    from backport.probing.harness import probe_environ
    from backport.releases import load_releases
    from backport.resources import pack_dir
    from backport.sources import materialise
    from backport.tree import clone_tree
    from probes.runtime.harness import CORE_MODULES

    releases = load_releases()
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="*", default=[v for v, r in releases.items() if r.measured])
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--matrix-only", action="store_true", help="skip the singles and the floor")
    parser.add_argument("--repeat", type=int, default=1, help="paired runs of (b) and (d), medians reported")
    args = parser.parse_args()

    python = str(ensure_env())
    pack = load_pack(pack_dir())
    reference = materialise("sglang==0.5.22").tree.package_root
    roots: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="bench-matrix-") as tmp:
        for version in args.versions:
            pristine = materialise(f"sglang=={version}").tree
            patched = clone_tree(pristine, Path(tmp))
            apply_series(patched.path, pack, version)
            roots += [pristine.package_root, patched.package_root]
        roots.append(reference)
        one_run = roots[:2] + [reference]
        # the clones just written are still being flushed to disk: that writeback would land on
        # whichever side runs first (it doubled the first preload here)
        os.sync()

        matrix_runs, one_runs = [], []
        for r in range(args.repeat):  # paired, in alternating order: neither side always runs first
            for side in ((roots, matrix_runs), (one_run, one_runs))[::1 if r % 2 else -1]:
                started = time.perf_counter()
                run_matrix(python, side[0], jobs=args.jobs)
                side[1].append(time.perf_counter() - started)
        matrix_s, one_s = statistics.median(matrix_runs), statistics.median(one_runs)
        paired = statistics.median(m / o for m, o in zip(matrix_runs, one_runs))

        for m, o in zip(matrix_runs, one_runs):
            print(f"  pair: matrix {m:.1f} s, one run {o:.1f} s ({m / o:.2f}x)")
        if args.matrix_only:
            report(len(roots), len(args.versions), matrix_s, one_s, paired, args.repeat)
            return 0

        started = time.perf_counter()
        for root in roots:
            run_harness(python, root)
        singles_s = time.perf_counter() - started

        floor_s = 0.0
        with tempfile.TemporaryDirectory(prefix="bench-floor-") as scratch:
            bare = [python, "-c", "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)",
                    *CORE_MODULES]
            for root in roots:
                started = time.perf_counter()
                subprocess.run(bare, env=probe_environ(python, root), cwd=scratch, check=True,
                               capture_output=True)
                floor_s += time.perf_counter() - started

    print(f"  singles (one harness run per tree): {singles_s:7.1f} s")
    print(
        f"  floor (one bare import per tree):   {floor_s:7.1f} s   (matrix: {matrix_s / singles_s:.2f}x "
        "singles, "
        f"{matrix_s / floor_s:.2f}x floor)"
    )
    report(len(roots), len(args.versions), matrix_s, one_s, paired, args.repeat)
    return 0


def report(trees: int, releases: int, matrix_s: float, one_s: float, paired: float, repeat: int) -> None:
    print(
        f"{trees} trees ({releases} releases x pristine/patched + the reference); median of {repeat} paired "
        "runs"
    )
    print(f"  matrix (all trees):                 {matrix_s:7.1f} s")
    print(f"  one run (3 trees, matrix):          {one_s:7.1f} s")
    ratio = matrix_s / one_s
    print(f"  whole matrix / one run: {ratio:.2f}x (median of per-pair ratios {paired:.2f}x); "
          f"goal < 3x: {'met' if ratio < 3 else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
