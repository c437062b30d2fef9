"""`audit --live URL`: the negative cases of gates 1 and 2, sent to a running deployment's router.

Opt-in, because it sends traffic. The router lists its workers (`/workers`); each worker's
`/server_info` gives its pool and context (gate 1's facts). First a prompt that fits is sent once
(the baseline: it must come back 200 with its tokens, or nothing the router says is judged), then
a prompt within the context but above the prefill pool, a bounded number of times. Judged only
from what was seen, the incident's fingerprint being an HTTP 200 with the full `prompt_tokens`:

* any 200 with tokens for the over-pool prompt: served a prompt its prefill pool cannot hold (fail);
* the baseline served and every over-pool prompt a 4xx without tokens whose body names the input
  length: rejected by the length check (pass);
* anything else (an API key wanted, a redirect, no answer, a 5xx, a 4xx about something else, a
  garbled body, a prompt above --max-prompt-tokens): no verdict (unknown, with the reason).

Every request is bounded in seconds, bytes and redirects by `fetch`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from backport.audit.fetch import Limits, Reply, describe, request
from backport.audit.gates import FAIL, PASS, UNKNOWN, GateResult, worst
from backport.audit.servers import ServerFacts, check_url, fetch_servers
from backport.errors import BadInput
from backport.vocab import GateVerdict

MAX_COUNT = 10
NEW_TOKENS = 4
MAX_PROMPT_TOKENS = 1_048_576     # the incident's context; --max-prompt-tokens raises it
MAX_WORKERS = 256                 # workers read from one router; the rest are named as not read
# token ids every tokenizer of a real model has (the live tier's tiny model has 512)
_IDS = list(range(10, 100))


def _prompt(length: int) -> list[int]:
    return [_IDS[i % len(_IDS)] for i in range(length)]


def _names_length(text: str, length: int) -> bool:
    """The body names the prompt's length as a length ("Input length (400 tokens) exceeds ...",
    "The input (400 tokens) is longer ..."), not merely somewhere (an echo of the token ids)."""
    for form in (str(length), f"{length:,}"):
        number = rf"(?<![\d,]){re.escape(form)}(?!\d|,\d)"
        if re.search(number + r"\s*tokens?\b", text, re.IGNORECASE) or \
                re.search(r"length\D{0,20}" + number, text, re.IGNORECASE):
            return True
    return False


def _send(url: str, length: int, limits: Limits) -> dict:
    body = {"input_ids": _prompt(length),
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    reply = request("POST", url + "/generate", limits, json_body=body)
    out: dict[str, Any] = {"status": reply.status, "prompt_tokens": None, "tokens": 0,
                           "seconds": reply.seconds, "names_length": False}
    why = _why_not_usable(reply, length)
    if why:
        out["error"] = why
    document = reply.json()
    if isinstance(document, list):   # some releases answer a one-element list
        document = document[0] if document else None
    if isinstance(document, dict):
        meta_info = document.get("meta_info")
        meta = meta_info if isinstance(meta_info, dict) else {}
        tokens = document.get("output_ids") or meta.get("output_ids") or []
        out["tokens"] = len(tokens) if isinstance(tokens, list) else 0
        prompt_tokens = meta.get("prompt_tokens")
        out["prompt_tokens"] = prompt_tokens if isinstance(prompt_tokens, int) else None
    elif reply.status == 200:
        out["error"] = f"{reply.url}: HTTP 200 but the body is not a JSON object (garbled)"
    out["names_length"] = reply.status is not None and _names_length(reply.text, length)
    return out


def _why_not_usable(reply: Reply, length: int) -> str | None:
    if reply.status is not None and 400 <= reply.status < 500 and reply.status not in (401, 403):
        return None   # judged below: a rejection, if it names the length
    return describe(reply, who="the router")


def workers(url: str, limits: Limits) -> tuple[list[ServerFacts], str | None]:
    """The router's workers read like `--server` URLs, and why the list could not be read."""
    reply = request("GET", url + "/workers", limits)
    why = describe(reply, who="the router")
    if why:
        return [], f"the router's worker list: {why}"
    document = reply.json()
    listed = document.get("workers") if isinstance(document, dict) else None
    if not isinstance(listed, list):
        return [], f"the router's worker list: {reply.url}: not a JSON object with a 'workers' list (garbled)"
    urls, bad = [], 0
    for w in listed:
        try:
            urls.append(check_url(w["url"], "a worker"))
        except (TypeError, KeyError, BadInput):   # the router's answer, not the operator's input
            bad += 1
    servers = list(fetch_servers(urls[:MAX_WORKERS], limits))
    servers += [ServerFacts(u, None, f"not read: the audit reads at most {MAX_WORKERS} workers of a router")
                for u in urls[MAX_WORKERS:]]
    return servers, (f"the router lists {bad} worker(s) without an http(s) URL" if bad else None)


def negative_case(url: str, servers: list[ServerFacts], count: int, limits: Limits,
                  max_prompt: int = MAX_PROMPT_TOKENS) -> dict:
    """The baseline once, then the over-pool prompt `count` times (none if the baseline failed)."""
    prefill = [s for s in servers if s.role == "prefill" and s.pool_tokens and s.context_length]
    if not prefill:
        return {"skipped": "no prefill worker reported its pool and context through the router"}
    # above every prefill's pool (the router may pick any) and within every one's context
    # (`or 0` only for the type checker: the filter above kept the workers that report both)
    pool, context = max(s.pool_tokens or 0 for s in prefill), min(s.context_length or 0 for s in prefill)
    if pool >= context - NEW_TOKENS:
        return {"skipped": f"no prompt is above every prefill pool (the largest {pool:,}) and within every "
                           f"context (the smallest {context:,})"}
    length = min(context - NEW_TOKENS - 1, pool + max(1, pool // 2), max_prompt)
    if length <= pool:
        return {
            "skipped": f"a prompt above the prefill pool ({pool:,} tokens) is longer than "
                       "--max-prompt-tokens "
            f"({max_prompt:,})",
            "remedy": f"--max-prompt-tokens {pool + 1}",
            "prefill_pool": pool,
            "context_length": context,
        }
    fits = max(1, min(*(s.max_req_input_len or s.pool_tokens or 0 for s in prefill),
                      *(s.pool_tokens or 0 for s in prefill), max_prompt) // 2)
    baseline: dict[str, Any] = {"prompt_tokens_sent": fits, **_send(url, fits, limits)}
    case: dict[str, Any] = {"prompt_tokens_sent": length, "prefill_pool": pool, "context_length": context,
            "baseline": baseline, "replies": []}
    if _baseline_problem(baseline) is None:
        case["replies"] = [_send(url, length, limits) for _ in range(count)]
    return case


def _baseline_problem(baseline: dict) -> str | None:
    if baseline.get("error"):
        return baseline["error"]
    if baseline["status"] != 200:
        return f"HTTP {baseline['status']}"
    if not baseline["tokens"] or baseline["prompt_tokens"] != baseline["prompt_tokens_sent"]:
        return (
            f"HTTP 200 with {baseline['tokens']} output tokens and prompt_tokens={baseline['prompt_tokens']} "
            f"for {baseline['prompt_tokens_sent']} sent: not a generate answer"
        )
    return None


def judge(case: dict) -> tuple[GateVerdict, str, str | None]:
    """(verdict, evidence line, remedy) from what the router answered."""
    if "skipped" in case:
        return UNKNOWN, f"live negative case not sent: {case['skipped']}", case.get("remedy")
    length, pool = case["prompt_tokens_sent"], case["prefill_pool"]
    problem = _baseline_problem(case["baseline"])
    if problem:
        remedy = "--api-key KEY" if "--api-key" in problem else None
        return (
            UNKNOWN,
            (
                f"live: the baseline (a {case['baseline']['prompt_tokens_sent']}-token prompt that fits) "
                f"was not served: {problem}; the over-pool prompt was not sent, nothing judged"
            ),
            remedy,
        )
    replies = case["replies"]
    summary = ", ".join(f"{r['status']} in {r['seconds']} s" for r in replies)
    served = [r for r in replies if r["status"] == 200 and r["tokens"]]
    if served:
        full = sum(1 for r in served if r["prompt_tokens"] == length)
        faster = any(r["seconds"] < case["baseline"]["seconds"] for r in served)
        return FAIL, (f"live: a {length}-token prompt (prefill pool {pool}) got {summary}; "
                      f"{full} of {len(served)} answers report prompt_tokens={length}"
                      + ("; faster than a full prefill of a prompt that fits" if faster else "")
                      + ": served a prompt the prefill pool cannot hold (the incident's fingerprint)"), None
    rejected = [r for r in replies if r["status"] is not None and 400 <= r["status"] < 500 and not r["tokens"]
                and not r.get("error") and r["names_length"]]
    if replies and len(rejected) == len(replies):
        return (
            PASS,
            (
                f"live: the baseline was served; a {length}-token prompt (prefill pool {pool}) got "
                f"{summary}, "
                "each naming the input length: rejected"
            ),
            None,
        )
    reasons = sorted(
        {
            r.get("error")
            or (
                f"HTTP {r['status']} that does not name the input length ({length})"
                if r["status"] and 400 <= r["status"] < 500
                else f"HTTP {r['status']}"
            )
            for r in replies
            if r not in rejected
        }
    )
    return UNKNOWN, f"live: a {length}-token prompt got {summary}: no verdict ({'; '.join(reasons)})", None


def apply_live(results: tuple[GateResult, ...], url: str, *, count: int, limits: Limits,
               max_prompt: int = MAX_PROMPT_TOKENS) -> tuple[GateResult, ...]:
    """Gates 1 and 2 with the live negative case added (gate 1 from the router's workers when no
    --server was given)."""
    from backport.audit.gates import gate_pool_versus_context

    url = check_url(url, "--live")
    servers, listing = workers(url, limits)
    if listing and not servers:
        case = {"skipped": listing, **({"remedy": "--api-key KEY"} if "--api-key" in listing else {})}
    else:
        case = negative_case(url, servers, count, limits, max_prompt)
    verdict, line, remedy = judge(case)
    if remedy:
        case["remedy"] = remedy
    out = []
    for gate in results:
        if gate.gate == 1:
            if gate.servers:
                base = gate
            elif servers:
                base = gate_pool_versus_context(tuple(servers))
            else:  # the router's own error is in `line`
                base = dataclasses.replace(
                    gate, evidence=("no --server given and no worker read through the router",)
                )
            extra = (listing,) if listing and servers else ()
            out.append(dataclasses.replace(base, evidence=(*base.evidence, *extra, line),
                                           details={**base.details, "live": case}))
        elif gate.gate == 2:
            code_known = "code" in gate.details
            combined = worst((gate.verdict, verdict)) if code_known else verdict
            out.append(dataclasses.replace(gate, verdict=combined, evidence=(*gate.evidence, line),
                                           details={**gate.details, "live": case}))
        else:
            out.append(gate)
    return tuple(out)
