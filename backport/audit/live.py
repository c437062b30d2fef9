"""`audit --live URL`: the negative cases of gates 1 and 2, sent to a running deployment's router.

Opt-in, because it sends traffic. The router lists its workers (`/workers`); each worker's
`/server_info` gives its pool and context (gate 1's facts). The negative case is a prompt within
the context but above the prefill pool; it is sent a bounded number of times (each request with
the audit's timeout) and judged from what the client sees, the incident's fingerprint being an
HTTP 200 with the full `prompt_tokens`, answered faster than a full prefill of a prompt that fits:

* 4xx and no tokens every time: rejected at admission (gate 2 passes on this evidence);
* any 200: the deployment served a prompt its prefill pool cannot hold (gate 2 fails);
* no answer or 5xx: no verdict (unknown).
"""

from __future__ import annotations

import dataclasses
import time

import requests

from backport.audit.gates import FAIL, PASS, UNKNOWN, GateResult, worst
from backport.audit.servers import ServerFacts, check_url, fetch_server

MAX_COUNT = 10
NEW_TOKENS = 4
# token ids every tokenizer of a real model has (the live tier's tiny model has 512)
_IDS = list(range(10, 100))


def _prompt(length: int) -> list[int]:
    return [_IDS[i % len(_IDS)] for i in range(length)]


def _send(url: str, length: int, timeout: float) -> dict:
    body = {"input_ids": _prompt(length),
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    started = time.monotonic()
    try:
        response = requests.post(url + "/generate", json=body, timeout=timeout)
    except requests.RequestException as exc:
        return {"status": None, "prompt_tokens": None, "tokens": 0, "seconds": round(time.monotonic() - started, 3),
                "error": type(exc).__name__}
    seconds = round(time.monotonic() - started, 3)
    try:
        document = response.json()
    except ValueError:
        document = {}
    meta = document.get("meta_info") or {} if isinstance(document, dict) else {}
    tokens = len(document.get("output_ids") or []) if isinstance(document, dict) else 0
    return {"status": response.status_code, "prompt_tokens": meta.get("prompt_tokens"), "tokens": tokens,
            "seconds": seconds}


def workers(url: str, timeout: float) -> list[ServerFacts]:
    """The router's workers, read like `--server` URLs (an unreadable list: none)."""
    try:
        listed = requests.get(url + "/workers", timeout=timeout).json().get("workers") or []
    except (requests.RequestException, ValueError, AttributeError):
        return []
    return [fetch_server(w["url"], timeout=timeout) for w in listed if isinstance(w, dict) and w.get("url")]


def negative_case(url: str, servers: list[ServerFacts], count: int, timeout: float) -> dict:
    """Send the over-pool prompt `count` times, and a prompt that fits once (the latency baseline)."""
    prefill = [s for s in servers if s.role == "prefill" and s.pool_tokens and s.context_length]
    if not prefill:
        return {"skipped": "no prefill worker reported its pool and context through the router"}
    pool, context = prefill[0].pool_tokens, prefill[0].context_length
    if pool >= context - NEW_TOKENS:
        return {"skipped": f"the prefill pool ({pool}) holds the context ({context}): no prompt is within the "
                           "context and above the pool"}
    length = min(context - NEW_TOKENS - 1, pool + max(1, pool // 2))
    fits = max(1, min(prefill[0].max_req_input_len or pool, pool) // 2)
    baseline = _send(url, fits, timeout)
    replies = [_send(url, length, timeout) for _ in range(count)]
    return {"prompt_tokens_sent": length, "prefill_pool": pool, "context_length": context,
            "baseline": {"prompt_tokens_sent": fits, **baseline}, "replies": replies}


def judge(case: dict) -> tuple[str, str]:
    if "skipped" in case:
        return UNKNOWN, f"live negative case not sent: {case['skipped']}"
    replies, length = case["replies"], case["prompt_tokens_sent"]
    served = [r for r in replies if r["status"] == 200]
    summary = ", ".join(f"{r['status']} in {r['seconds']} s" for r in replies)
    if served:
        full = sum(1 for r in served if r["prompt_tokens"] == length)
        faster = case["baseline"].get("status") == 200 and any(
            r["seconds"] < case["baseline"]["seconds"] for r in served)
        return FAIL, (f"live: a {length}-token prompt (prefill pool {case['prefill_pool']}) got {summary}; "
                      f"{full} of {len(served)} answers report prompt_tokens={length}"
                      + ("; faster than a full prefill of a prompt that fits" if faster else "")
                      + ": served a prompt the prefill pool cannot hold (the incident's fingerprint)")
    if all(r["status"] is not None and 400 <= r["status"] < 500 and not r["tokens"] for r in replies):
        return PASS, f"live: a {length}-token prompt (prefill pool {case['prefill_pool']}) got {summary}: rejected"
    return UNKNOWN, f"live: a {length}-token prompt got {summary}: no verdict"


def apply_live(results: tuple[GateResult, ...], url: str, *, count: int, timeout: float) -> tuple[GateResult, ...]:
    """Gates 1 and 2 with the live negative case added (gate 1 from the router's workers when no
    --server was given)."""
    from backport.audit.gates import gate_pool_versus_context

    url = check_url(url)
    servers = workers(url, timeout)
    case = negative_case(url, servers, count, timeout)
    verdict, line = judge(case)
    out = []
    for gate in results:
        if gate.gate == 1:
            base = gate if gate.servers else gate_pool_versus_context(tuple(servers))
            out.append(dataclasses.replace(base, evidence=(*base.evidence, line),
                                           details={**base.details, "live": case}))
        elif gate.gate == 2:
            code_known = "code" in gate.details
            combined = worst((gate.verdict, verdict)) if code_known else verdict
            out.append(dataclasses.replace(gate, verdict=combined, evidence=(*gate.evidence, line),
                                           details={**gate.details, "live": case}))
        else:
            out.append(gate)
    return tuple(out)
