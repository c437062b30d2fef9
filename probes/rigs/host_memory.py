"""Decode's receive paths through host memory, for the transfer_coverage cases (not a probe: no
cases here): a host-staged handoff (decode host receive, 0.5.21+; ``host_staged_handoff``, with
``HostStagedPreallocStandIn`` for the device reservation made after Success) and a decode rank
whose HiCache load-back from host memory is still copying (``restore_side``, 0.5.16 - 0.5.19).
Built on the sides of probes/rigs/coverage.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .. import NotApplicable
from ..standins import Ledger, construct_with, give_kv_row, make_req, sg
from ..standins.memory import patch_cache_helpers
from .coverage import (
    CompletedTransferReceiver,
    DecodeSide,
    PrefillSide,
    reservation,
    set_reservation,
    tree_fill_len,
)
from .coverage_run import coverage_rig


class HostStagedPreallocStandIn:
    """Stands for ``DecodePreallocQueue.allocate_host_staged`` when the device
    has room: it reserves the device pages and, as its ``_pre_alloc`` does,
    records the tree's own ``_pre_alloc_fill_len`` in ``kv_committed_len``."""

    def __init__(self, ledger: Ledger, pages) -> None:
        self.ledger, self.pages = ledger, pages

    def allocate_host_staged(self, decode_req) -> bool:
        req = decode_req.req
        reserved = tree_fill_len(req)
        self.pages.reserve(req.rid, reserved)
        set_reservation(req, reserved)
        give_kv_row(req, 0, reserved)
        decode_req.host_staged = False
        self.ledger.record("allocate_host_staged", rid=req.rid, reserved=reserved)
        return True


def host_receive_or_skip() -> None:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest

    if not hasattr(DecodePreallocQueue, "allocate_host_staged") or "host_staged" not in getattr(
            DecodeRequest, "__dataclass_fields__", {}):
        raise NotApplicable("decode has no host receive (allocate_host_staged) in this release")


def host_staged_handoff(
    ctx, *, prompt_tokens: int, prefill_tokens: int, rid: str, room: int
) -> dict[str, Any]:
    """Decode admitted the request to host pages (``_pre_alloc_host``: no device
    reservation yet, ``kv_committed_len`` unset); prefill writes a
    ``prefill_tokens`` sequence there; decode's real transfer queue polls it."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    host_receive_or_skip()
    collective = coverage_rig(ctx)
    ledger = Ledger()
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), None)
    decode = DecodeSide(ctx, ledger)
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), decode.pages)
    decode.queue.enable_host_receive = True
    decode.shell.disagg_decode_prealloc_queue = HostStagedPreallocStandIn(ledger, decode.pages)
    ctx.patch_if_present(sg("disaggregation.decode"), "discard_kv_cache_backup",
                         lambda req, *a, **k: ledger.record("discard_host_backup", rid=req.rid))
    prefill = PrefillSide(ctx, ledger)
    req = make_req(rid, prompt_tokens, room=room)
    receiver = CompletedTransferReceiver(ledger, room)
    receiver.supports_host_destination = True
    decode_req = DecodeRequest(req=req, kv_receiver=receiver)
    decode_req.host_staged = True
    decode_req.metadata_buffer_index = decode.metadata.alloc()
    decode.queue.queue.append(decode_req)
    preq = prefill.handoff(f"p-{rid}", prefill_tokens, room)
    decode.land(prefill, preq, decode_req)
    committed = decode.pop(collective)
    obs = decode.outcome(decode_req, committed)
    obs["prefill_last_chunk_tokens"] = int(preq.start_send_idx)
    obs["reserved_tokens"] = reservation(req)
    obs["device_reservations"] = ledger.of("allocate_host_staged", rid=rid)
    obs["held_for_drain"] = any(
        entry[0] is decode_req for entry in getattr(decode.queue, "_deferred_releases", [])
    )
    obs["host_released"] = ledger.count("discard_host_backup", rid=rid)
    return obs


def restore_side(ctx, ledger, rank: int, prompt_tokens: int, room: int):
    """A decode rank with HiCache on whose request restores a 32-token prefix
    from host memory: the load-back is queued and its copy still running."""
    import torch
    from sglang.srt.disaggregation.decode import HiCacheRestoreResult
    from sglang.srt.disaggregation.decode_hicache_mixin import DecodePrefixMatch

    from ..standins.hicache import restore_tree, start_load_back

    side = DecodeSide(ctx, ledger, rank=rank)
    hc = restore_tree(ledger)
    side.shell.enable_decode_hicache = True
    side.queue.tree_cache = hc.tree
    hc.tree.req_to_token_pool = SimpleNamespace(write=lambda *a, **k: ledger.record("restore_written"))
    dreq = side.expect(f"restore-r{rank}", room, prompt_tokens)
    dreq.prefix_match = construct_with(DecodePrefixMatch, prefix_indices=torch.tensor([], dtype=torch.int64),
                                       l2_host_hit_length=32, l3_storage_hit_length=0,
                                       last_device_node=hc.tree.root_node)
    hc.restore_pages = start_load_back(hc)
    dreq.hicache_restored_node = hc.node
    dreq.hicache_restored_kv_indices = torch.tensor(hc.restore_pages, dtype=torch.int64)
    dreq.hicache_load_consumer_index = 0
    dreq.hicache_restore_status = HiCacheRestoreResult.PENDING
    return side, dreq, hc
