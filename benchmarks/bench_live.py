"""Benchmark: the live tier per tree against the floor of one `launch_server` start, per serving setup.

    python benchmarks/bench_live.py TREE [TREE ...] [--race] [--json]

First the floors: per serving setup among the trees (backport/live/setups.py: the old releases
start with stand-ins, add-ons and their own environment, and some answer /health before their
warmup), one plain (non-PD) `launch_server` of the tiny model on the setup's first tree, with the
setup's environment and PYTHONPATH, timed from spawn to ready as the pair is (/health 200, and the
warmup's log line where /health answers first), then stopped; started twice, the faster start
counts. Then per tree, the
live tier as `live` runs it: pair start-up (prefill and decode started together, then the router) and the
scenarios' time, and the peak resident memory of the deployment's process groups while the scenarios run
(sampled every second from /proc). With --race, per tree the 2P1D page-lifetime race too (its own
deployment: ready time, scenario time, peak memory of every server it started).
Prints the seconds and the ratios to the floor (goal: the live tier of one `run`, three trees,
under 2x three server starts). Prints, never asserts. Run it on a quiet machine: on a loaded one
every figure grows, the ratios much less.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backport.live import REGISTRY, ensure_model, ensure_serving_env
from backport.live.deployment import (
    COMMON_FLAGS,
    RESERVED_DECODE_TOKENS,
    SERVER_ENV,
    SERVER_START_TIMEOUT,
    deployed,
    wait_warmed_up,
)
from backport.live.race import run_race
from backport.live.servers import LOOPBACK, Processes, free_port, wait_ready
from backport.live.setups import pythonpath_extras, server_environment, serving_for
from backport.live.tier import run_scenario
from backport.tree import open_tree


def _group_rss(pgids: set[int]) -> int:
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) in pgids:
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


class PeakMemory(threading.Thread):
    """The peak summed RSS of some process groups, sampled every second."""

    def __init__(self, pgids: set[int]):
        super().__init__(daemon=True)
        self.pgids, self.peak, self.done = pgids, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _group_rss(self.pgids))
            self.done.wait(1.0)


def floor_seconds(env, model, tree, workdir: Path) -> float:
    """One plain launch_server of the tiny model on `tree`, started as its serving setup starts servers."""
    workdir.mkdir(parents=True, exist_ok=True)
    setup = serving_for(tree.version)
    port = free_port()
    server_env = {**os.environ, **SERVER_ENV, **server_environment(setup, RESERVED_DECODE_TOKENS),
                  "PYTHONNOUSERSITE": "1",
                  "PYTHONPATH": env.pythonpath(Path(tree.package_root), pythonpath_extras(setup))}
    argv = [
        str(env.python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model.path),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *COMMON_FLAGS,
        *(("--nccl-port", str(free_port())) if setup.nccl_port else ()),
    ]
    with Processes(workdir) as processes:
        started = time.monotonic()
        server = processes.start("floor", argv, url=f"http://{LOOPBACK}:{port}", env=server_env)
        wait_ready([server], "/health", SERVER_START_TIMEOUT)
        if setup.health_before_warmup:
            wait_warmed_up([server], SERVER_START_TIMEOUT)
        return time.monotonic() - started


def _descendants_rss() -> int:
    """Summed RSS of every descendant of this process (the 2P1D servers run in their own sessions
    and namespace, but stay our descendants)."""
    parents, rss = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            parents[pid], rss[pid] = int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    me, total = os.getpid(), 0
    for pid, size in rss.items():
        seen, up = set(), parents.get(pid)
        while up is not None and up not in seen and up != me:
            seen.add(up)
            up = parents.get(up)
        if up == me:
            total += size
    return total


class PeakDescendants(PeakMemory):
    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, _descendants_rss())
            self.done.wait(1.0)


def race_figures(env, tree, workdir: Path) -> dict:
    """The 2P1D page-lifetime race (its own deployment): ready time, scenario time, peak memory."""
    sampler = PeakDescendants(set())
    sampler.start()
    result = run_race(env, Path(tree.package_root), workdir)
    sampler.done.set()
    sampler.join()
    startup = result["details"].get("startup_seconds") or 0.0
    return {
        "version": tree.version,
        "startup_seconds": startup,
        "scenario_seconds": round(result["seconds"] - startup, 1),
        "peak_rss_gib": round(sampler.peak / 2**30, 2),
        "verdict": result["verdict"],
        "observed": result["observed"],
    }


def tree_figures(env, model, tree, workdir: Path) -> dict:
    with deployed(env, Path(tree.package_root), tree.version, model, workdir) as dep:
        sampler = PeakMemory({s.process.pid for s in (dep.prefill, dep.decode, dep.router)})
        sampler.start()
        started = time.monotonic()
        verdicts = {item.name: run_scenario(item, dep, model)["verdict"] for item in REGISTRY}
        scenarios = time.monotonic() - started
        sampler.done.set()
        sampler.join()
    return {"tree": str(tree.path), "version": tree.version, "setup": serving_for(tree.version).name,
            "startup_seconds": round(dep.startup_seconds, 1),
            "scenario_seconds": round(scenarios, 1), "peak_rss_gib": round(sampler.peak / 2**30, 2),
            "verdicts": verdicts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--race", action="store_true", help="also the 2P1D page-lifetime race per tree")
    args = parser.parse_args()
    trees = [open_tree(Path(t)) for t in args.trees]
    env = ensure_serving_env()
    model = ensure_model(env.python)
    setups = {}  # setup name -> its first tree (the floor's tree)
    for tree in trees:
        setups.setdefault(serving_for(tree.version).name, tree)
    with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
        # the faster of two starts: the first also pays the cold page cache of torch and the tree
        floors = {name: min(floor_seconds(env, model, tree, Path(tmp) / f"floor-{name}-{n}") for n in (1, 2))
                  for name, tree in setups.items()}
        rows = [tree_figures(env, model, tree, Path(tmp) / f"{i}") for i, tree in enumerate(trees)]
        races = (
            [race_figures(env, tree, Path(tmp) / f"race-{i}") for i, tree in enumerate(trees)]
            if args.race
            else []
        )
    per_setup = []
    for name, floor in floors.items():
        mine = [r for r in rows if r["setup"] == name]
        total = sum(r["startup_seconds"] + r["scenario_seconds"] for r in mine)
        per_setup.append({"setup": name, "floor_seconds": round(floor, 1), "trees": len(mine),
                          "total_seconds": round(total, 1), "total_over_floor": round(total / floor, 2),
                          "goal": f"total under {2 * len(mine)} x floor (2x {len(mine)} server starts)"})
    result = {"setups": per_setup, "trees": rows, "race_2p1d": races}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for group in per_setup:
        floor = group["floor_seconds"]
        print(f"setup {group['setup']}: floor, one launch_server start {floor:.1f} s")
        print(f"  {'version':12} {'start s':>8} {'x floor':>8} {'scen. s':>8} {'peak GiB':>9}  verdicts")
        for r in (r for r in rows if r["setup"] == group["setup"]):
            print(f"  {r['version']:12} {r['startup_seconds']:8.1f} {r['startup_seconds'] / floor:8.2f} "
                  f"{r['scenario_seconds']:8.1f} {r['peak_rss_gib']:9.2f}  "
                  + ", ".join(f"{k}={v}" for k, v in r["verdicts"].items()))
        print(f"  total {group['total_seconds']:.1f} s = {group['total_over_floor']:.2f} x floor; "
              f"goal: under {2 * group['trees']} x floor")
    for r in races:
        print(
            f"2P1D race {r['version']:12} start {r['startup_seconds']:.1f} s, scenario "
            f"{r['scenario_seconds']:.1f} s, "
            f"peak {r['peak_rss_gib']:.2f} GiB: {r['verdict']} ({r['observed']})"
        )
    return 0

if __name__ == "__main__":
    sys.exit(main())
