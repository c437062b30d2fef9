"""Start-up CPU of `sglang-backport --help`, `--version` and a bad input, against a floor.

CPU seconds (user + system, from the children's rusage) of each command, median of --repeat
runs, against `python -c pass` measured in the same run with the same interpreter: the part
that is ours is the difference, and the ratio says how much of the start is the toolkit's.
With --before REV the same commands also run on the `backport` package of that commit (taken
with `git archive`, put first on PYTHONPATH), so a row can show before and after. Goal: each
command under 0.3 s of CPU.

    python benchmarks/bench_startup.py [--repeat 9] [--before REV]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOAL_S = 0.3
COMMANDS = {"--help": ["--help"], "--version": ["--version"], "bad input": ["frobnicate"]}
# The console script's body: what `sglang-backport` runs, here importable from any package path.
SCRIPT = "import sys; from backport.cli import main; sys.argv[0] = 'sglang-backport'; sys.exit(main())"


def cpu_seconds(argv: list[str], env: dict[str, str]) -> float:
    """User + system CPU of one child process, run to its end. `-P`: the working directory is not
    put first on sys.path, so the package measured is the installed one or PYTHONPATH's."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([argv[0], "-P", *argv[1:]], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def median_cpu(argv: list[str], env: dict[str, str], repeat: int) -> float:
    return statistics.median(cpu_seconds(argv, env) for _ in range(repeat))


def package_at(rev: str, into: Path) -> Path:
    """The `backport` package of commit REV, extracted under INTO (the git objects, not a checkout)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "backport"], capture_output=True, check=True
    )
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--before", metavar="REV", help="also measure the backport package of this commit")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    trees = {"now": env}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        if args.before:
            old = package_at(args.before, Path(tmp))
            trees[args.before] = {**env, "PYTHONPATH": str(old)}
        # One untimed run of each first: the bytecode caches are written, the files in the page cache.
        for tree_env in trees.values():
            for argv in COMMANDS.values():
                cpu_seconds([sys.executable, "-c", SCRIPT, *argv], tree_env)
        floor = median_cpu([sys.executable, "-c", "pass"], env, args.repeat)
        print(f"floor (python -c pass): {floor:.3f} s CPU, median of {args.repeat}")
        for name, argv in COMMANDS.items():
            for label, tree_env in trees.items():
                ours = median_cpu([sys.executable, "-c", SCRIPT, *argv], tree_env, args.repeat)
                goal = "met" if ours < GOAL_S else "MISSED"
                print(f"{name:10} {label:>10}: {ours:.3f} s CPU, {ours / floor:.1f}x the floor, "
                      f"{ours - floor:.3f} s ours; goal < {GOAL_S} s: {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
