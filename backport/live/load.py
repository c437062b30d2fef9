"""Decode's tokens in use or waiting, read from what the server exposes, by the answer's shape.

What each release exposes (read from its http_server and scheduler):
- `/v1/loads` (0.5.8 on; 0.5.22 has only this): `{"loads": [{"num_total_tokens", "num_used_tokens"}]}`,
  `num_total_tokens` = KV slots in use + the prompt tokens of requests decode queued but has not
  allocated (prealloc, retracted); 0.5.8 reports `num_used_tokens` alone;
- `/get_load` 0.5.3 - 0.5.19: `[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]`, the same sum;
- `/get_load` 0.4.7 - 0.5.2: `{"load": N}`, the same sum (the scheduler's `get_load`);
- 0.4.6.post5 and older: none (their `/get_server_info` has no load and `/metrics` needs
  `--enable-metrics`): the scenario then judges only by the next valid prompt.
A reservation decode made for a request (its pages taken from the allocator, a deferred hold
included) counts as used, so the number returns to the idle baseline exactly when it is released.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import requests

READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class Load:
    tokens: int
    source: str     # the endpoint and field it came from


def read_load(url: str) -> Load | None:
    """Decode's tokens in use or waiting, or None where the server exposes no load."""
    for path in ("/v1/loads?include=core", "/get_load"):
        with contextlib.suppress(requests.RequestException, ValueError):
            response = requests.get(url + path, timeout=READ_TIMEOUT)
            if response.status_code == 200:
                found = from_document(response.json(), path.split("?")[0])
                if found is not None:
                    return found
    return None


def from_document(document, path: str) -> Load | None:
    """The load of one answer of `path`, by its shape (None for a shape not listed above)."""
    if isinstance(document, dict) and isinstance(document.get("loads"), list):
        ranks = [r for r in document["loads"] if isinstance(r, dict)]
        for name in ("num_total_tokens", "num_used_tokens"):
            if ranks and all(isinstance(r.get(name), int) for r in ranks):
                return Load(sum(r[name] for r in ranks), f"{path} {name}")
        return None
    if isinstance(document, dict) and isinstance(document.get("load"), int):
        return Load(document["load"], f"{path} load")
    if isinstance(document, list) and document and all(
            isinstance(r, dict) and isinstance(r.get("num_tokens"), int) for r in document):
        return Load(sum(r["num_tokens"] for r in document), f"{path} num_tokens")
    return None


def wait_for(url: str, at_most: int, bound: float, poll: float = 0.25) -> tuple[float | None, list]:
    """Poll until decode's load is at most `at_most`: (seconds it took or None past `bound`,
    the readings as [seconds, tokens] whenever the number changed)."""
    started = time.monotonic()
    readings: list = []
    while True:
        now = time.monotonic() - started
        load = read_load(url)
        if load is not None and (not readings or readings[-1][1] != load.tokens):
            readings.append([round(now, 2), load.tokens])
        if load is not None and load.tokens <= at_most:
            return now, readings
        if now > bound:
            return None, readings
        time.sleep(poll)
