"""Benchmark: the engine against ``git apply`` on the same exact patches.

    python benchmarks/bench_apply.py [--tree /tmp/sg/0.5.19] [--fixes 8] [--files 3] [--repeat 5]

Uses a local clone of a real tree (default /tmp/sg/0.5.19 when it exists),
else generates a synthetic tree of a few thousand Python files. It writes a
pack of ``--fixes`` fixes, each touching ``--files`` files with two hunks
each, made with ``git diff`` so every hunk is exact. Then, on fresh clones,
in the same run:

* engine: ``load_pack`` + ``apply_series`` in process (placement, one commit
  per patch, files, index, HEAD);
* ``git apply``: one ``git apply`` per patch file (working files only);
* ``git apply --index`` + ``git commit`` per patch: the same work the
  engine does.

Then one more engine run on a fresh clone under cProfile prints where the engine's time goes
(loading the pack, the symlink checks, the base trees, the decision loop, waiting for git's
ls-files/diff-index, the series' pack, the journal, whole-file replacement, the index built in a
second name by a git fed each path as its file is whole, the ref transaction): cProfile's
overhead inflates the Python parts, so read it as shares, not as times.

The clones of every run are made first and settled before any is measured:
one ``git status`` a second after the clone (git rewrites a brand-new index
the first time it refreshes it: racy-git entries), then the file system is
flushed and left alone for six seconds, as any checkout that is not brand new.
Measured before this rule: on this machine's ext4 (no journal), every new file
created within seconds of a large deletion (the previous run's three clones,
13,000 files) walks past the recently freed inodes, 0.3 - 1 ms of kernel time
per file, a cost of the bench and not of either side that moved the ratio by
up to 0.4 between runs. Runs alternate their order; all clones are removed at
the end. Prints the medians, the median of per-run ratios (goal: engine / git
apply <= 2), and each side's CPU (its own and its processes'). Prints, never
asserts.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backport.engine import apply_series
from backport.pack import load_pack

ENV = dict(
    os.environ,
    GIT_AUTHOR_NAME="bench",
    GIT_AUTHOR_EMAIL="bench@localhost",
    GIT_COMMITTER_NAME="bench",
    GIT_COMMITTER_EMAIL="bench@localhost",
    GIT_AUTHOR_DATE="2026-01-01T00:00:00+0000",
    GIT_COMMITTER_DATE="2026-01-01T00:00:00+0000",
)


def git(cwd: Path, *args: str, input: bytes | None = None) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], input=input, env=ENV, check=True,
                          capture_output=True).stdout.decode()


def synthetic_tree(root: Path, n_files: int = 3000) -> Path:
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    rnd = random.Random(0)
    for i in range(n_files):
        d = root / "sglang" / "srt" / f"mod{i % 40}"
        d.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def fn_{i}_{j}(x):\n    y = x * {rnd.randint(0, 10**6)}\n    return y\n\n"
                       for j in range(rnd.randint(20, 120)))
        (d / f"file{i}.py").write_text(f'"""module {i}"""\n\n' + body)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "pristine")
    return root


def pick_files(tree: Path, n: int) -> list[Path]:
    files = sorted(p for p in (tree / "sglang").rglob("*.py") if p.stat().st_size > 4000)
    rnd = random.Random(1)
    return rnd.sample(files, n)


def make_pack(tree: Path, work: Path, n_fixes: int, n_files: int) -> Path:
    scratch = work / "scratch"
    subprocess.run(["git", "clone", "-q", "--local", str(tree), str(scratch)], check=True)
    pack = work / "pack"
    pack.mkdir()
    files = pick_files(scratch, n_fixes * n_files)
    series = []
    toml = []
    for k in range(n_fixes):
        fid = f"pr{90000 + k}"
        series.append(fid)
        toml += [f"[fixes.{fid}]", f'title = "bench fix {k}"', f"pr = {90000 + k}",
                 'upstream_commit = "0000000000000000000000000000000000000000"', 'fixed_in = ""', ""]
        for f in files[k * n_files:(k + 1) * n_files]:
            lines = f.read_text(encoding="utf-8", errors="surrogateescape").split("\n")
            for at in (len(lines) // 3, 2 * len(lines) // 3):  # two hunks per file
                lines.insert(at, f"# sglang-backport bench {fid}")
            f.write_text("\n".join(lines), encoding="utf-8", errors="surrogateescape")
        git(scratch, "add", "-A")
        diff = git(scratch, "diff", "--cached", "--no-color")
        git(scratch, "commit", "-qm", fid)
        (pack / fid).mkdir()
        (pack / fid / f"{fid}-0.5.17.patch").write_text(
            f"Description: bench fix {k}\nOrigin: upstream, "
            f"https://github.com/sgl-project/sglang/pull/{90000 + k}\nApplies-To: >=0\nDepends-On: none\n"
            f"Last-Update: 2026-11-30\n---\n" + diff
        )
    (pack / "series").write_text("\n".join(series) + "\n")
    (pack / "fixes.toml").write_text("\n".join(toml))
    return pack


# (label, module path suffix, function name) of the stages the breakdown reports
STAGES = (
    ("load the pack (parse variants)", "pack/load.py", "load_pack"),
    ("symlink checks", "engine/apply.py", "_check_symlinks"),
    ("base trees from loose objects", "engine/objects.py", "read_loose_trees"),
    ("decision loop (placement in memory)", "engine/decide.py", "decide"),
    ("wait for ls-files / diff-index (cat-file)", "backport/gitops.py", "result"),
    ("objects: one pack (blobs, trees, commits)", "engine/objects.py", "write_commits"),
    ("journal (create, files phase)", "engine/journal.py", "create"),
    ("journal save", "engine/journal.py", "save"),
    ("whole-file replacement (put_file)", "engine/journal.py", "put_file"),
    ("starting ls-files and diff-index", "backport/gitops.py", "__init__"),
    ("starting update-index and update-ref", "engine/index_refs.py", "__init__"),
    ("  waiting for update-index at the end", "engine/index_refs.py", "finish"),
    ("git update-ref (HEAD, the commit point)", "engine/index_refs.py", "commit"),
)


def breakdown(clone: Path, pack_dir: Path, version: str) -> None:
    """One engine run under cProfile: cumulative time per stage (see the module docstring)."""
    prof = cProfile.Profile()
    prof.enable()
    rep = apply_series(clone, load_pack(pack_dir), version, package_prefix=prefix_of(clone))
    prof.disable()
    assert rep.status == "applied", rep.to_json()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = max(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "apply_series")
    total += sum(ct for (f, _, name), (_, _, _, ct, _) in stats.items() if name == "load_pack")
    print(f"where the engine's time goes (one run under cProfile, {total * 1000:.0f} ms):")
    for label, where, func in STAGES:
        matched = {k: v for k, v in stats.items() if k[2] == func and k[0].endswith(where)}
        # a match called only from other matches (a subclass's __init__ calling its base's) is in theirs
        ms = sum(ct for _, _, _, ct, callers in matched.values()
                 if not (callers and callers.keys() <= matched.keys())) * 1000
        print(f"  {label:42s} {ms:7.1f} ms  {ms / (total * 1000):4.0%}")


SETTLE = 6.0  # seconds: past ext4's window for recently freed inodes (5 s once their blocks are clean)


def _cpu() -> float:
    """CPU seconds of this process and of its finished children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def prefix_of(tree: Path) -> str:
    return "" if (tree / "sglang").is_dir() else "python/"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=Path("/tmp/sg/0.5.19"))
    ap.add_argument("--fixes", type=int, default=8)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pack", type=Path, help="use this pack (e.g. patches/) instead of a generated one")
    ap.add_argument("--version", default="0.5.19", help="the tree's sglang version (with --pack)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-apply-"))
    try:
        if (a.tree / ".git").exists():
            tree, kind = a.tree, f"real tree {a.tree}"
        else:
            tree, kind = synthetic_tree(work / "synthetic"), "synthetic tree"
        if a.pack:
            pack_dir, version = a.pack.resolve(), a.version
            probe = work / "probe"
            subprocess.run(["git", "clone", "-q", "--local", str(tree), str(probe)], check=True)
            rep = apply_series(
                probe, load_pack(pack_dir), version, package_prefix=prefix_of(probe), check=True
            )
            assert rep.status == "applied", rep.to_json()
            patches = [pack_dir / p.fix / p.variant for p in rep.patches if p.status == "applied"]
        else:
            pack_dir, version = make_pack(tree, work, a.fixes, a.files), "0.5.19"
            patches = [
                pack_dir / fid / f"{fid}-0.5.17.patch" for fid in (pack_dir / "series").read_text().split()
            ]
        n_tracked = len(git(tree, "ls-files").splitlines())
        t_engine, t_apply, t_commit = [], [], []
        cpu: dict[int, list[float]] = {0: [], 1: [], 2: []}
        clones = {}
        for r in range(a.repeat):
            for which, name in enumerate(("engine", "apply", "commit")):
                clones[r, which] = c = work / f"{name}-{r}"
                subprocess.run(["git", "clone", "-q", "--local", str(tree), str(c)], check=True)
        time.sleep(1.0)  # then settle each fresh index (racy-git entries), as in any older checkout
        for c in clones.values():
            git(c, "status", "--porcelain")
        os.sync()
        time.sleep(SETTLE)
        for r in range(a.repeat):
            # alternate the order so no side always gets a warm page cache
            for which in ([0, 1, 2] if r % 2 == 0 else [2, 1, 0]):
                c = clones[r, which]
                before = _cpu()
                t0 = time.perf_counter()
                if which == 0:
                    rep = apply_series(c, load_pack(pack_dir), version, package_prefix=prefix_of(c))
                    t_engine.append(time.perf_counter() - t0)
                    assert rep.status == "applied", rep.to_json()
                    assert a.pack or all(h.status == "exact" for p in rep.patches for h in p.hunks)
                elif which == 1:
                    extra = [f"--directory={prefix_of(c).rstrip('/')}"] if prefix_of(c) else []
                    for p in patches:
                        git(c, "apply", *extra, str(p))
                    t_apply.append(time.perf_counter() - t0)
                else:
                    extra = [f"--directory={prefix_of(c).rstrip('/')}"] if prefix_of(c) else []
                    for p in patches:
                        git(c, "apply", "--index", *extra, str(p))
                        git(c, "commit", "-qm", p.stem)
                    t_commit.append(time.perf_counter() - t0)
                cpu[which].append(_cpu() - before)
        me, ma, mc = (statistics.median(x) for x in (t_engine, t_apply, t_commit))
        if a.pack:
            what = f"pack {a.pack} for sglang {version}: {len(patches)} patches applied"
        else:
            what = (f"{a.fixes} generated patches, {a.fixes * a.files} files, "
                    f"{a.fixes * a.files * 2} exact hunks")
        print(f"tree: {kind} ({n_tracked} tracked files); series: {what}; median of {a.repeat} runs")
        print(f"engine (load + apply + {len(patches)} commits, in process): {me * 1000:8.1f} ms")
        print(f"git apply ({len(patches)} invocations, files only):        {ma * 1000:8.1f} ms")
        print(f"git apply --index + git commit per patch:          {mc * 1000:8.1f} ms")
        paired = statistics.median(e / g for e, g in zip(t_engine, t_apply))
        print(f"ratio engine / git apply:                {paired:5.2f}x   (goal <= 2x; median of per-run "
              f"ratios; ratio of the medians {me / ma:.2f}x)")
        print(f"ratio engine / git apply --index+commit: {me / mc:5.2f}x")
        print(f"CPU, median (own + its processes): engine {statistics.median(cpu[0]) * 1000:.1f} ms, "
              f"git apply {statistics.median(cpu[1]) * 1000:.1f} ms")
        c = work / "breakdown"
        subprocess.run(["git", "clone", "-q", "--local", str(tree), str(c)], check=True)
        time.sleep(1.0)
        git(c, "status", "--porcelain")
        os.sync()
        time.sleep(SETTLE)
        breakdown(c, pack_dir, version)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
