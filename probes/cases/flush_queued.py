"""A flush while decode's transfer queue holds a request's reserved pages (#12107; the pack's pr12107).

Found on the live tier: on 0.4.5.post1 - 0.5.4.post1 a patched decode accepted ``/flush_cache``
7-14 ms after the prefill door refused an over-pool request, while decode still held the 400-token
reservation it made for it; the router's abort then freed those tokens again ("memory leak
detected! max_total_num_tokens=512, available_size=912") and decode died. These releases' flush
asks only whether decode's running batch and waiting queue are empty, not its prealloc and
transfer queues (#12107, shipped in 0.5.4.post2, counts them). A page on the free list twice can
be given to two requests at once: the same harm as SBP-2026-0003, through another queue.

How it is driven: the tree's real ``Scheduler.flush_cache`` (and, from 0.5.4.post2, its
``_is_no_request``) on a decode scheduler shell with one request in its transfer queue; then the
router's abort ends the request and its pages go back. Stand-ins: the page pool
(``CountingTokenToKVPoolAllocator``), the request pool, tree cache and grammar manager (inert).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

from .. import NotApplicable, Outcome, case, judged, tree_version
from ..standins.scheduler import InertCollaborator, flush_cache, make_scheduler_shell

RESERVED_TOKENS = 400  # what the live tier saw decode hold for the refused over-pool request
PAGE_SIZE = 1


def _queued_decode_shell(ledger, pages, transfer_queue: list):
    """The tree's ``Scheduler`` (its real flush_cache and idle checks) on a decode with nothing
    waiting or running and one request in its transfer queue: decode after the prefill door refused
    an over-pool request, before the router's abort. Both spellings of these releases' idle state
    are given (flush_cache's own checks up to 0.5.4.post1, _is_no_request's from 0.5.4.post2)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return make_scheduler_shell(
        ledger,
        disaggregation_mode=DisaggregationMode.DECODE,
        disagg_decode_transfer_queue=SimpleNamespace(queue=transfer_queue),
        disagg_decode_prealloc_queue=SimpleNamespace(queue=[], retracted_queue=[]),
        running_batch=SimpleNamespace(is_empty=lambda: True, reqs=[]),
        running_mbs=[],
        pp_size=1,
        last_batch=None,
        cur_batch=None,
        result_queue=deque(),
        grammar_backend=None,
        grammar_manager=InertCollaborator("grammar_manager", grammar_queue=[]),
        grammar_queue=[],
        dllm_manager=SimpleNamespace(any_staging_reqs=lambda: False),  # 0.5.10 - 0.5.12.post1's idle check
        chunked_req=None,
        decode_offload_manager=None,
        enable_lmcache=False,
        draft_worker=None,
        req_to_token_pool=InertCollaborator("req_to_token_pool"),
        tree_cache=InertCollaborator("tree_cache"),
        token_to_kv_pool_allocator=pages,
        enable_hierarchical_cache=False,
    )


@case(
    proves=("pr12107",),
    needs=("<0.5.13",),
    must_preserve=False,
    expect="/flush_cache on a decode whose transfer queue holds a request's reserved pages is refused: when "
           "the "
    "request ends its pages go back once, no page is on the free list twice, and a flush after that is "
    "accepted; a prefill with a request in flight refuses too, a scheduler outside PD flushes.",
)
def flush_with_queued_transfer_frees_nothing_twice(ctx) -> Outcome:
    """Decode reserved pages for a request now in its transfer queue (the refused over-pool request
    of the live tier); /flush_cache arrives; then the router's abort ends the request, and the
    transfer queue gives its pages back (the stand-in pool's release: the pages the request's row
    names). The real ``Scheduler.flush_cache`` decides whether the flush clears the pool first."""
    from packaging.version import Version

    from ..standins import Ledger, prefill_bootstrap_queue_attr
    from ..standins.memory import CountingTokenToKVPoolAllocator

    if tree_version() >= Version("0.5.13"):
        raise NotApplicable("from 0.5.13 the idle check is is_fully_idle, which counts the PD queues "
                            "(flush_during_deferred_hold_frees_nothing_twice drives it)")

    ledger = Ledger()
    pages = CountingTokenToKVPoolAllocator(ledger, "decode", num_pages=512, page_size=PAGE_SIZE)
    rid = "refused-over-pool"
    pages.reserve(rid, RESERVED_TOKENS)
    queue = [SimpleNamespace(req=SimpleNamespace(rid=rid))]
    shell = _queued_decode_shell(ledger, pages, queue)
    during = flush_cache(shell)
    queue.clear()  # the router's abort: the request leaves the transfer queue ...
    pages.release(rid)  # ... and its pages go back to the pool
    details: dict[str, Any] = {
        "flush_accepted_while_queued": during,
        "pages_listed_twice": pages.pages_listed_twice(),
        "available_tokens": pages.available_size(),
        "pool_tokens": pages.size,
    }
    after = details["flush_accepted_after_release"] = flush_cache(shell)
    # The same rule on the other two sides: a prefill whose inflight queue holds a request (its pages
    # being sent) refuses, a scheduler outside PD with nothing queued flushes.
    from sglang.srt.disaggregation.utils import DisaggregationMode

    shell.disaggregation_mode = DisaggregationMode.PREFILL
    shell.disagg_prefill_inflight_queue = [SimpleNamespace(rid="being-sent")]
    setattr(shell, prefill_bootstrap_queue_attr(), SimpleNamespace(queue=[]))
    prefill_during = details["prefill_flush_accepted_while_inflight"] = flush_cache(shell)
    shell.disagg_prefill_inflight_queue = []
    shell.disaggregation_mode = DisaggregationMode.NULL
    plain = details["flush_accepted_outside_pd"] = flush_cache(shell)
    problems = []
    if during:
        problems.append("the flush was accepted while the transfer queue held a request")
    if prefill_during:
        problems.append("a prefill flushed while its inflight queue held a request")
    if not plain:
        problems.append("a scheduler outside PD with nothing queued refused the flush")
    if details["pages_listed_twice"]:
        problems.append(f"{details['pages_listed_twice']} page(s) on the free list twice (available "
                        f"{details['available_tokens']} of {details['pool_tokens']} tokens)")
    if not after:
        problems.append("a flush with every queue empty was refused")
    return judged(problems, "Flush refused while the transfer queue held the request; its pages returned "
                            "once; the next flush accepted.", details)
