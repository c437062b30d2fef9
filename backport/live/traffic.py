"""Concurrent traffic through the router: what refused requests' reservations cost valid ones.

A seeded random mix of valid and over-pool prompts at a fixed concurrency, against the same
number of valid prompts alone; the p50 latency of the valid prompts in each, their failures, and
how many came back with other than the reference tokens. Bounded: each request has its own
timeout, and nothing new is sent after the deadline.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from backport.live.reply import Reply

SEED = 41
CONCURRENCY = 3
VALID_ONLY = 9
MIX = 18
OVER_POOL_SHARE = 1 / 3
REQUEST_TIMEOUT = 30.0
DEADLINE = 120.0


def plan(seed: int = SEED, count: int = MIX, share: float = OVER_POOL_SHARE) -> list[str]:
    """The mix's order of prompts ("valid" or "over_pool"), the same for every tree."""
    rng = random.Random(seed)
    return ["over_pool" if rng.random() < share else "valid" for _ in range(count)]


def run(send: Callable[[str, float], Reply], kinds: list[str], reference: list[int]) -> dict:
    """Send `kinds` (prompt names) at CONCURRENCY through `send(name, timeout)`; a summary."""
    started = time.monotonic()

    def one(kind: str) -> tuple[str, Reply | None]:
        if time.monotonic() - started > DEADLINE:
            return kind, None
        return kind, send(kind, REQUEST_TIMEOUT)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(one, kinds))
    valid = [r for k, r in results if k == "valid" and r is not None]
    served = [r for r in valid if r.status == 200 and r.recovered]
    over = [r for k, r in results if k == "over_pool" and r is not None]
    return {
        "requests": len(kinds), "valid": len(valid), "over_pool": len(over),
        "not_sent_past_deadline": sum(r is None for _, r in results),
        "valid_p50_seconds": round(statistics.median(r.seconds for r in served), 3) if served else None,
        "valid_max_seconds": round(max(r.seconds for r in served), 3) if served else None,
        "valid_failed": [r.to_json() for r in valid if r not in served][:5],
        "valid_wrong_tokens": sum(r.tokens != reference for r in served),
        "over_pool_statuses": sorted({str(r.status) for r in over}),
        "seconds": round(time.monotonic() - started, 2)}
