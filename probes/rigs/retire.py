"""A prefill scheduler shell that receives forward results, as the prefill_retire probe drives it
(and tree_release, whose trees release what it holds); with what #36988's retirement requires of
what it observed. The probe: probes/cases/prefill_retire/."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .. import Outcome, judged
from ..standins import (
    Ledger,
    describe_finish,
    give_kv_row,
    make_req,
    pin_runtime,
    prefill_bootstrap_queue_attr,
    sg,
)
from ..standins.memory import CountingTokenToKVPoolAllocator, patch_cache_helpers
from ..standins.scheduler import deliver_prefill_result, make_scheduler_shell
from ..standins.transport import recording_sender_class

PAGE_SIZE = 16
SAMPLED_TOKEN = 7


class RetireRig:
    """A prefill scheduler shell that receives forward results."""

    def __init__(self, ctx, *, abort_raises: bool = False) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        pin_runtime(ctx)
        self.ledger = Ledger()
        self.pages = CountingTokenToKVPoolAllocator(self.ledger, "prefill", 256, PAGE_SIZE)
        patch_cache_helpers(ctx, self.ledger, sg("disaggregation.prefill"), self.pages)
        self.sender_cls = recording_sender_class(self.ledger, abort_raises=abort_raises)
        self.shell = make_scheduler_shell(
            self.ledger,
            token_to_kv_pool_allocator=self.pages,
            disaggregation_mode=DisaggregationMode.PREFILL,
        )
        # Up to 0.4.7 the scheduler keeps no metadata allocator of its own: the bootstrap queue's is the
        # one its inflight queue frees through (the queue under the release's own name).
        queue = SimpleNamespace(
            req_to_metadata_buffer_idx_allocator=self.shell.req_to_metadata_buffer_idx_allocator
        )
        setattr(self.shell, prefill_bootstrap_queue_attr(), queue)
        self._next_row = 0

    def prefilled_req(self, rid: str, num_tokens: int, room: int):
        """A request that went through bootstrap and a forward: it owns a
        sender, a metadata buffer and a KV row with its prompt's pages."""
        req = make_req(rid, num_tokens, room=room)
        if getattr(req, "fill_ids", []) is None:  # a new Req's is None up to 0.4.7.post1, [] after
            req.fill_ids = []
        req.disagg_kv_sender = self.sender_cls(bootstrap_room=room)
        req.metadata_buffer_index = self.shell.req_to_metadata_buffer_idx_allocator.alloc()
        req.pending_bootstrap = False
        req.start_send_idx = 0
        self.pages.reserve(rid, num_tokens)
        give_kv_row(req, self._next_row, num_tokens)
        self._next_row += 1
        return req

    def deliver_result(self, reqs: list[Any]) -> None:
        deliver_prefill_result(self.shell, reqs, SAMPLED_TOKEN)

    def observe(self, req, since: int = 0) -> dict[str, Any]:
        led = self.ledger.since(since)
        rid = req.rid
        releases = led.of("release_kv_cache", rid=rid)
        return {
            "cache_unfinished_calls": led.count("cache_unfinished", rid=rid),
            "send_kv_chunk_calls": led.count("send_kv_chunk", rid=rid),
            "last_chunk_sent": led.count("send_kv_chunk", rid=rid, last_chunk=True) > 0,
            "queued_for_transfer": any(r is req for r in self.shell.disagg_prefill_inflight_queue),
            "sender_aborted": led.count("sender_abort", room=req.bootstrap_room),
            "metadata_frees": led.count("metadata_free"),
            "metadata_double_frees": led.count("metadata_double_free"),
            "metadata_buffer_index": req.metadata_buffer_index,
            "release_kv_cache_calls": len(releases),
            "release_inserted_prefix": [r["insert"] for r in releases],
            "pages_returned": sum(r["pages"] for r in releases),
            "pages_still_held": self.pages.held_by(rid),
            "streamed": [s["finish"] for s in led.of("stream", rid=rid)],
            "output_ids": list(req.output_ids),
            "finished_reason": describe_finish(req.finished_reason),
            "pending_chunk_rid_left": rid in self.shell.disagg_prefill_pending_chunk_rids,
        }



def handed_on(obs: dict[str, Any]) -> list[str]:
    """How an aborted result was still handed on: cached, sent, or queued for transfer."""
    problems = []
    if obs["cache_unfinished_calls"]:
        problems.append("prefix cached as unfinished")
    if obs["send_kv_chunk_calls"]:
        problems.append("KV chunk sent")
    if obs["queued_for_transfer"]:
        problems.append("queued for transfer")
    return problems


def retired_once(obs: dict[str, Any]) -> list[str]:
    """What #36988's retirement requires of an aborted final result; returns
    the violated items (empty when safe)."""
    problems = handed_on(obs)
    if obs["metadata_frees"] != 1 or obs["metadata_buffer_index"] != -1:
        problems.append("metadata buffer not freed once")
    if obs["release_kv_cache_calls"] != 1 or any(obs["release_inserted_prefix"]):
        problems.append("KV not released exactly once without insert")
    if len(obs["streamed"]) != 1 or (obs["streamed"][0] or {}).get("type") != "FINISH_ABORT":
        problems.append("abort not streamed exactly once")
    if obs["output_ids"]:
        problems.append("sampled token appended")
    if obs["pending_chunk_rid_left"]:
        problems.append("pending chunk-send entry left")
    return problems


def retire_verdict(problems: list[str], safe_text: str, obs: dict[str, Any]) -> Outcome:
    obs["violations"] = problems
    return judged(problems, safe_text, obs, unsafe_prefix="Not retired cleanly: ")

