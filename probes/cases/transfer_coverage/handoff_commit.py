"""The check on decode's device receive: short coverage or an unpatched peer refused, every complete
handoff committed (cached prefix, chunked prefill, rebootstrap, retraction, speculative, TP ranks).
The probe: probes/cases/transfer_coverage/."""

from __future__ import annotations

import inspect

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case
from ...rigs.coverage import DecodeSide, PrefillSide, set_reservation, tree_fill_len
from ...rigs.coverage_run import (
    commit_outcome,
    coverage_rig,
    one_handoff,
    refusal_outcome,
    refused,
    release_from_every_rank,
    require_coverage_slot,
    run_ranks,
)
from ...standins import Ledger, drop_kv_row, give_kv_row

# ---------------------------------------------------------------------------


@case(
    proves=("sbp-transfer-coverage",),
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=False,
    expect="A handoff whose recorded KV coverage is short of decode's reservation is refused at decode: HTTP "
           "500, never committed, pages released once, counted.",
)
def short_coverage_refused(ctx) -> Outcome:
    """The incident's handoff: decode reserved 640 tokens, prefill wrote a
    1-token sequence (the stub of a rejected prompt) and signalled complete."""
    obs = one_handoff(ctx, decode_tokens=640, prefill_tokens=1, rid="short", room=601)
    return refusal_outcome(obs, "The short handoff (1 of 640 tokens)", "short of the reservation")


@case(
    proves=("sbp-transfer-coverage",),
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=False,
    expect="A handoff from a prefill that recorded no coverage (an unpatched peer) is refused and reported "
           "as such, never silently committed.",
)
def unpatched_peer_refused(ctx) -> Outcome:
    """The metadata row as an unpatched prefill writes it: slot 7 never set."""
    obs = one_handoff(
        ctx, decode_tokens=200, prefill_tokens=200, rid="unpatched", room=602, erase_coverage=True
    )
    return refusal_outcome(obs, "The handoff without recorded coverage", "no transferred KV coverage")


@case(
    proves=("sbp-transfer-coverage",),
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=False,
    expect="When one attention-TP rank sees a short coverage, every rank refuses the request together; none "
           "commits it alone.",
)
def tp_ranks_refuse_together(ctx) -> Outcome:
    """Two decode ranks: rank 0's metadata shows full coverage, rank 1's a short one."""
    return _two_ranks(ctx, short_on_rank1=True)


@case(
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A complete handoff is committed with its pages.",
)
def full_coverage_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="full", room=611)
    return commit_outcome(obs, "The complete handoff")


@case(
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A handoff with a cached prefix (prefill's prefix cache hit, and a prefix decode already holds, "
           "so prefill sends only the rest) is committed.",
)
def cached_prefix_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="prefix", room=612,
                      decode_prefix=64, cached_prefix=128)
    return commit_outcome(
        obs, "The handoff after a 64-token decode-held prefix and a 128-token prefill cache hit")


@case(
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A chunked prefill's handoff (several chunks, the last one completing it) is committed.",
)
def chunked_prefill_committed(ctx) -> Outcome:
    obs = one_handoff(
        ctx, decode_tokens=200, prefill_tokens=200, rid="chunked", room=613, chunk_ends=(64, 128)
    )
    return commit_outcome(obs, "The three-chunk handoff")


def _rebootstrap_or_skip():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    fill = getattr(DecodePreallocQueue, "_pre_alloc_fill_len", None)
    if fill is None or "pd_rebootstrap_in_progress" not in inspect.getsource(fill):
        raise NotApplicable("decode has no PD rebootstrap in this release")


@case(
    needs=(">=0.5.16",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A rebootstrap with output tokens (decode reserves prompt + emitted tokens, prefill recomputes "
           "them all) is committed.",
)
def rebootstrap_output_tokens_committed(ctx) -> Outcome:
    _rebootstrap_or_skip()
    obs = one_handoff(ctx, decode_tokens=100, prefill_tokens=105, rid="rebootstrap", room=614,
                      output_ids=(11, 12, 13, 14, 15), rebootstrap=True)
    return commit_outcome(obs, "The rebootstrap (100 prompt + 5 output tokens)")


@case(
    needs=(">=0.5.16",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A request that was retracted (its KV state reset by reset_for_retract) and handed off again is "
           "committed.",
)
def retracted_request_committed(ctx) -> Outcome:
    _rebootstrap_or_skip()

    def retract(req) -> None:  # the state retraction leaves, then decode's new reservation
        reserved = tree_fill_len(req)
        drop_kv_row(req)  # retraction released the request's KV first
        req.reset_for_retract()
        req.pd_rebootstrap_in_progress = True
        give_kv_row(req, 0, reserved)
        set_reservation(req, reserved)

    obs = one_handoff(ctx, decode_tokens=120, prefill_tokens=120, rid="retracted", room=615, rebootstrap=True,
                      before_commit=retract)
    return commit_outcome(obs, "The retracted request's new handoff")


@case(
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A speculative (EAGLE) handoff, whose metadata carries the draft model's hidden states and top-k, "
           "is committed.",
)
def speculative_transfer_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="spec", room=616, spec=True)
    return commit_outcome(obs, "The EAGLE handoff")


@case(
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=True,
    expect="Two attention-TP ranks that both see a complete handoff commit it together.",
)
def tp_ranks_commit_together(ctx) -> Outcome:
    return _two_ranks(ctx, short_on_rank1=False)


def _two_ranks(ctx, *, short_on_rank1: bool) -> Outcome:
    require_coverage_slot()
    collective = coverage_rig(ctx, ranks=2)
    ledger = Ledger()
    sides = [DecodeSide(ctx, ledger, rank=r) for r in range(2)]
    release_from_every_rank(ctx, ledger, sides)
    prefills = [PrefillSide(ctx, ledger) for _ in range(2)]
    obs = []
    decode_reqs = [s.expect(f"tp-r{s.rank}", 621, 200) for s in sides]
    for r, (side, prefill, dreq) in enumerate(zip(sides, prefills, decode_reqs)):
        written = 16 if (short_on_rank1 and r == 1) else 200
        preq = prefill.handoff(f"p-tp-r{r}", written, 621)
        side.land(prefill, preq, dreq)
    results = run_ranks(sides, collective)
    for side, dreq, committed in zip(sides, decode_reqs, results):
        o = side.outcome(dreq, committed)
        o["streamed"] = [s["finish"] for s in ledger.of("stream", rid=dreq.req.rid)]
        o["release_calls"] = ledger.count("release_kv_cache", rid=dreq.req.rid)
        obs.append(o)
    details = {"ranks": obs}
    committed = [o["committed"] for o in obs]
    if short_on_rank1:
        if not any(committed) and all(refused(o) for o in obs):
            return Outcome(SAFE, "Both ranks refused the request (rank 1 saw 16 of 200 tokens).", details)
        if all(committed):
            return Outcome(
                UNSAFE, "Both ranks committed although rank 1's KV covers 16 of 200 tokens.", details
            )
        return Outcome(UNSAFE, f"The ranks disagreed (committed per rank: {committed}).", details)
    if all(committed) and all(o["finish"] is None for o in obs):
        return Outcome(SAFE, "Both ranks committed the complete handoff.", details)
    return Outcome(UNSAFE, f"The ranks did not both commit (committed per rank: {committed}).", details)

