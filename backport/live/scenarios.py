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

from backport.live import load, traffic
from backport.live.deployment import DECODE_POOL, DEFERRED_RELEASE_TIMEOUT, PREFILL_POOL, Deployment
from backport.live.model import PROMPTS, TinyModel
from backport.live.reply import Reply, WordTokenizer
from backport.vocab import TreeVerdict

SAFE, UNSAFE = TreeVerdict.SAFE, TreeVerdict.UNSAFE
ERROR, NOT_APPLICABLE = TreeVerdict.ERROR, TreeVerdict.NOT_APPLICABLE
# what the servers log about a rejected or short-prefilled request
FLUSH_HAZARD = ("this tree's decode frees a deferred hold's pages twice when flushed during the hold "
                "(sbp-flush-holds): the flush is not sent right after a refused request")
# 0.5.22 holds a refused request's reservation up to its deferred-release timeout; the rest is the
# scheduler loop's and the polling's slack on two loaded cores
RESERVATION_BOUND = DEFERRED_RELEASE_TIMEOUT + 15.0
REFUSED_IN_A_ROW = 2  # two 400-token reservations do not fit decode's 512: the second must wait for the first
LOG_NEEDLES = ("exceeds the maximum allowed length", "#new-token: 1,", "Abort", "abort", "Traceback", "Error")


@dataclass
class Outcome:
    verdict: TreeVerdict
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


@scenario(
    must_preserve=True,
    expect="a prompt that fits gets 200 and exactly plain transformers' greedy tokens "
    "(so the prompt's KV moved from prefill to decode)",
)
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


@scenario(
    must_preserve=False,
    expect=f"a prompt within the context but above the prefill pool ({PREFILL_POOL} "
    "tokens) gets 400 and no tokens",
)
def over_pool_prompt_rejected(dep: Deployment, model: TinyModel) -> Outcome:
    mark = dep.log_mark()
    reply = ask(dep, model, "over_pool")
    details: dict[str, Any] = {"reply": reply.to_json()}
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


@scenario(
    must_preserve=False,
    expect="the over-pool request's answer never depends on an earlier request's prompt "
    "(it is refused, or its tokens are the same whatever came before)",
)
def rejected_request_reads_no_other_request(dep: Deployment, model: TinyModel) -> Outcome:
    """Decode flushed, earlier prompt A, the over-pool request R; flushed, B, R; flushed, A, R.
    Flushing before each earlier prompt makes decode's allocator hand R the slots A or B used.
    After a refused R the flush is left out: nothing of R's was served, so there are no slots of
    it to line up, and a flush during the hold its abort may leave is sbp-flush-holds' bug."""
    mark = dep.log_mark()
    steps: list[dict[str, Any]] = []
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
        return Outcome(
            ERROR, "an earlier request failed or decode never accepted a flush: no verdict", details
        )
    if any(r.get("tokens_unrecoverable") for r in replies):
        return Outcome(
            ERROR, "200, but the reply's generated tokens cannot be read back (reply.py): no verdict", details
        )
    if all(r["status"] is not None and 400 <= r["status"] < 500 and not r["tokens"] for r in replies):
        return Outcome(SAFE, "refused every time", details)
    after_a, after_b, after_a_again = (r["tokens"] for r in replies)
    if after_a != after_a_again:
        return Outcome(
            ERROR, "answers after the same earlier prompt differ: not deterministic, no verdict", details
        )
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
    return Outcome(
        NOT_APPLICABLE,
        f"not driven on this pair: decode's pool ({DECODE_POOL} tokens) is larger "
        f"than prefill's ({PREFILL_POOL}), so no prompt fits prefill and not decode",
        {"prefill_pool": PREFILL_POOL, "decode_pool": DECODE_POOL},
    )


@scenario(
    must_preserve=False,
    expect="after refused over-pool requests decode's tokens in use return to the "
    f"idle baseline within {RESERVATION_BOUND:.0f} s (0.5.22's deferred-release "
    "timeout and slack) and the next valid prompt gets the reference tokens",
)
def rejected_request_releases_decode_reservation(dep: Deployment, model: TinyModel) -> Outcome:
    """The router sends each request to both sides at once, so decode reserves pages for a prompt
    prefill then refuses. Baseline: decode idle (holds of earlier scenarios run out first); then
    the over-pool request twice in a row; decode's load polled until back at the baseline; a
    valid prompt; then (measured, judged only on wrong tokens) a seeded mix of valid and
    over-pool prompts at concurrency 3 against valid prompts alone."""
    details: dict[str, Any] = {"bound_seconds": RESERVATION_BOUND}
    url = dep.decode.url
    exposed = load.read_load(url)
    baseline = None
    if exposed is None:
        details["decode_load"] = ("decode exposes no load (no /v1/loads or /get_load): judged only by the "
                                  "next valid prompt")
    else:
        _, readings = load.wait_for(url, 0, RESERVATION_BOUND)
        baseline = readings[-1][1] if readings else exposed.tokens
        details.update(decode_load=exposed.source, baseline_tokens=baseline, baseline_readings=readings)
    mark = dep.log_mark()
    refused = [ask(dep, model, "over_pool") for _ in range(REFUSED_IN_A_ROW)]
    details["refused"] = [r.to_json() for r in refused]
    if any(r.status == 200 for r in refused):
        return Outcome(
            NOT_APPLICABLE,
            "the over-pool prompt is served, not refused: no refused request whose "
            "reservation could be held (over_pool_prompt_rejected judges that)",
            details,
        )
    if not all(_refused(r) for r in refused):
        details["log"] = dep.log_lines(mark, *LOG_NEEDLES)
        return Outcome(
            ERROR,
            f"the over-pool prompt got {[r.status for r in refused]}, not a refusal: no verdict",
            details,
        )
    held = None
    if baseline is not None:
        held, readings = load.wait_for(url, baseline, RESERVATION_BOUND)
        details.update(released_after_seconds=None if held is None else round(held, 2), readings=readings)
    after = ask(dep, model, "valid")
    details["next_valid"] = after.to_json()
    details["log"] = dep.log_lines(mark, *LOG_NEEDLES)
    if baseline is not None and held is None:
        holds = (
            f"still holds {readings[-1][1] - baseline} tokens" if readings else "no longer reports its load"
        )
        return Outcome(
            UNSAFE, f"decode {holds} {RESERVATION_BOUND:.0f} s after the refused requests", details
        )
    if after.status is None or after.status >= 500:
        return Outcome(
            UNSAFE,
            f"decode stopped serving: the next valid prompt got {after.status or 'no answer'} "
            f"({after.error[:120]})",
            details,
        )
    if after.status != 200 or not after.recovered:
        return Outcome(
            ERROR, f"the next valid prompt got {after.status} ({after.error[:120]}): no verdict", details
        )
    if after.tokens != model.reference["valid"]:
        return Outcome(UNSAFE, "the next valid prompt got other tokens than the reference", details)
    details["concurrent_cost"] = _reservation_cost(dep, model)
    if details["concurrent_cost"]["mix"]["valid_wrong_tokens"]:
        return Outcome(UNSAFE, "under the mix of valid and over-pool prompts a valid prompt got other tokens "
                               "than the reference", details)
    released = "" if held is None else f"decode's load back at its baseline after {held:.1f} s, "
    return Outcome(
        SAFE,
        f"refused {REFUSED_IN_A_ROW} times; {released}the next valid prompt got the reference tokens",
        details,
    )


def _reservation_cost(dep: Deployment, model: TinyModel) -> dict:
    """Valid prompts alone, then the seeded mix (traffic.py); the aborts decode logged meanwhile."""
    def send(kind: str, timeout: float) -> Reply:
        return ask(dep, model, kind, timeout=timeout)

    reference = model.reference["valid"]
    valid_only = traffic.run(send, ["valid"] * traffic.VALID_ONLY, reference)
    since = dep.log_mark()["decode"]
    mix = traffic.run(send, traffic.plan(), reference)
    return {"concurrency": traffic.CONCURRENCY, "seed": traffic.SEED, "valid_only": valid_only, "mix": mix,
            "decode_abort_lines_during_mix": _count_lines(dep.decode.log, since, "abort")}


def _count_lines(path, offset: int, needle: str) -> int:
    """Lines of a log after `offset` that contain `needle` (any case)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return sum(needle in line.lower() for line in f.read().decode(errors="replace").splitlines())
    except OSError:
        return 0


# Registered last, so it runs after every other scenario of the pair: a route it poisons on a pristine
# tree is put back, and decode has cached the real entry by then (bootstrap.py says why both matter).
from backport.live import bootstrap  # noqa: E402, F401 - registers bootstrap_route_poisoning_refused
