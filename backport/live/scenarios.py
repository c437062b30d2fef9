"""The live scenarios: what a client of a real PD deployment sees, judged per request.

Registered with `@scenario` as probe cases are with `@case`; the function's name is the
scenario's name, a contract (tests, bundles and REPORT.md use it). Each scenario sends its
requests through the router and returns an Outcome: verdict, what was observed, and details
(statuses, tokens, latency, the server log lines that matter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backport.live.deployment import DECODE_POOL, PREFILL_POOL, Deployment
from backport.live.model import PROMPTS, TinyModel
from backport.live.reply import Reply, WordTokenizer

SAFE, UNSAFE, ERROR, NOT_APPLICABLE = "safe", "unsafe", "error", "not-applicable"
# what the servers log about a rejected or short-prefilled request
FLUSH_HAZARD = ("this tree's decode frees a deferred hold's pages twice when flushed during the hold "
                "(sbp-flush-holds): the flush is not sent right after a refused request")
LOG_NEEDLES = ("exceeds the maximum allowed length", "#new-token: 1,", "Abort", "abort", "Traceback", "Error")


@dataclass
class Outcome:
    verdict: str
    observed: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    must_preserve: bool
    expect: str
    run: Callable[[Deployment, TinyModel], Outcome]


REGISTRY: list[Scenario] = []


def scenario(*, must_preserve: bool, expect: str):
    def register(run: Callable[[Deployment, TinyModel], Outcome]):
        if any(s.name == run.__name__ for s in REGISTRY):
            raise ValueError(f"live scenario {run.__name__} registered twice")
        REGISTRY.append(Scenario(run.__name__, must_preserve, expect, run))
        return run

    return register


def _refused(reply: Reply) -> bool:
    return reply.status is not None and 400 <= reply.status < 500 and not reply.tokens


def ask(dep: Deployment, model: TinyModel, prompt: str, **kw) -> Reply:
    """One request of a named prompt through the router; a text-only reply is read with the
    tiny model's tokenizer (reply.py), and one that cannot be read back is `recovered=False`."""
    return dep.generate(PROMPTS[prompt], tokenizer=WordTokenizer.load(model.path), **kw)


def _unreadable(*replies: Reply) -> bool:
    return any(r.status == 200 and not r.recovered for r in replies)


@scenario(must_preserve=True, expect="a prompt that fits gets 200 and exactly plain transformers' greedy tokens "
                                     "(so the prompt's KV moved from prefill to decode)")
def valid_prompt_matches_reference(dep: Deployment, model: TinyModel) -> Outcome:
    mark = dep.log_mark()
    reply = ask(dep, model, "valid")
    details = {"reply": reply.to_json(), "reference": model.reference["valid"],
               "log": dep.log_lines(mark, "Traceback", "Error")}
    if reply.status != 200 or not reply.recovered:
        return Outcome(ERROR, f"status {reply.status} for a valid 4-token prompt: {reply.error}", details)
    if reply.tokens != model.reference["valid"]:
        return Outcome(UNSAFE, "200 but the tokens differ from the reference: decode did not attend over "
                               "the prompt's KV", details)
    return Outcome(SAFE, "200 and the reference tokens", details)


@scenario(must_preserve=False, expect=f"a prompt within the context but above the prefill pool ({PREFILL_POOL} "
                                      "tokens) gets 400 and no tokens")
def over_pool_prompt_rejected(dep: Deployment, model: TinyModel) -> Outcome:
    mark = dep.log_mark()
    reply = ask(dep, model, "over_pool")
    details = {"reply": reply.to_json()}
    if dep.flush_frees_held_pages:
        details["decode_flush_skipped"] = FLUSH_HAZARD
    else:
        # the router sends the request to both sides at once: how long decode keeps what it
        # reserved (a deferred hold included) shows as how long its /flush_cache refuses
        held = dep.flush_decode()
        details["decode_flush_accepted_after_seconds"] = None if held is None else round(held, 3)
    details["log"] = dep.log_lines(mark, *LOG_NEEDLES)
    if _refused(reply):
        return Outcome(SAFE, f"{reply.status} in {reply.seconds:.2f} s, no tokens", details)
    if reply.status == 200:
        return Outcome(UNSAFE, f"200 with prompt_tokens={reply.prompt_tokens} and {len(reply.tokens)} tokens "
                               f"for a {len(PROMPTS['over_pool'])}-token prompt the prefill pool cannot hold",
                       details)
    return Outcome(ERROR, f"no verdict: status {reply.status} ({reply.error or 'no answer'})", details)


@scenario(must_preserve=False, expect="the over-pool request's answer never depends on an earlier request's prompt "
                                      "(it is refused, or its tokens are the same whatever came before)")
def rejected_request_reads_no_other_request(dep: Deployment, model: TinyModel) -> Outcome:
    """Decode flushed, earlier prompt A, the over-pool request R; flushed, B, R; flushed, A, R.
    Flushing before each earlier prompt makes decode's allocator hand R the slots A or B used.
    After a refused R the flush is left out: nothing of R's was served, so there are no slots of
    it to line up, and a flush during the hold its abort may leave is sbp-flush-holds' bug."""
    mark = dep.log_mark()
    steps = []
    rejected = None
    for earlier in ("earlier_a", "earlier_b", "earlier_a"):
        flush = rejected is None or rejected.status == 200
        flushed = dep.flush_decode() if flush else None
        first = ask(dep, model, earlier)
        rejected = ask(dep, model, "over_pool")
        steps.append({"earlier": earlier, "flush": "done" if flushed is not None else "refused" if flush else
                      "left out: the previous R was refused", "earlier_reply": first.to_json(),
                      "rejected_reply": rejected.to_json()})
    details = {"steps": steps, "log": dep.log_lines(mark, *LOG_NEEDLES)}
    replies = [s["rejected_reply"] for s in steps]
    if any(s["earlier_reply"]["status"] != 200 or s["flush"] == "refused" for s in steps):
        return Outcome(ERROR, "an earlier request failed or decode never accepted a flush: no verdict", details)
    if any(r.get("tokens_unrecoverable") for r in replies):
        return Outcome(ERROR, "200, but the reply's generated tokens cannot be read back (reply.py): no verdict",
                       details)
    if all(r["status"] is not None and 400 <= r["status"] < 500 and not r["tokens"] for r in replies):
        return Outcome(SAFE, "refused every time", details)
    after_a, after_b, after_a_again = (r["tokens"] for r in replies)
    if after_a != after_a_again:
        return Outcome(ERROR, "answers after the same earlier prompt differ: not deterministic, no verdict", details)
    if after_a != after_b:
        return Outcome(UNSAFE, "200, and the tokens differ after A and after B and repeat exactly after A: "
                               "the answer depends on another request's prompt", details)
    if after_a != model.reference["over_pool"]:  # same every time, but not the prompt's own answer
        return Outcome(ERROR, "answered with the same tokens after A and B, but not the reference tokens: "
                              "no verdict", details)
    return Outcome(SAFE, "answered with the reference tokens, the same after A and after B", details)


@scenario(must_preserve=False, expect="a prompt that fits prefill but not decode's pool is refused "
                                      "(DecodePreallocQueue.add)")
def over_decode_pool_prompt_rejected(dep: Deployment, model: TinyModel) -> Outcome:
    # A prompt that fits prefill but not decode needs decode's pool below prefill's input limit.
    # This pair's decode pool must hold the over-pool prompt (the leak needs it there), so no
    # prompt can drive the path on it; a second pair per tree is beyond the CI budget.
    return Outcome(NOT_APPLICABLE, f"not driven on this pair: decode's pool ({DECODE_POOL} tokens) is larger "
                                   f"than prefill's ({PREFILL_POOL}), so no prompt fits prefill and not decode",
                   {"prefill_pool": PREFILL_POOL, "decode_pool": DECODE_POOL})
