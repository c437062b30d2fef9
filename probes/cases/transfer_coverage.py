"""The transferred-coverage check (this pack's own fix ``sbp-transfer-coverage``;
design reference #38704; incident gate 3, "transfer covers read").

Decode attends over exactly the tokens it reserved, so the KV written for a
request must cover all of them. The check: prefill records, with the last
chunk's metadata, how far the KV it wrote reaches; decode's metadata gate
refuses a request whose recorded coverage is short of its reservation (or
missing: an unpatched peer) before the polls' MIN all-reduce, so every
attention-TP rank refuses it together; the refusal is a 500, the pages are
released, a counter and a log line say so.

How it is driven: prefill's real ``send_kv_chunk`` (each chunk, with the
tree's ``MetadataBuffers`` on CPU) and decode's real ``DecodeTransferQueue``
(its constructor, ``pop_transferred``, ``_poll_with_metadata_gate`` and
``_commit_transfer_to_req``), on one rank or two. Stand-ins: the RDMA write
of the metadata row (a row copy between the two ``MetadataBuffers``), the KV
page write itself (nothing to check on a CPU: the pages are counted), the
transport poll (``KVPoll.Success``: the transfer completed), the gloo
all-reduce (two threads meeting at a barrier take the MIN), decode's
preallocation (the reservation is the tree's own ``_pre_alloc_fill_len``,
recorded in ``kv_committed_len`` as ``_pre_alloc`` does), the page pools
(CountingTokenToKVPoolAllocator) and the output streamer. The rig: probes/rigs/coverage.py and
probes/rigs/host_memory.py.

The refusal cases are unsafe on every release without the fix (a short
handoff is committed and decoded: HTTP 200 over stale pages). The
must-preserve cases are the legitimate handoffs #38704 names: a cached
prefix (prefill's prefix cache and decode's own), chunked prefill, a
rebootstrap with output tokens, a retracted request, a speculative (EAGLE)
handoff with its draft metadata, and attention-TP ranks committing together.
"""

from __future__ import annotations

import inspect
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case
from probes.rigs.coverage import (
    DecodeSide,
    PrefillSide,
    coverage_rig,
    one_handoff,
    refused,
    release_from_every_rank,
    require_coverage_slot,
    run_ranks,
    set_reservation,
    tree_fill_len,
)
from probes.rigs.host_memory import host_staged_handoff, restore_side
from probes.standins import Ledger, drop_kv_row, give_kv_row, sg
from probes.standins.memory import patch_cache_helpers


def _refusal(obs: dict[str, Any], what: str, must_say: str) -> Outcome:
    if refused(obs) and must_say in (obs["refusal_message"] or ""):
        return Outcome(
            SAFE, f"{what} refused: 500, pages released once, counter {obs['refusal_counter']}.", obs
        )
    if obs["committed"]:
        return Outcome(
            UNSAFE,
            f"{what} committed: decode would attend over {obs['reserved_tokens']} reserved "
            f"tokens with {obs['prefill_last_chunk_tokens']} written.",
            obs,
        )
    return Outcome(UNSAFE, f"{what} not refused cleanly (status, release or message).", obs)


def _commit(obs: dict[str, Any], what: str) -> Outcome:
    if obs["committed"] and obs["finish"] is None and obs["pages_held"] > 0 and not obs["release_calls"]:
        return Outcome(SAFE, f"{what} committed: coverage {obs['recorded_coverage']} for "
                             f"{obs['reserved_tokens']} reserved.", obs)
    return Outcome(UNSAFE, f"{what} was not committed.", obs)


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
    return _refusal(obs, "The short handoff (1 of 640 tokens)", "short of the reservation")


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
    return _refusal(obs, "The handoff without recorded coverage", "no transferred KV coverage")


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
    return _commit(obs, "The complete handoff")


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
    return _commit(obs, "The handoff after a 64-token decode-held prefix and a 128-token prefill cache hit")


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
    return _commit(obs, "The three-chunk handoff")


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
    return _commit(obs, "The rebootstrap (100 prompt + 5 output tokens)")


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
    return _commit(obs, "The retracted request's new handoff")


@case(
    needs=(">=0.5.3",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A speculative (EAGLE) handoff, whose metadata carries the draft model's hidden states and top-k, "
           "is committed.",
)
def speculative_transfer_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="spec", room=616, spec=True)
    return _commit(obs, "The EAGLE handoff")


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


# --- decode host receive (0.5.21+): the reservation is made after Success ---


# --- decode host receive (0.5.21+): the reservation is made after Success ---


@case(
    proves=("sbp-transfer-coverage",),
    needs=(">=0.5.21",),
    beyond_upstream=True,
    must_preserve=False,
    expect="With decode host receive, a host-staged handoff whose recorded coverage is short of the prompt "
           "decode will reserve for it is refused (500, never committed, no device pages reserved, host "
           "pages held for the drain), not compared with the still-unset kv_committed_len.",
)
def host_staged_short_coverage_refused(ctx) -> Outcome:
    """The incident's 1-token handoff into host pages staged for a 640-token prompt."""
    obs = host_staged_handoff(ctx, prompt_tokens=640, prefill_tokens=1, rid="host-short", room=631)
    finish = obs["finish"] or {}
    refused_cleanly = (
        not obs["committed"] and finish.get("type") == "FINISH_ABORT"
        and int(finish.get("status_code") or 0) >= 500 and len(obs["streamed"]) == 1
        and not obs["device_reservations"] and obs["pages_held"] == 0
        and (obs["held_for_drain"] or obs["host_released"] == 1)
        and "short of the reservation" in (obs["refusal_message"] or "")
    )
    if refused_cleanly:
        return Outcome(
            SAFE,
            "The short host-staged handoff (1 of 640 tokens) refused: 500, no device pages "
            f"reserved, host pages {'held for the drain ACK' if obs['held_for_drain'] else 'released once'}.",
            obs,
        )
    if obs["committed"]:
        return Outcome(
            UNSAFE,
            f"The short host-staged handoff committed: decode reserved {obs['reserved_tokens']} "
            f"device tokens after Success with {obs['prefill_last_chunk_tokens']} written.",
            obs,
        )
    return Outcome(
        UNSAFE, "The short host-staged handoff not refused cleanly (status, pages or message).", obs
    )


@case(
    needs=(">=0.5.21",),
    beyond_upstream=True,
    must_preserve=True,
    expect="With decode host receive, a complete host-staged handoff is committed with the device pages "
           "allocate_host_staged reserves.",
)
def host_staged_full_coverage_committed(ctx) -> Outcome:
    obs = host_staged_handoff(ctx, prompt_tokens=200, prefill_tokens=200, rid="host-full", room=632)
    return _commit(obs, "The complete host-staged handoff")


def _restore_rig_or_skip(*, refusal: bool = True) -> None:
    import importlib.util

    from sglang.srt.disaggregation import decode, utils

    if refusal and not hasattr(utils, "transfer_coverage_error"):
        raise NotApplicable(
            "this tree has no transferred-coverage check, so no refusal to take the Failed path"
        )
    fields = getattr(decode.DecodeRequest, "__dataclass_fields__", {})
    if (not hasattr(decode, "HiCacheRestoreGatedKVReceiver") or "hicache_restored_node" not in fields
            or importlib.util.find_spec("sglang.srt.mem_cache.hiradix_cache") is None):
        raise NotApplicable("decode has no HiCache restore by hicache_restored_node in this release")
    if {"hicache_restore_lock_receipt", "hicache_restore_lock"} & set(fields):
        raise NotApplicable("decode releases the restore through lock receipts here (0.5.20+), "
                            "which this rig does not build")
    from packaging.version import Version

    from probes import tree_version

    if tree_version() < Version("0.5.16"):
        raise NotApplicable(
            "before 0.5.16 decode's restore state machine differs from the one this rig drives"
        )


@case(
    proves=("sbp-transfer-coverage",),
    needs=("sbp-transfer-coverage", ">=0.5.16,<0.5.20"),
    beyond_upstream=True,
    must_preserve=False,
    expect="When the coverage check on one attention-TP rank refuses a request while another rank's HiCache "
           "load-back for it is still copying, that rank's Failed path (_clean_hicache_prefetch_resources) "
           "releases only decode's own lock: the tree's in-flight lock keeps the copy's device pages from "
           "eviction and reuse until the copy finishes, then they are reclaimed.",
)
def refusal_during_pending_restore_keeps_restore_pages(ctx) -> Outcome:
    """Rank 0 sees 16 of 200 tokens (refused); rank 1's restore is PENDING with
    its copy running, so rank 1 learns of the refusal only through the MIN
    all-reduce. Then memory pressure evicts everything evictable, before and
    after the copy finishes (the tree's real ``evict`` and ``loading_check``).
    0.5.20+ releases the restore through lock receipts, which this rig does not build."""
    from probes.standins.hicache import evict_all

    _restore_rig_or_skip()
    collective = coverage_rig(ctx, ranks=2)
    ledger = Ledger()
    plain = DecodeSide(ctx, ledger, rank=0)
    restoring, rdreq, hc = restore_side(ctx, ledger, 1, 200, 641)
    release_from_every_rank(ctx, ledger, (plain, restoring))
    pdreq = plain.expect("restore-r0", 641, 200)
    for side, dreq, written, prefix in ((plain, pdreq, 16, 0), (restoring, rdreq, 200, 32)):
        prefill = PrefillSide(ctx, ledger)
        side.land(prefill, prefill.handoff(f"p-{dreq.req.rid}", written, 641, decode_prefix=prefix), dreq)
    results = run_ranks([plain, restoring], collective)
    outcome = restoring.outcome(rdreq, results[1])
    outcome["streamed"] = [s["finish"] for s in ledger.of("stream", rid=rdreq.req.rid)]
    outcome["release_calls"] = ledger.count("release_kv_cache", rid=rdreq.req.rid)
    evicted_while_copying = evict_all(hc)
    freed_while_copying = sorted(set(hc.pages.freed) & set(hc.restore_pages))
    hc.dma.done = True
    hc.tree.loading_check()
    evicted_after = evict_all(hc)
    freed_after = sorted(set(hc.pages.freed) & set(hc.restore_pages))
    details = {
        "rank1": outcome,
        "rank0": plain.outcome(pdreq, results[0]),
        "rank0_committed": any(r is pdreq.req for r in results[0]),
        "node_lock_after_refusal_and_copy": hc.node.lock_ref,
        "evicted_while_copying": evicted_while_copying,
        "restore_pages_freed_while_copying": freed_while_copying,
        "evicted_after_copy": evicted_after,
        "restore_pages_freed_after_copy": len(freed_after),
    }
    if not refused(outcome) or details["rank0_committed"]:
        return Outcome(UNSAFE, "The refusal did not reach the restoring rank's Failed path cleanly.", details)
    if freed_while_copying:
        return Outcome(
            UNSAFE,
            f"{len(freed_while_copying)} restore pages were freed for reuse while the load-back "
            "still copied into them.",
            details,
        )
    if len(freed_after) != len(hc.restore_pages):
        return Outcome(
            UNSAFE, "The restore pages were never reclaimed after the copy finished (a leak).", details
        )
    return Outcome(
        SAFE,
        f"The restoring rank refused on the MIN; its {len(hc.restore_pages)} restore pages stayed "
        "locked by the tree's in-flight load-back until the copy finished, then were reclaimed.",
        details,
    )


@case(
    needs=(">=0.5.16,<0.5.20",),
    beyond_upstream=True,
    must_preserve=True,
    expect="A complete handoff whose decode HiCache restore is pending is held until the load-back finishes "
           "and then committed with the restored prefix.",
)
def restored_handoff_committed(ctx) -> Outcome:
    _restore_rig_or_skip(refusal=False)
    collective = coverage_rig(ctx)
    ledger = Ledger()
    side, dreq, hc = restore_side(ctx, ledger, 0, 200, 642)
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), side.pages)
    prefill = PrefillSide(ctx, ledger)
    side.land(prefill, prefill.handoff("p-restore", 200, 642, decode_prefix=32), dreq)
    while_copying = side.pop(collective)
    hc.dma.done = True
    committed = side.pop(collective)
    obs = side.outcome(dreq, committed)
    obs["committed_while_copying"] = any(r is dreq.req for r in while_copying)
    obs["restore_written"] = ledger.count("restore_written")
    if obs["committed_while_copying"]:
        return Outcome(UNSAFE, "The handoff was committed while its load-back still copied.", obs)
    if obs["restore_written"] != 1:
        return Outcome(UNSAFE, "The restored prefix was not installed in the request's row.", obs)
    return _commit(obs, "The restored handoff (32 restored + 168 transferred tokens)")
