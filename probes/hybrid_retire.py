"""Retiring an aborted prefill result of a hybrid (Mamba) model (#36988 on 0.5.4 - 0.5.5).

#36988 releases an aborted request's KV without inserting its prefix into the radix cache. Up to
0.5.5 there is no ``release_kv_cache`` helper: the retirement asks the tree cache itself,
``cache_finished_req(req, is_insert=False)``. A hybrid GDN model serves PD with
``MambaRadixCache`` from 0.5.4 (0.5.3.post2 refuses the combination at start), and that cache takes
``is_insert`` only from 0.5.4.post3: on 0.5.4 - 0.5.4.post2 a backport that passes it raises
``TypeError`` in the scheduler, and one that leaves it out inserts the aborted prefix. From
0.5.5.post1 ``release_kv_cache`` forwards ``is_insert`` to the cache, whose Mamba method honours it;
``prefill_retire`` checks that call, so this case needs the releases before it.

How it is driven: as ``prefill_retire`` (the tree's real ``process_batch_result_disagg_prefill``
on a scheduler shell, real ``GenerationBatchResult`` and ``Req``), with the scheduler's tree cache
the tree's real ``MambaRadixCache.cache_finished_req`` over stand-in pools: the radix tree's
``insert`` is recorded, not built, and the request-to-token pool (a CPU tensor of slots), the slot
allocator and the Mamba state pool count what is freed.
"""

from __future__ import annotations

from typing import Any

from probes import Outcome, case, judged
from probes.prefill_retire import RetireRig
from probes.standins import Ledger, mark_aborted

PROMPT_TOKENS = 48
ROW = 0


def mamba_radix_cache_shell(ledger: Ledger, rows: int = 4, width: int = 256):
    """The tree's ``MambaRadixCache`` with its ``cache_finished_req`` as shipped (or patched) and
    everything that method reaches beyond itself standing in: no radix tree is built."""
    import torch
    from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache

    class ReqToTokenPoolStandIn:
        """Stands for ``HybridReqToTokenPool``: each row's token slots, and its Mamba state index."""

        def __init__(self) -> None:
            self.req_to_token = torch.arange(rows * width, dtype=torch.int32).reshape(rows, width)

        def get_mamba_indices(self, idx):
            return torch.tensor(idx)

        def free(self, idx, free_mamba_cache: bool = True) -> None:
            ledger.record("req_row_freed", row=int(idx), mamba_state_freed=bool(free_mamba_cache))

    class SlotAllocatorStandIn:
        """Stands for the token-to-KV slot allocator: counts the slots returned to it."""

        def free(self, indices) -> None:
            ledger.record("kv_slots_freed", slots=int(len(indices)))

    class MambaRadixCacheShell(MambaRadixCache):
        def __init__(self) -> None:  # the real constructor builds the tree and sizes the pools
            self.disable = False
            self.page_size = 1
            self.req_to_token_pool = ReqToTokenPoolStandIn()
            self.token_to_kv_pool_allocator = SlotAllocatorStandIn()

        def insert(self, key, value=None, mamba_value=None):
            ledger.record("radix_insert", tokens=len(value) if value is not None else None)
            return 0, True  # nothing matched: the tree keeps every slot it was given

        def dec_lock_ref(self, node) -> None:
            ledger.record("prefix_unlocked")

        # what the pristine final-result path asks of the cache: recorded, as prefill_retire does
        def cache_unfinished_req(self, req, *args, **kwargs):
            ledger.record("cache_unfinished", rid=req.rid, via="tree_cache")

        def release_aborted_request(self, rid):
            ledger.record("tree_release_aborted", rid=rid)

    return MambaRadixCacheShell()


@case(
    proves=("pr36988",), needs=(">=0.5.4,<0.5.5.post1",),
    must_preserve=False,
    expect="A hybrid (Mamba) model's aborted final prefill result is retired: no KV chunk sent, nothing inserted into the Mamba radix tree, the request's own KV slots and Mamba state freed once, the abort streamed once.",
)
def hybrid_aborted_result_not_inserted(ctx) -> Outcome:
    """#36988 with ``MambaRadixCache``: an aborted request's final prefill result arrives;
    the tree's own ``cache_finished_req`` must release it without inserting, freeing its slots and
    its Mamba state."""
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rig = RetireRig(ctx)
    rig.shell.tree_cache = mamba_radix_cache_shell(rig.ledger)
    req = rig.prefilled_req("aborted-hybrid", PROMPT_TOKENS, room=311)
    req.origin_input_ids = list(req.origin_input_ids)  # the cache concatenates it with output_ids
    req.req_pool_idx = ROW
    req.prefix_indices = torch.empty((0,), dtype=torch.int64)
    req.last_node = object()
    if hasattr(req, "mamba_pool_idx"):  # 0.5.4.post2+: the request names its Mamba state slot
        req.mamba_pool_idx = torch.tensor(ROW)
    # aborted while its prefill ran (a client disconnect): the prompt is whole, unlike an intake stub
    mark_aborted(req, FINISH_ABORT("Client disconnected."))
    rig.deliver_result([req])
    led = rig.ledger
    rows = led.of("req_row_freed")
    obs: dict[str, Any] = {
        "cache_unfinished_calls": led.count("cache_unfinished", rid=req.rid),
        "send_kv_chunk_calls": led.count("send_kv_chunk", rid=req.rid),
        "radix_inserts": led.count("radix_insert"),
        "kv_slot_frees": led.count("kv_slots_freed"),
        "kv_slots_freed": sum(r["slots"] for r in led.of("kv_slots_freed")),
        "req_rows_freed": len(rows),
        "mamba_state_freed": [r["mamba_state_freed"] for r in rows],
        "prefix_unlocked": led.count("prefix_unlocked"),
        "metadata_frees": led.count("metadata_free"),
        "streamed": [s["finish"] for s in led.of("stream", rid=req.rid)],
    }
    problems = []
    if obs["cache_unfinished_calls"] or obs["send_kv_chunk_calls"]:
        problems.append("aborted result cached or sent")
    if obs["radix_inserts"]:
        problems.append("aborted prefix inserted into the Mamba radix tree")
    # No prefix matched, so every slot the cache counts as the request's goes back in one call: the
    # cache counts the prompt's first n - 1 tokens up to 0.5.4.post2 (`[:-1]`), all n from 0.5.4.post3.
    if (obs["kv_slot_frees"] != 1 or obs["kv_slots_freed"] not in (PROMPT_TOKENS - 1, PROMPT_TOKENS)
            or obs["mamba_state_freed"] != [True]):
        problems.append("KV slots and Mamba state not freed once")
    if obs["metadata_frees"] != 1:
        problems.append("metadata buffer not freed once")
    if len(obs["streamed"]) != 1 or (obs["streamed"][0] or {}).get("type") != "FINISH_ABORT":
        problems.append("abort not streamed exactly once")
    obs["violations"] = problems
    return judged(problems, "Retired once: nothing inserted into the Mamba radix tree, slots and Mamba state freed, "
                  "abort streamed once.", obs, unsafe_prefix="Hybrid abort not retired cleanly: ")
