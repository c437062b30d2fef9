"""Final results that must send no KV (a grammar rejects the sampled token) or must (a valid request).
The probe: probes/cases/prefill_retire/."""

from __future__ import annotations

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case
from ...rigs.retire import SAMPLED_TOKEN, RetireRig, retire_verdict, retired_once


class _RejectingGrammar:
    """Stands for a constrained-decoding grammar object that rejects the
    sampled token (``accept_token`` raises ``ValueError``, as the grammar
    backends do); records that it was asked."""

    def __init__(self) -> None:
        self.finished = False
        self.accept_calls = 0

    def accept_token(self, token: int) -> None:
        self.accept_calls += 1
        raise ValueError(f"token {token} is not allowed by the grammar")


@case(
    proves=("pr36988",),
    needs=(">=0.4.9.post5",),
    must_preserve=False,
    expect="A final prefill result whose sampled token the grammar rejects is retired before any KV chunk is "
           "sent: not cached, not queued, sender aborted, metadata buffer freed, KV released once without "
           "insert, the abort streamed once.",
)
def grammar_rejected_result_sends_no_kv(ctx) -> Outcome:
    """#36988 as 0.5.20 orders it: the grammar check runs before the final
    result is cached, queued or sends its last chunk, and a request whose
    token it rejects (``prepare_abort``, HTTP 500) is retired with no KV
    chunk sent. Before, the last chunk went out and the rejection came after."""
    rig = RetireRig(ctx)
    req = rig.prefilled_req("grammar-rejected", 64, room=306)
    grammar = _RejectingGrammar()
    req.grammar = grammar
    try:
        rig.deliver_result([req])
    except ValueError as exc:
        if not grammar.accept_calls or "not allowed by the grammar" not in str(exc):
            raise
        raise NotApplicable(
            "the prefill result path does not handle a grammar's rejection of the sampled "
            "token in this release (accept_token's ValueError escapes it; handled from 0.4.9.post5)"
        ) from None
    if not grammar.accept_calls:
        raise NotApplicable(
            "process_batch_result_disagg_prefill does not check the sampled token against a grammar in this "
            "release"
        )
    obs = rig.observe(req)
    # The sampled token is appended before the check in 0.5.20 as well.
    problems = [p for p in retired_once(obs) if p != "sampled token appended"]
    if not obs["sender_aborted"]:
        problems.append("sender not aborted")
    return retire_verdict(
        problems,
        "The grammar rejection retired the request before any KV chunk: not cached, not queued, released "
        "once, abort streamed once.",
        obs,
    )


@case(
    must_preserve=True,
    expect='A valid finished request is cached, queued for transfer and sends its last KV chunk; nothing is '
           'released or streamed.',
)
def valid_finished_request_sends_kv(ctx) -> Outcome:
    """Must-preserve: a valid finished prefill keeps its token, is cached,
    queued for transfer and sends its last KV chunk; nothing is released or
    streamed yet."""
    rig = RetireRig(ctx)
    req = rig.prefilled_req("valid", 64, room=305)
    rig.deliver_result([req])
    obs = rig.observe(req)
    ok = (
        obs["cache_unfinished_calls"] == 1
        and obs["queued_for_transfer"]
        and rig.ledger.count("send_kv_chunk", rid=req.rid, last_chunk=True) == 1
        and rig.ledger.of("send_kv_chunk", rid=req.rid)[0]["tokens"] == 64
        and obs["release_kv_cache_calls"] == 0
        and not obs["streamed"]
        and obs["output_ids"] == [SAMPLED_TOKEN]
        and not obs["sender_aborted"]
    )
    if ok:
        return Outcome(SAFE, "The valid request was cached, queued and sent its 64-token last chunk.", obs)
    return Outcome(UNSAFE, "The valid request did not take the normal transfer path.", obs)

