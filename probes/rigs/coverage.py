"""One KV handoff from prefill to decode, for the transfer_coverage and handoff cases (not a probe:
no cases here).

Prefill's real ``send_kv_chunk`` (``PrefillSide``, each chunk, with the tree's ``MetadataBuffers``
on CPU) and decode's real ``DecodeTransferQueue`` (``DecodeSide``: its constructor,
``pop_transferred``, ``_poll_with_metadata_gate`` and ``_commit_transfer_to_req``), on one rank or
two; ``one_handoff`` (probes/rigs/coverage_run.py) runs one request through both
(probes/rigs/host_memory.py: decode's receive paths through host memory). Stand-ins: the RDMA
write of the metadata row (``copy_metadata_row``), the transport poll
(``CompletedTransferReceiver``), the gloo all-reduce (``MinAllReduce``) and the
page pools.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

from ..standins import Ledger, construct_with, describe_finish, give_kv_row, make_req
from ..standins.memory import (
    CountingTokenToKVPoolAllocator,
    RecordingReqToMetadataIdxAllocator,
)
from ..standins.scheduler import make_scheduler_shell
from ..standins.transport import recording_sender_class

CHECK_ENV = "SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK"
COVERAGE_SLOT = 7  # the spare cached_tokens slot the fix uses
PAGE_SIZE = 16
HIDDEN = 16


def metadata_buffers():
    """The tree's own ``MetadataBuffers`` (CPU tensors), small."""
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return construct_with(MetadataBuffers, size=8, hidden_size=HIDDEN, hidden_states_dtype=torch.float32,
                          dtype=torch.float32,  # the same argument's name up to 0.5.1
                          max_top_logprobs_num=16, max_sampling_mask_tokens=0)


def copy_metadata_row(src, src_idx: int, dst, dst_idx: int) -> None:
    """Stands for the RDMA write of the request's metadata row (every per-request
    buffer, ``cached_tokens`` included) from prefill to decode."""
    import torch

    for name, value in vars(src).items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == src.output_ids.shape[0]:
            getattr(dst, name)[dst_idx].copy_(value[src_idx])


def set_reservation(req, tokens: int) -> None:
    """What decode's ``_pre_alloc`` records: ``kv_committed_len = fill_len``."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_committed_len"):
        kv.kv_committed_len = tokens
    else:
        req.kv_committed_len = tokens


def reservation(req) -> int:
    """The reservation decode recorded for ``req`` (see ``set_reservation``)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_committed_len"):
        return int(kv.kv_committed_len or 0)
    return int(getattr(req, "kv_committed_len", 0) or 0)


def tree_fill_len(req) -> int:
    """Decode's reservation for ``req``, by the tree's own ``_pre_alloc_fill_len``."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    fill = getattr(DecodePreallocQueue, "_pre_alloc_fill_len", None)
    if fill is None:
        return len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
    return int(fill(req))


class PagePoolStandIn(CountingTokenToKVPoolAllocator):
    """Prefill's page pool as ``send_kv_chunk`` reads it (identity translation:
    no unified-memory virtual ids)."""

    def translate_kv_indices_for_transfer(self, kv_indices):
        return kv_indices

    def get_kvcache(self):
        """Up to 0.5.11 ``send_kv_chunk`` asks for the device pool to pick hybrid
        extras (Mamba, SWA, NSA); this one is none of them."""
        return SimpleNamespace(page_size=self.page_size)


class PrefillSide:
    """Prefill's real ``send_kv_chunk`` on a scheduler shell."""

    def __init__(self, ctx, ledger: Ledger) -> None:
        import torch

        self.ledger = ledger
        self.buffers = metadata_buffers()
        self.pages = PagePoolStandIn(ledger, "prefill", 256, PAGE_SIZE)
        self.shell = make_scheduler_shell(
            ledger,
            token_to_kv_pool_allocator=self.pages,
            req_to_token_pool=SimpleNamespace(
                req_to_token=torch.arange(8 * 1024, dtype=torch.int64).reshape(8, 1024)
            ),
            disagg_metadata_buffers=self.buffers,
            enable_staging=False,
            disagg_prefill_bootstrap_queue=SimpleNamespace(
                kv_manager=SimpleNamespace(kv_args=SimpleNamespace(state_types=[]))
            ),
        )
        self.sender_cls = recording_sender_class(ledger)
        self.metadata = RecordingReqToMetadataIdxAllocator(ledger)

    def handoff(self, rid: str, prompt_tokens: int, room: int, *, chunk_ends=(), decode_prefix: int = 0,
                cached_prefix: int = 0, spec: bool = False) -> Any:
        """One request's prefill: chunks ending at ``chunk_ends``, then the last
        chunk (its forward's extend range reaches the prompt's end)."""
        import torch
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        send = SchedulerDisaggregationPrefillMixin.send_kv_chunk
        req = make_req(rid, prompt_tokens, room=room)
        give_kv_row(req, 0, prompt_tokens)
        req.disagg_kv_sender = self.sender_cls(bootstrap_room=room)
        req.metadata_buffer_index = self.metadata.alloc()
        req.start_send_idx = decode_prefix
        req.disagg_decode_prefix_len = decode_prefix
        req.cached_tokens = cached_prefix
        req.output_ids.append(7)  # the token the forward sampled
        if spec:  # what an EAGLE target forward leaves for decode's draft model
            req.hidden_states_tensor = torch.ones(HIDDEN)
            req.output_topk_p = torch.full((4,), 0.25)
            req.output_topk_index = torch.arange(4)
        for end in chunk_ends:
            send(self.shell, req, last_chunk=False, end_idx=end)
        set_forward_range(req, prompt_tokens)
        # Where a release reads the forward's end elsewhere: Req.fill_len
        # (0.5.13/0.5.14), the length of Req.fill_ids (up to 0.5.12.post1).
        if isinstance(getattr(req, "fill_len", None), int):
            req.fill_len = prompt_tokens
        elif getattr(req, "fill_ids", None) == []:
            req.fill_ids = list(req.origin_input_ids)
        send(self.shell, req, last_chunk=True)
        return req


def set_forward_range(req, end: int) -> None:
    """What the forward over the request's prompt leaves for ``send_kv_chunk``:
    ``Req.extend_range`` (up to 0.5.21) or ``Req.extend_end`` (0.5.22)."""
    from sglang.srt.managers import schedule_batch

    rng = getattr(schedule_batch, "Range", None)
    req.extend_range = rng(0, end) if rng is not None else SimpleNamespace(start=0, end=end)
    if hasattr(req, "extend_end"):
        req.extend_end = end


class CompletedTransferReceiver:
    """Stands for a decode KV receiver whose transfer completed (the transport
    polls ``Success``), on a backend without drain-ACK capability."""

    def __init__(self, ledger: Ledger, room: int) -> None:
        self.ledger, self.bootstrap_room = ledger, room
        self.abort_notified = False
        self.bootstrap_infos: list = []
        self.require_staging = False
        self.conclude_state = None
        self.kv_mgr = SimpleNamespace(enable_deferred_decode_kv_release=False)

    def poll(self):
        from sglang.srt.disaggregation.base import KVPoll

        return KVPoll.Success

    def failure_exception(self):
        raise ConnectionError("probe: the transport reported no failure for this room")

    def ensure_abort_notified(self, *args, **kwargs):
        self.ledger.record("abort_notified", room=self.bootstrap_room)

    def abort(self):
        self.ledger.record("receiver_abort", room=self.bootstrap_room)

    def clear(self):
        self.ledger.record("receiver_clear", room=self.bootstrap_room)


class MinAllReduce:
    """Stands for the gloo group's ``all_reduce(MIN)`` across ``ranks`` decode
    ranks, each running in its own thread: contributions meet at a barrier."""

    def __init__(self, ranks: int) -> None:
        import torch.distributed as dist

        self.ReduceOp = dist.ReduceOp
        self.ProcessGroup = dist.ProcessGroup
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks)
        self.slots: dict[int, Any] = {}
        self.local = threading.local()

    def get_world_size(self, group=None) -> int:
        return self.ranks

    def all_reduce(self, tensor, op=None, group=None, **kwargs):
        import torch

        if self.ranks == 1:
            return
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        tensor.copy_(torch.stack([self.slots[r] for r in range(self.ranks)]).min(dim=0).values)
        self.barrier.wait()


class DecodeSide:
    """Decode's real ``DecodeTransferQueue`` on one attention-TP rank."""

    def __init__(self, ctx, ledger: Ledger, rank: int = 0, spec: bool = False, pages=None) -> None:
        from sglang.srt.disaggregation.decode import DecodeTransferQueue

        self.ledger, self.rank = ledger, rank
        self.pages = (
            pages
            if pages is not None
            else CountingTokenToKVPoolAllocator(ledger, f"decode{rank}", 1024, PAGE_SIZE)
        )
        self.metadata = RecordingReqToMetadataIdxAllocator(ledger)
        self.buffers = metadata_buffers()
        extra = {}
        if spec:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

            extra["spec_algorithm"] = SpeculativeAlgorithm.EAGLE
        self.shell = make_scheduler_shell(ledger, token_to_kv_pool_allocator=self.pages, **extra)
        self.queue = construct_with(
            DecodeTransferQueue,
            gloo_group=None,
            req_to_metadata_buffer_idx_allocator=self.metadata,
            tp_rank=rank,
            metadata_buffers=self.buffers,
            scheduler=self.shell,
            tree_cache=self.shell.tree_cache,
        )
        self.queue.enable_staging = False
        self.queue.enable_host_receive = False

    def expect(self, rid: str, room: int, prompt_tokens: int, *, output_ids=(), rebootstrap: bool = False):
        """Decode admitted the request and reserved pages for it."""
        req = make_req(rid, prompt_tokens, room=room)
        req.output_ids.extend(output_ids)
        if rebootstrap:
            req.pd_rebootstrap_in_progress = True
        reserved = tree_fill_len(req)
        self.pages.reserve(rid, reserved)
        return self.admit(req, rebootstrap=rebootstrap)

    def admit(self, req, *, rebootstrap: bool = False):
        """``req`` (its pages already reserved in this side's pool) enters the
        transfer queue with its reservation recorded as ``_pre_alloc`` does."""
        from sglang.srt.disaggregation.decode import DecodeRequest

        reserved = tree_fill_len(req)
        set_reservation(req, reserved)
        give_kv_row(req, 0, reserved)
        kwargs = {"is_rebootstrap": True} if rebootstrap and "is_rebootstrap" in inspect.signature(
            DecodeRequest).parameters else {}
        decode_req = DecodeRequest(
            req=req, kv_receiver=CompletedTransferReceiver(self.ledger, req.bootstrap_room), **kwargs
        )
        decode_req.metadata_buffer_index = self.metadata.alloc()
        self.queue.queue.append(decode_req)
        return decode_req

    def land(self, prefill: PrefillSide, prefill_req, decode_req) -> None:
        copy_metadata_row(prefill.buffers, prefill_req.metadata_buffer_index,
                          self.buffers, decode_req.metadata_buffer_index)

    def pop(self, collective: MinAllReduce) -> list:
        collective.local.rank = self.rank
        for decode_req in self.queue.queue:
            if decode_req.req.eos_token_ids is None:  # up to 0.5.4.post2 the pop reads it unguarded
                decode_req.req.eos_token_ids = set()  # the probes' model has no EOS token
        return self.queue.pop_transferred()

    def outcome(self, decode_req, committed: list) -> dict[str, Any]:
        req = decode_req.req
        reason = describe_finish(req.finished_reason)
        return {
            "rank": self.rank,
            "reserved_tokens": reservation(req),
            "recorded_coverage": int(
                self.buffers.cached_tokens[decode_req.metadata_buffer_index, COVERAGE_SLOT]
            )
            if hasattr(self.buffers, "cached_tokens")
            else None,  # no such buffer up to 0.5.2
            "committed": any(r is req for r in committed),
            "finish": reason,
            "refusal_message": getattr(req.finished_reason, "message", None) if reason else None,
            "streamed": [s["finish"] for s in self.ledger.of("stream", rid=req.rid)],
            "pages_held": self.pages.held_by(req.rid),
            "release_calls": self.ledger.count("release_kv_cache", rid=req.rid),
            "double_releases": self.ledger.count("pages_double_release"),
            "refusal_counter": getattr(self.queue, "transfer_coverage_refused_reqs", None),
        }
