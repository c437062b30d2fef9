"""The incident in miniature: a prompt longer than the prefill pool (steps 1-6).

1. Decode learns the prompt length and reserves pages for all of it.
2. Prefill's intake rejects the prompt (``validate_input_length`` ->
   ``Req.set_finish_with_abort``); the request still reaches the prefill door
   through ``Scheduler._add_request_to_queue``.
3. Bootstrap completes (``finalize_bootstrap``): the sender announces the
   pages of what is now a one-token placeholder prompt; the forward runs on it.
4. The forward result reaches ``process_batch_result_disagg_prefill``, which
   on an unfixed tree sends the last KV chunk: one placeholder token, and the
   transfer is signalled complete.
5-6. Decode would then attend over its full reservation, of which all but the
   first page were never written by this request.

7. Decode's transfer queue polls the completed transfer and commits the
   request, or refuses it.

The case compares what prefill would hand over with what decode reserved.
Unsafe: the last chunk is sent (transfer complete) while it covers fewer
tokens than decode reserved, and decode commits it. Safe: the handoff never
starts (#38935 retires the request at the door), is retired before any KV is
sent (#36988 retires the aborted result), the coverage matches, or decode
refuses the short handoff with a 5xx (the pack's transferred-coverage check,
``sbp-transfer-coverage``).

Driven code is the tree's: ``validate_input_length``,
``Req.set_finish_with_abort``, ``Scheduler._add_request_to_queue``,
``PrefillBootstrapQueue.add``/``finalize_bootstrap``,
``DecodePreallocQueue.add`` and ``process_batch_result_disagg_prefill``.
Stand-ins: decode's page reservation and prefill's forward allocation
(CountingTokenToKVPoolAllocator), the transport (RecordingKVSender/Receiver),
``send_kv_chunk`` (counts the tokens it would hand over, then runs the tree's
real ``send_kv_chunk`` on the collaborators of ``probes.cases.transfer_coverage``),
cache helpers, and the output streamer. Decode's side after the transfer is
``probes.cases.transfer_coverage.DecodeSide``: the tree's ``DecodeTransferQueue``
with the metadata row prefill wrote.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

from .. import SAFE, UNSAFE, Outcome, case
from ..rigs.coverage import (
    DecodeSide,
    PagePoolStandIn,
    PrefillSide,
    copy_metadata_row,
    set_forward_range,
)
from ..rigs.coverage_run import coverage_rig, refused
from ..rigs.door import DoorRig, size_prefill_pool
from ..standins import (
    construct_with,
    describe_finish,
    give_kv_row,
    make_req,
    prefill_bootstrap_queue_attr,
    reject_at_intake,
    sg,
    sg_attr,
)
from ..standins.memory import (
    CountingTokenToKVPoolAllocator,
    RecordingReqToMetadataIdxAllocator,
    patch_cache_helpers,
)
from ..standins.scheduler import deliver_prefill_result, make_scheduler_shell

PAGE_SIZE = 16
PREFILL_POOL_TOKENS = 256  # the prefill worker's KV pool (681,280 in the incident)
MAX_REQ_INPUT_LEN = PREFILL_POOL_TOKENS - 1


class DeviceKVPoolStandIn:
    """The prefill worker's GPU KV cache; `finalize_bootstrap` reads only its page size (0.5.16)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size


def list_metadata_buffers():
    """Up to 0.4.6.post4 (no ``MetadataBuffers``) the metadata is a list of per-request rows, as the
    scheduler of those releases builds it: one int32 output-id buffer, padded to 16 per row."""
    import torch

    return [torch.zeros((8, 16), dtype=torch.int32)]


class ListMetadataPrefillSide:
    """Prefill's real ``send_kv_chunk`` of 0.4.5.post1 - 0.4.6.post4 on a scheduler shell: its last
    chunk stores the sampled token through the tree's ``PrefillBootstrapQueue.store_prefill_results``
    (the queue is ``disagg_prefill_pending_queue`` up to 0.4.5.post3)."""

    def __init__(self, ledger) -> None:
        import torch
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        self.buffers = list_metadata_buffers()
        queue = object.__new__(PrefillBootstrapQueue)
        queue.metadata_buffers = self.buffers
        self.shell = make_scheduler_shell(
            ledger,
            token_to_kv_pool_allocator=PagePoolStandIn(ledger, "prefill", 256, PAGE_SIZE),
            req_to_token_pool=SimpleNamespace(
                req_to_token=torch.arange(8 * 1024, dtype=torch.int64).reshape(8, 1024)
            ),
            **{prefill_bootstrap_queue_attr(): queue},
        )


class ListMetadataDecodeSide(DecodeSide):
    """``DecodeSide`` on the tree's ``DecodeTransferQueue`` of 0.4.5.post1 - 0.4.6.post4, whose metadata
    is the list of rows above (its pop reads the transferred output id from row 0)."""

    def __init__(self, ctx, ledger, pages) -> None:
        from sglang.srt.disaggregation.decode import DecodeTransferQueue

        self.ledger, self.rank, self.pages = ledger, 0, pages
        self.metadata = RecordingReqToMetadataIdxAllocator(ledger)
        self.buffers = list_metadata_buffers()
        self.shell = make_scheduler_shell(ledger, token_to_kv_pool_allocator=pages)
        self.queue = construct_with(DecodeTransferQueue, gloo_group=None,
                                    req_to_metadata_buffer_idx_allocator=self.metadata,
                                    metadata_buffers=self.buffers,
                                    # asked for where the pack's refused-room release is (<= 0.4.6.post4)
                                    scheduler=self.shell)

    def pop(self, collective) -> list:
        # 0.4.6 - 0.4.6.post4 return the DecodeRequest entries they commit, 0.4.5.x their requests
        return [getattr(r, "req", r) for r in super().pop(collective)]


def copy_handoff_row(src, src_idx: int, dst, dst_idx: int) -> None:
    """The RDMA write of the request's metadata row (a list of row buffers up to 0.4.6.post4)."""
    if isinstance(src, list):
        for s, d in zip(src, dst):
            d[dst_idx].copy_(s[src_idx])
    else:
        copy_metadata_row(src, src_idx, dst, dst_idx)


class HandoffRig(DoorRig):
    """Both PD doors of DoorRig, plus prefill's page pool and result path."""

    def __init__(self, ctx) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        super().__init__(ctx)
        # Up to 0.4.5.post3 PD moves KV by token index (no kv_to_page_num): a page is one token.
        page = self.page_size = PAGE_SIZE if sg_attr("disaggregation.utils", "kv_to_page_num") else 1
        self.prefill_pages = CountingTokenToKVPoolAllocator(
            self.ledger, "prefill", PREFILL_POOL_TOKENS // page, page
        )
        self.decode_pages = CountingTokenToKVPoolAllocator(
            self.ledger, "decode", 4096 * PAGE_SIZE // page, page
        )
        patch_cache_helpers(ctx, self.ledger, sg("disaggregation.prefill"), self.prefill_pages)
        self.shell.token_to_kv_pool_allocator = self.prefill_pages
        self.shell.disaggregation_mode = DisaggregationMode.PREFILL
        size_prefill_pool(self.prefill_queue, PREFILL_POOL_TOKENS)
        self.prefill_queue.token_to_kv_pool = DeviceKVPoolStandIn(page)
        # Prefill's last chunk also runs the tree's real send_kv_chunk (what it
        # records in the metadata row reaches decode); decode's transfer queue.
        self.collective = coverage_rig(ctx)
        if sg_attr("disaggregation.utils", "MetadataBuffers") is not None:
            self.wire = PrefillSide(ctx, self.ledger)
            self.decode_side = DecodeSide(ctx, self.ledger, pages=self.decode_pages)
        else:  # up to 0.4.6.post4: list-of-rows metadata
            self.wire = ListMetadataPrefillSide(self.ledger)
            self.decode_side = ListMetadataDecodeSide(ctx, self.ledger, self.decode_pages)
        patch_cache_helpers(ctx, self.ledger, sg("disaggregation.decode"), self.decode_pages)
        counting_send = type(self.shell).send_kv_chunk

        def send_kv_chunk(req, last_chunk=False, end_idx=None, *args, **kwargs):
            from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

            real_send = SchedulerDisaggregationPrefillMixin.send_kv_chunk
            token_id = kwargs.get("token_id")  # up to 0.4.6.post4 the last chunk carries the sampled token
            last_chunk = last_chunk or token_id is not None
            counting_send(self.shell, req, last_chunk, end_idx)
            if last_chunk:
                set_forward_range(req, len(req.origin_input_ids))
                # Where a release reads the forward's end elsewhere: Req.fill_len
                # (0.5.13/0.5.14), the length of Req.fill_ids (up to 0.5.12.post1).
                if isinstance(getattr(req, "fill_len", None), int):
                    req.fill_len = len(req.origin_input_ids)
                elif hasattr(req, "fill_ids") and req.fill_ids in ([], None):  # None up to 0.4.7
                    req.fill_ids = list(req.origin_input_ids)
                if "token_id" in inspect.signature(real_send).parameters:
                    real_send(self.wire.shell, req, token_id=token_id)
                else:
                    real_send(self.wire.shell, req, last_chunk=True)

        self.shell.send_kv_chunk = send_kv_chunk

    def run(self, prompt_tokens: int, room: int) -> dict[str, Any]:
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
        from sglang.srt.managers.utils import validate_input_length

        # 1. decode: the router hands decode the request with its prompt length;
        #    decode admits it and reserves pages for every prompt token.
        decode_req = make_req(f"decode-{room}", prompt_tokens, room=room)
        self.decode_door(decode_req)
        self.decode_pages.reserve(decode_req.rid, len(decode_req.origin_input_ids))

        # 2. prefill intake: the prompt exceeds what the prefill pool can hold.
        req = make_req(f"prefill-{room}", prompt_tokens, room=room)
        error = validate_input_length(req, MAX_REQ_INPUT_LEN, False)
        if error:
            reject_at_intake(req, error)
        type(self.shell)._add_request_to_queue(self.shell, req)
        admitted = any(r is req for r in self.prefill_queue.queue)

        if admitted:
            # 3. bootstrap with decode completes; prefill runs the forward on
            #    whatever prompt the request now carries.
            if hasattr(PrefillBootstrapQueue, "finalize_bootstrap"):
                self.prefill_queue.queue.remove(req)
                PrefillBootstrapQueue.finalize_bootstrap(self.prefill_queue, req)
            else:
                # Up to 0.5.12.post1 bootstrap completes inside pop_bootstrapped
                # (its poll all-reduce runs on rigs.coverage's single-rank stand-in).
                self.shell.attn_cp_cpu_group = self.shell.attn_tp_cpu_group = None
                if not hasattr(self.prefill_queue, "gloo_group"):  # up to 0.5.9 the queue holds the group
                    self.prefill_queue.gloo_group = None
                PrefillBootstrapQueue.pop_bootstrapped(self.prefill_queue)
            self.prefill_pages.reserve(req.rid, len(req.origin_input_ids))
            give_kv_row(req, 0, len(req.origin_input_ids))
            # 4. the forward result.
            deliver_prefill_result(self.shell, [req], sampled_token=7)

        led = self.ledger
        inits = led.of("sender_init", room=room)
        last_chunks = led.of("send_kv_chunk", rid=req.rid, last_chunk=True)
        decode = None
        if last_chunks and not decode_req.finished():
            # 7. the transfer completed: the metadata row lands, decode polls.
            dreq = self.decode_side.admit(decode_req)
            copy_handoff_row(self.wire.buffers, req.metadata_buffer_index,
                             self.decode_side.buffers, dreq.metadata_buffer_index)
            decode = self.decode_side.outcome(dreq, self.decode_side.pop(self.collective))
        reserved_tokens = len(decode_req.origin_input_ids)
        reserved_pages = self.decode_pages.held_by(decode_req.rid)
        handed_tokens = sum(c["tokens"] for c in last_chunks)
        return {
            "prompt_tokens": prompt_tokens,
            "prefill_pool_tokens": PREFILL_POOL_TOKENS,
            "intake_rejection": bool(error),
            "decode_receiver_created": led.count("receiver_created", room=room) > 0,
            "decode_reserved_tokens": reserved_tokens,
            "decode_reserved_pages": reserved_pages,
            "prefill_admitted_to_bootstrap": admitted,
            "prefill_sender_created": led.count("sender_created", room=room) > 0,
            "pages_announced_by_sender": inits[0]["num_pages"] if inits else None,
            "transfer_complete_signalled": bool(last_chunks),
            "tokens_handed_over": handed_tokens if last_chunks else 0,
            "reserved_pages_never_written": (
                reserved_pages - -(-handed_tokens // self.page_size) if last_chunks else None
            ),
            "prefill_streamed": [s["finish"] for s in led.of("stream", rid=req.rid)],
            "prefill_finished_reason": describe_finish(req.finished_reason),
            "decode_committed": bool(decode and decode["committed"]),
            "decode_refused": bool(decode and refused(decode)),
            "decode": decode,
        }



# #38935 at the door and the pack's coverage check each make it safe too, but every tree that has
# either also has #36988 (a dependency of one, applied with the other), so #36988 is what it proves.
@case(
    proves=("pr36988",),
    must_preserve=False,
    expect='A prompt longer than the prefill pool is rejected and never handed off: no KV transfer is '
           'signalled complete with fewer tokens than decode reserved.',
)
def oversized_prompt_handoff_not_started(ctx) -> Outcome:
    """The incident: a 640-token prompt against a 256-token prefill pool. On an
    unfixed tree prefill admits the rejected request, announces one page and
    completes a one-token transfer into decode's 40-page reservation."""
    rig = HandoffRig(ctx)
    obs = rig.run(640, room=401)
    short = obs["transfer_complete_signalled"] and obs["tokens_handed_over"] < obs["decode_reserved_tokens"]
    if short and obs["decode_refused"]:
        return Outcome(
            SAFE,
            f"Prefill handed over {obs['tokens_handed_over']} token(s) for {obs['decode_reserved_tokens']} "
            "reserved; "
            "decode refused the short handoff (5xx, pages released, never committed).",
            obs,
        )
    if short:
        return Outcome(
            UNSAFE,
            f"Transfer signalled complete with {obs['tokens_handed_over']} token(s) handed over for "
            f"{obs['decode_reserved_tokens']} reserved; {obs['reserved_pages_never_written']} reserved "
            "page(s) never written.",
            obs,
        )
    if not obs["prefill_admitted_to_bootstrap"]:
        text = "The handoff never started: the rejected request was retired at the prefill door."
    else:
        text = "The handoff began but the aborted result was retired before any KV was sent."
    return Outcome(SAFE, text, obs)


@case(
    must_preserve=True,
    expect='A prompt that fits is admitted and its handoff covers exactly the tokens and pages decode '
           'reserved.',
)
def fitting_prompt_covers_reservation(ctx) -> Outcome:
    """Must-preserve: a 200-token prompt that fits the prefill pool is
    admitted and hands over exactly what decode reserved."""
    rig = HandoffRig(ctx)
    obs = rig.run(200, room=402)
    ok = (
        not obs["intake_rejection"]
        and obs["transfer_complete_signalled"]
        and obs["tokens_handed_over"] == obs["decode_reserved_tokens"]
        and obs["pages_announced_by_sender"] == obs["decode_reserved_pages"]
        and not obs["prefill_streamed"]
        and obs["decode_committed"]
    )
    if ok:
        return Outcome(
            SAFE, "The fitting prompt was handed over in full: coverage equals the reservation.", obs
        )
    return Outcome(UNSAFE, "The fitting prompt was not handed over in full.", obs)
