"""A probe run against the bare import of the same SGLang modules, in the same interpreter.

Importing SGLang's disaggregation and scheduler modules dominates a probe run (~8 s on a CPU);
the probes themselves should add little on top. For one tree this runs, alternately and
`--repeat` times each, (a) a fresh interpreter that only imports the harness's modules and
(b) a fresh interpreter that runs every probe (the harness, through `probes/runtime/launch.py`), both as the
toolkit runs them (same PYTHONPATH, same environment), and prints the median wall times and
their ratio. Goal: at most 1.5x. It also times (c) the probe run with `--coverage` over every
file the pack touches, as `run` does, against (b). Goal: at most 1.3x.

    python benchmarks/bench_probe.py [SPEC] [--repeat N]     (default sglang==0.5.19, 3 repeats)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time


def timed(cmd: list[str], env: dict[str, str], cwd: str) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} failed:\n{proc.stderr[-2000:]}")
    return elapsed


def main() -> int:
    from backport.pack import load_pack
    from backport.probing.env import ensure_env
    from backport.probing.harness import launch, probe_environ
    from backport.resources import pack_dir
    from backport.sources import materialise
    from probes.runtime.harness import CORE_MODULES

    parser = argparse.ArgumentParser()
    parser.add_argument("spec", nargs="?", default="sglang==0.5.19")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    python = str(ensure_env())
    tree = materialise(args.spec).tree
    with tempfile.TemporaryDirectory(prefix="bench-probe-") as tmp:
        env = probe_environ(python, tree.package_root)
        # the harness's own module list, imported in the child
        bare = [python, "-c", "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)",
                *CORE_MODULES]
        probe = [*launch(python, "harness"), "--tree", str(tree.package_root)]
        files = sorted({fp.path for variants in load_pack(pack_dir()).variants.values() for v in variants
                        for fp in v.files})
        covered = probe + [a for f in files for a in ("--coverage", f)]
        imports, runs, with_cov = [], [], []
        for _ in range(args.repeat):
            imports.append(timed(bare, env, tmp))
            runs.append(timed(probe, env, tmp))
            with_cov.append(timed(covered, env, tmp))
    bare_s, run_s, cov_s = statistics.median(imports), statistics.median(runs), statistics.median(with_cov)
    ratio = run_s / bare_s
    print(
        f"{args.spec}: bare import {bare_s:.2f} s, full probe run {run_s:.2f} s "
        f"(medians of {args.repeat}); ratio {ratio:.2f}x; goal <= 1.5x: {'met' if ratio <= 1.5 else 'MISSED'}"
    )
    cov_ratio = cov_s / run_s
    print(f"with coverage of {len(files)} patched files: {cov_s:.2f} s; {cov_ratio:.2f}x the probe run; "
          f"goal <= 1.3x: {'met' if cov_ratio <= 1.3 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
