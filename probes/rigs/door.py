"""The PD admission doors as a rig: one scheduler shell with the tree's own
``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add`` wired to recording transports
(moved out of the admission probe, whose cases and those of ``handoff`` and ``refused_room``
drive it). How the doors are driven is told in ``probes/cases/admission/__init__.py``.
"""

from __future__ import annotations

import inspect
from typing import Any

from .. import NotApplicable
from ..standins import Ledger, describe_finish, pin_runtime, prefill_bootstrap_queue_attr, sg
from ..standins.memory import CountingTokenToKVPoolAllocator, MetadataBuffersStandIn, patch_cache_helpers
from ..standins.scheduler import make_scheduler_shell, wrap_beam_coordinator
from ..standins.transport import KVManagerStandIn, patch_transport

NUM_KV_HEADS = 8
PREFILL_POOL_TOKENS = 4096
REJECTION = "Input length (9000 tokens) exceeds the maximum allowed length (4096 tokens)."


def size_prefill_pool(queue, tokens: int) -> None:
    """The bootstrap queue's pool capacity, as its constructor would set it; 0.5.23's
    constructor also derives the prompt limit the door checks (`max_bootstrap_input_len`,
    the release's own rule, here for one KV shard)."""
    queue.max_total_num_tokens = tokens
    limit = getattr(sg("disaggregation.prefill"), "max_bootstrap_input_len", None)
    if limit is not None:
        page_size = getattr(getattr(queue.scheduler, "token_to_kv_pool_allocator", None), "page_size", 1)
        queue.max_input_len = limit(capacity=tokens, page_size=page_size, shard_size=1)


class DoorRig:
    """One scheduler shell with both PD doors wired to recording transports."""

    def __init__(self, ctx) -> None:
        pin_runtime(ctx)
        self.ledger = Ledger()
        patch_transport(ctx, self.ledger)
        decode_mod = sg("disaggregation.decode")
        patch_cache_helpers(ctx, self.ledger, decode_mod, None)
        for name in ("dsv41_dspark_needs_rebootstrap", "dsv4_needs_rebootstrap"):
            ctx.patch_if_present(decode_mod, name, lambda *a, **k: False)
        self.shell = make_scheduler_shell(self.ledger)
        wrap_beam_coordinator(self.shell)
        self.shell._release_aborted_request = self._release_aborted_request
        self.prefill_queue = self._prefill_queue()
        self.decode_queue = self._decode_queue()
        setattr(self.shell, prefill_bootstrap_queue_attr(), self.prefill_queue)
        self.shell.disagg_decode_prealloc_queue = self.decode_queue

    def _release_aborted_request(self, req) -> None:
        # The cache-side release #38935's review asked for; its body is the
        # tree cache's business, the probe records that it happened.
        self.ledger.record("release_aborted_request", rid=req.rid)

    @staticmethod
    def _backend():
        from sglang.srt.disaggregation.utils import TransferBackend

        return getattr(TransferBackend, "MOONCAKE", next(iter(TransferBackend)))

    def _prefill_queue(self):
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        q = object.__new__(PrefillBootstrapQueue)
        q.__dict__.update(
            scheduler=self.shell,
            queue=[],
            transfer_backend=self._backend(),
            kv_manager=KVManagerStandIn(),
            tp_rank=0,
            pp_rank=0,
            pp_size=1,
            bootstrap_port=8998,
            req_to_metadata_buffer_idx_allocator=self.shell.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=MetadataBuffersStandIn(),
        )
        size_prefill_pool(q, PREFILL_POOL_TOKENS)
        return q

    def _decode_queue(self):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        q = object.__new__(DecodePreallocQueue)
        q.__dict__.update(
            scheduler=self.shell,
            queue=[],
            retracted_queue=[],
            pending_reqs=[],
            transfer_backend=self._backend(),
            kv_manager=KVManagerStandIn(),
            token_to_kv_pool_allocator=CountingTokenToKVPoolAllocator(self.ledger, "decode", 4096, 16),
            max_total_num_tokens=1 << 20,
            req_to_metadata_buffer_idx_allocator=self.shell.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=MetadataBuffersStandIn(),
            tree_cache=self.shell.tree_cache,
            tp_rank=0,
            # up to 0.4.5.post3 the decode door reads the queue's port, not the request's
            bootstrap_port=8998,
        )
        q._check_if_req_exceed_kv_capacity = lambda req: False
        return q

    # doors -----------------------------------------------------------------

    def prefill_door(self, req) -> None:
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        if "num_kv_heads" in inspect.signature(PrefillBootstrapQueue.add).parameters:
            PrefillBootstrapQueue.add(self.prefill_queue, req, NUM_KV_HEADS)
        else:  # up to 0.4.7: add(self, req), no capacity check
            PrefillBootstrapQueue.add(self.prefill_queue, req)

    def decode_door(self, req, **flags) -> None:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        if (
            "is_retracted" in flags
            and "is_retracted" not in inspect.signature(DecodePreallocQueue.add).parameters
        ):
            raise NotApplicable("this release's DecodePreallocQueue.add takes no is_retracted (the retracted "
                                "re-entry door arrived in 0.4.7.post1)")
        DecodePreallocQueue.add(self.decode_queue, req, **flags)

    # observations ----------------------------------------------------------

    def observe(self, req) -> dict[str, Any]:
        led = self.ledger
        rid = req.rid
        decode_entries = [dr.req for dr in self.decode_queue.queue] + [
            dr.req for dr in self.decode_queue.pending_reqs
        ]
        streams = led.of("stream", rid=rid)
        return {
            "sender_created": led.count("sender_created", room=req.bootstrap_room) > 0,
            "receiver_created": led.count("receiver_created", room=req.bootstrap_room) > 0,
            "prefill_bootstrap_queued": any(r is req for r in self.prefill_queue.queue),
            "decode_prealloc_queued": any(r is req for r in decode_entries),
            "decode_retracted_queued": any(r is req for r in self.decode_queue.retracted_queue),
            "waiting_queued": any(r is req for r in self.shell.waiting_queue),
            "metadata_buffers_taken": led.count("metadata_alloc"),
            "streamed": [s["finish"] for s in streams],
            "finished_reason": describe_finish(req.finished_reason),
            "to_finish": describe_finish(getattr(req, "to_finish", None)),  # no such field up to 0.5.4.post1
            "release_aborted_request_calls": led.count("release_aborted_request", rid=rid),
            "beam_group_retired": led.count("beam_retire_group", rid=rid),
        }



def retired_cleanly(obs: dict[str, Any]) -> bool:
    """#38935's retirement: no handoff object, no queue, the 400 streamed once."""
    return (
        not obs["sender_created"]
        and not obs["receiver_created"]
        and not obs["prefill_bootstrap_queued"]
        and not obs["decode_prealloc_queued"]
        and obs["metadata_buffers_taken"] == 0
        and len(obs["streamed"]) == 1
        and (obs["streamed"][0] or {}).get("status_code") == 400
        and (obs["finished_reason"] or {}).get("status_code") == 400
    )


def handoff_summary(obs: dict[str, Any]) -> str:
    made = [k for k in ("sender_created", "receiver_created") if obs[k]]
    queued = [
        k for k in ("prefill_bootstrap_queued", "decode_prealloc_queued", "decode_retracted_queued") if obs[k]
    ]
    return (
        f"handoff objects: {', '.join(made) or 'none'}; queues: {', '.join(queued) or 'none'}; "
        f"streamed {len(obs['streamed'])} time(s)"
    )

