"""The check on decode's host receive (0.5.21+: the reservation is made after Success) and on a
restore from host memory. The probe: probes/cases/transfer_coverage/."""

from __future__ import annotations

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case
from ...rigs.coverage import DecodeSide, PrefillSide
from ...rigs.coverage_run import (
    commit_outcome,
    coverage_rig,
    refused,
    release_from_every_rank,
    run_ranks,
)
from ...rigs.host_memory import host_staged_handoff, restore_side
from ...standins import Ledger, sg
from ...standins.memory import patch_cache_helpers

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
    return commit_outcome(obs, "The complete host-staged handoff")


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

    from ... import tree_version

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
    from ...standins.hicache import evict_all

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
    return commit_outcome(obs, "The restored handoff (32 restored + 168 transferred tokens)")
