"""Cold against warm `fetch`: the second fetch of a target is a cache hit that downloads nothing.

Prints the cold time (empty cache: pip download, sha256, RECORD check, extraction, first commit),
the warm time (a cache hit), and their ratio, measured in the same run. Goal: warm well under 1 s.

    python benchmarks/bench_fetch.py [SPEC]      (default sglang==0.5.19; needs the package index)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time


def main(spec: str = "sglang==0.5.19") -> int:
    from backport.sources import materialise

    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as cache:
        os.environ["SGLANG_BACKPORT_CACHE"] = cache
        started = time.perf_counter()
        cold = materialise(spec)
        cold_s = time.perf_counter() - started
        assert not cold.cached
        warm_runs = []
        for _ in range(5):
            started = time.perf_counter()
            warm = materialise(spec)
            warm_runs.append(time.perf_counter() - started)
            assert warm.cached and warm.tree == cold.tree
    warm_s = statistics.median(warm_runs)
    print(f"fetch {spec}: cold {cold_s:.2f} s, warm {warm_s * 1000:.1f} ms (median of 5), "
          f"warm/cold ratio {warm_s / cold_s:.5f}; goal warm < 1 s: {'met' if warm_s < 1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
