"""The tree cache's own release of an aborted prefill request (#36988 on 0.5.1 - 0.5.5).

#36988 releases an aborted request's KV without inserting its prefix. Up to 0.5.5 no release
helper counts what a request's forwards wrote (0.5.5.post1's ``release_kv_cache`` and tree caches
read the committed KV length): the tree caches count a request's KV by its prompt. Two ways a
backport goes wrong there, each a case here on the tree's real release code:

- ``aborted_middle_chunk_frees_only_written_slots``: an aborted request's middle chunk is its last
  in-flight result. Its forwards wrote the row up to ``fill_ids``; the row past that still names
  the slots of whatever request held the row before. A release that reads the row to the prompt's
  end frees those slots, which another request may own: the allocator then hands them out twice.
- ``hybrid_aborted_result_not_inserted``: ``MambaRadixCache`` (from 0.5.3.post2; a hybrid GDN model
  serves PD with it from 0.5.4, 0.5.3.post2 refuses the combination at start) takes ``is_insert``
  only from 0.5.4.post3: passing it raises ``TypeError`` in the scheduler, leaving it out inserts
  the aborted prefix.

How it is driven: as ``prefill_retire`` (the tree's real ``process_batch_result_disagg_prefill``
on a scheduler shell, real ``GenerationBatchResult`` and ``Req``), with the scheduler's tree cache
the tree's real ``RadixCache`` / ``MambaRadixCache`` release over stand-in pools, and the tree's
own ``release_kv_cache`` where the patched tree has one (0.5.1 - 0.5.3.post1). The radix tree's
``insert`` is recorded, not built; the request-to-token pool is a CPU tensor of slot numbers; the
slot allocator records which slots come back.
"""

from __future__ import annotations

from typing import Any

from .. import NotApplicable, Outcome, case, judged
from ..rigs.retire import RetireRig
from ..standins import Ledger, mark_aborted, sg, sg_attr

ROW = 0
OTHER_REQUEST_SLOTS = 5000  # where the row's stale tail points: slots of the row's previous owner


def tree_cache_shell(ledger: Ledger, cache_cls, row: list[int]):
    """The tree's ``cache_cls`` with its release code as shipped (or patched) and everything that
    code reaches beyond itself standing in: no radix tree is built; ``row`` is the request's row."""
    import torch

    class ReqToTokenPoolStandIn:
        """Stands for the request-to-token pool (``HybridReqToTokenPool`` for Mamba): the request's
        row of slot numbers, and its Mamba state index."""

        def __init__(self) -> None:
            self.req_to_token = torch.tensor([row], dtype=torch.int32)

        def get_mamba_indices(self, idx):
            return torch.tensor(idx)

        def free(self, idx, free_mamba_cache: bool = True) -> None:
            ledger.record("req_row_freed", row=int(idx), mamba_state_freed=bool(free_mamba_cache))

    class SlotAllocatorStandIn:
        """Stands for the token-to-KV slot allocator: records the slots returned to it."""

        def free(self, indices) -> None:
            ledger.record("kv_slots_freed", slots=[int(i) for i in indices])

    class TreeCacheShell(cache_cls):
        def __init__(self) -> None:  # the real constructor builds the tree and sizes the pools
            self.disable = False
            self.page_size = 1
            self.is_eagle = False
            self.req_to_token_pool = ReqToTokenPoolStandIn()
            self.token_to_kv_pool_allocator = SlotAllocatorStandIn()

        def insert(self, key, value=None, mamba_value=None):
            ledger.record("radix_insert", tokens=len(value) if value is not None else None)
            nothing_matched = 0
            return (nothing_matched, True) if mamba_value is not None else nothing_matched

        def dec_lock_ref(self, node, *args) -> None:
            ledger.record("prefix_unlocked")

        # what the pristine final-result path asks of the cache: recorded, as prefill_retire does
        def cache_unfinished_req(self, req, *args, **kwargs):
            ledger.record("cache_unfinished", rid=req.rid, via="tree_cache")

        def release_aborted_request(self, rid):
            ledger.record("tree_release_aborted", rid=rid)

    return TreeCacheShell()


def _tree_counts_by_prompt() -> None:
    if sg_attr("mem_cache.common", "release_kv_cache") is not None:
        raise NotApplicable("from 0.5.5.post1 the release goes through release_kv_cache and the tree caches "
                            "count the committed KV length (prefill_retire checks that call)")


def _release_rig(ctx, cache_cls, row: list[int]) -> RetireRig:
    """A RetireRig whose tree cache is ``tree_cache_shell``; the caller has checked _tree_counts_by_prompt."""
    rig = RetireRig(ctx)
    rig.shell.tree_cache = tree_cache_shell(rig.ledger, cache_cls, row)
    # The patched tree's own release helper runs (0.5.1 - 0.5.3.post1 add it), not the recorder.
    own = sg_attr("disaggregation.utils", "release_kv_cache")
    if own is not None:
        ctx.patch_if_present(sg("disaggregation.prefill"), "release_kv_cache", own)
    return rig


def _released(rig: RetireRig, req) -> dict[str, Any]:
    led = rig.ledger
    rows = led.of("req_row_freed")
    return {
        "cache_unfinished_calls": led.count("cache_unfinished", rid=req.rid),
        "send_kv_chunk_calls": led.count("send_kv_chunk", rid=req.rid),
        "radix_inserts": led.count("radix_insert"),
        "kv_slots_freed": sorted(s for r in led.of("kv_slots_freed") for s in r["slots"]),
        "req_rows_freed": len(rows),
        "mamba_state_freed": [r["mamba_state_freed"] for r in rows],
        "prefix_unlocked": led.count("prefix_unlocked"),
        "metadata_frees": led.count("metadata_free"),
        "streamed": [s["finish"] for s in led.of("stream", rid=req.rid)],
    }


def _retired(obs: dict[str, Any]) -> list[str]:
    problems = []
    if obs["cache_unfinished_calls"] or obs["send_kv_chunk_calls"]:
        problems.append("aborted result cached or sent")
    if obs["radix_inserts"]:
        problems.append("aborted prefix inserted into the radix tree")
    if obs["req_rows_freed"] != 1 or obs["prefix_unlocked"] != 1:
        problems.append("request row not freed once with its prefix lock dropped")
    if obs["metadata_frees"] != 1:
        problems.append("metadata buffer not freed once")
    if len(obs["streamed"]) != 1 or (obs["streamed"][0] or {}).get("type") != "FINISH_ABORT":
        problems.append("abort not streamed exactly once")
    return problems


@case(
    proves=("pr36988",),
    needs=("<0.5.5.post1",),
    must_preserve=False,
    expect="An aborted request whose last in-flight result is a middle chunk is released by the tree's own "
           "code: exactly the slots its forwards wrote go back (none past fill_ids, none of the tree's "
           "prefix), nothing is inserted, the abort is streamed once.",
)
def aborted_middle_chunk_frees_only_written_slots(ctx) -> Outcome:
    """A 64-token prompt chunked by 16: the tree holds the first chunk (``prefix_indices``), the
    second chunk wrote slots 16-31 and its result is the last in flight when the client
    disconnects; the row's slots 32-63 still name the previous owner's slots."""
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.radix_cache import RadixCache

    _tree_counts_by_prompt()
    prompt, prefix, written = 64, 16, 32
    own = list(range(1000, 1000 + written))
    row = own + list(range(OTHER_REQUEST_SLOTS, OTHER_REQUEST_SLOTS + prompt - written))
    rig = _release_rig(ctx, RadixCache, row)
    req = rig.prefilled_req("aborted-middle-row", prompt, room=312)
    req.origin_input_ids = list(req.origin_input_ids)
    req.fill_ids = req.origin_input_ids[:written]
    req.req_pool_idx = ROW
    req.prefix_indices = torch.tensor(own[:prefix], dtype=torch.int64)
    req.last_node = object()
    # The in-flight chunk counter: is_chunked up to 0.5.12.post1; no later chunk was launched.
    setattr(req, "inflight_middle_chunks" if hasattr(req, "inflight_middle_chunks") else "is_chunked", 1)
    rig.shell.chunked_req = None
    mark_aborted(req, FINISH_ABORT("Client disconnected."))
    rig.deliver_result([req])
    obs = _released(rig, req)
    problems = _retired(obs)
    if obs["kv_slots_freed"] != own[prefix:]:
        stale = [s for s in obs["kv_slots_freed"] if s >= OTHER_REQUEST_SLOTS]
        problems.append(f"freed {len(obs['kv_slots_freed'])} slots, not the {written - prefix} it wrote"
                        + (f" ({len(stale)} of them the row's previous owner's)" if stale else ""))
    obs["kv_slots_freed"] = f"{len(obs['kv_slots_freed'])} slots"  # the list itself says nothing more
    obs["violations"] = problems
    return judged(
        problems,
        "Released exactly the slots its forwards wrote; nothing inserted; abort streamed once.",
        obs,
        unsafe_prefix="Aborted middle chunk released wrongly: ",
    )


@case(
    proves=("pr36988",),
    needs=(">=0.5.3.post2,<0.5.5.post1",),
    must_preserve=False,
    expect="A hybrid (Mamba) model's aborted final prefill result is retired: no KV chunk sent, nothing "
           "inserted into the Mamba radix tree, the request's own KV slots and Mamba state freed once, the "
           "abort streamed once.",
)
def hybrid_aborted_result_not_inserted(ctx) -> Outcome:
    """#36988 with ``MambaRadixCache``: an aborted request's final prefill result arrives; the
    tree's own ``cache_finished_req`` must release it without inserting, freeing its slots and its
    Mamba state."""
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    _tree_counts_by_prompt()
    MambaRadixCache = sg_attr("mem_cache.mamba_radix_cache", "MambaRadixCache")
    if MambaRadixCache is None:
        raise NotApplicable("no MambaRadixCache before 0.5.3.post2 (no hybrid GDN radix cache)")

    prompt = 48
    own = list(range(1000, 1000 + prompt))
    rig = _release_rig(ctx, MambaRadixCache, own + [OTHER_REQUEST_SLOTS] * 16)
    req = rig.prefilled_req("aborted-hybrid", prompt, room=311)
    req.origin_input_ids = list(req.origin_input_ids)  # the cache concatenates it with output_ids
    req.fill_ids = req.origin_input_ids
    req.req_pool_idx = ROW
    req.prefix_indices = torch.empty((0,), dtype=torch.int64)
    req.last_node = object()
    if hasattr(req, "mamba_pool_idx"):  # 0.5.4.post2+: the request names its Mamba state slot
        req.mamba_pool_idx = torch.tensor(ROW)
    # aborted while its prefill ran (a client disconnect): the prompt is whole, unlike an intake stub
    mark_aborted(req, FINISH_ABORT("Client disconnected."))
    rig.deliver_result([req])
    obs = _released(rig, req)
    problems = _retired(obs)
    # Nothing matched, so the slots the cache counts as the request's go back: the prompt's first
    # n - 1 tokens' up to 0.5.4.post2 (`[:-1]`), all n from 0.5.4.post3.
    if obs["kv_slots_freed"] not in (own[:-1], own) or obs["mamba_state_freed"] != [True]:
        problems.append("KV slots and Mamba state not freed once")
    obs["kv_slots_freed"] = f"{len(obs['kv_slots_freed'])} slots"
    obs["violations"] = problems
    return judged(
        problems,
        "Retired once: nothing inserted into the Mamba radix tree, slots and Mamba state freed, "
        "abort streamed once.",
        obs,
        unsafe_prefix="Hybrid abort not retired cleanly: ",
    )
