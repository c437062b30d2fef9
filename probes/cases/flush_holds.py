"""A flush while a deferred KV release holds pages (this pack's sbp-flush-holds; 0.5.23's rule).

Found on the live tier: decode flushed (``/flush_cache``) right after the router aborted a
rejected request, while the request's failed transfer was held by a deferred release (#35049,
on by default from #41023). ``Scheduler.flush_cache`` asks ``is_fully_idle``, which up to 0.5.22
does not count deferred holds, so the flush puts every page back on the free list; when the
drain ACKs arrive, the release frees the held pages a second time. A page listed twice can be
given to two requests; decode's idle check then stops the scheduler ("pool memory leak
detected", available above total).

How it is driven: the failed transfer of ``rigs.failed_transfer.TransferRig`` (the tree's real
``DecodeTransferQueue.pop_transferred`` and ``resolve_deferred_releases``, the real
``CommonKVReceiver``/``CommonKVManager`` ACK path), with
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1`` set as an operator of 0.5.19/0.5.20 who
asks for deferral does (the default from 0.5.21, and in the pack's pr41023 backport). Then the
tree's real ``Scheduler.flush_cache`` and ``is_fully_idle`` on a decode scheduler shell whose
batches and queues are empty (what decode looks like once the router's abort emptied its
transfer queue). Stand-ins: the page pool (``CountingTokenToKVPoolAllocator``, whose ``clear`` is
the pool's), the request pool, tree cache and grammar manager (inert), and the pipeline drain
check (one stage).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from .. import NotApplicable, Outcome, case, judged
from ..rigs.failed_transfer import TransferRig, drain_acking_manager, drain_acking_receiver, note_ack
from ..standins.scheduler import InertCollaborator, flush_cache

ROOM = 601


def _idle_decode_shell(rig: TransferRig) -> None:
    """The decode scheduler's own state, empty: nothing running, queued or being transferred."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    rig.shell.__dict__.update(
        disaggregation_mode=DisaggregationMode.DECODE,
        disagg_decode_transfer_queue=rig.queue,
        disagg_decode_prealloc_queue=SimpleNamespace(queue=[], retracted_queue=[]),
        running_batch=SimpleNamespace(is_empty=lambda: True, reqs=[]),
        last_batch=None,
        cur_batch_for_debug=None,
        cur_batch=None,  # its name up to 0.5.15.post1
        result_queue=deque(),
        dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False),
        grammar_manager=InertCollaborator("grammar_manager", grammar_queue=[]),
        grammar_queue=[],
        req_to_token_pool=InertCollaborator("req_to_token_pool"),
        tree_cache=InertCollaborator("tree_cache"),
        decode_offload_manager=None,
        draft_worker=None,
        enable_hierarchical_cache=False,
        enable_lmcache=False,
        _engine_paused=False,
        # one pipeline stage: nothing in flight between stages
        _pp_microbatches_drained=lambda: True,
    )


@case(
    proves=("sbp-flush-holds",),
    needs=("pr35049",),
    beyond_upstream=True,
    must_preserve=False,
    expect="/flush_cache while a deferred KV release holds a failed transfer's pages is refused: after both "
           "drain "
    "ACKs the pages are released once, no page is on the free list twice, and a flush after the release "
    "is accepted.",
)
def flush_during_deferred_hold_frees_nothing_twice(ctx) -> Outcome:
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    if not hasattr(DecodeTransferQueue, "has_pending_deferred_releases"):
        raise NotApplicable(
            "decode has no deferred KV release in this release (no #35049): no hold to flush over"
        )
    rig = TransferRig(ctx, deferred_env="1")
    mgr = drain_acking_manager(rig.ledger)
    rcv = drain_acking_receiver(rig.ledger, mgr, room=ROOM, prefill_ranks=2)
    req = rig.enqueue(rcv, "held-then-flushed", ROOM)
    rcv.abort()  # the router's abort of the rejected request reaches decode mid-transfer
    rig.queue.pop_transferred()
    if not getattr(rig.queue, "_deferred_releases", None):
        raise NotApplicable("the tree formed no deferred hold for the failed transfer (page_lifetime's cases "
                            "judge the hold itself)")
    _idle_decode_shell(rig)
    during = flush_cache(rig.shell)
    generation = getattr(rcv, "_abort_generation", None)
    for rank in (0, 1):
        note_ack(mgr, ROOM, rank, generation)
    rig.resolve()
    details: dict[str, Any] = {
        "flush_accepted_during_hold": during,
        "pages_freed_twice": sum(e.get("pages", 1) for e in rig.ledger.of("pages_double_release")),
        "pages_listed_twice": rig.pages.pages_listed_twice(),
        "available_tokens": rig.pages.available_size(),
        "pool_tokens": rig.pages.size,
        **rig.snapshot(req),
    }
    after = details["flush_accepted_after_release"] = flush_cache(rig.shell)
    problems = []
    if during:
        problems.append("the flush was accepted while the hold was pending")
    if details["pages_freed_twice"] or details["pages_listed_twice"]:
        problems.append(f"{details['pages_listed_twice']} page(s) on the free list twice "
                        f"(available {details['available_tokens']} of {details['pool_tokens']} tokens)")
    if details["pages_held"] or details["release_calls"] != 1:
        problems.append(f"the held pages were released {details['release_calls']} time(s), not once")
    if not after:
        problems.append("a flush after the release was still refused")
    return judged(problems, "Flush refused during the hold; pages released once after the drain ACKs; "
                            "the next flush accepted.", details)
