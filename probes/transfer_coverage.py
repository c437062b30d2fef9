"""The transferred-coverage check (this pack's own fix ``sbp-transfer-coverage``;
design reference #38704; incident gate 3, "transfer covers read").

Decode attends over exactly the tokens it reserved, so the KV written for a
request must cover all of them. The check: prefill records, with the last
chunk's metadata, how far the KV it wrote reaches; decode's metadata gate
refuses a request whose recorded coverage is short of its reservation (or
missing: an unpatched peer) before the polls' MIN all-reduce, so every
attention-TP rank refuses it together; the refusal is a 500, the pages are
released, a counter and a log line say so.

How it is driven: prefill's real ``send_kv_chunk`` (each chunk, with the
tree's ``MetadataBuffers`` on CPU) and decode's real ``DecodeTransferQueue``
(its constructor, ``pop_transferred``, ``_poll_with_metadata_gate`` and
``_commit_transfer_to_req``), on one rank or two. Stand-ins: the RDMA write
of the metadata row (a row copy between the two ``MetadataBuffers``), the KV
page write itself (nothing to check on a CPU: the pages are counted), the
transport poll (``KVPoll.Success``: the transfer completed), the gloo
all-reduce (two threads meeting at a barrier take the MIN), decode's
preallocation (the reservation is the tree's own ``_pre_alloc_fill_len``,
recorded in ``kv_committed_len`` as ``_pre_alloc`` does), the page pools
(CountingTokenToKVPoolAllocator) and the output streamer.

The refusal cases are unsafe on every release without the fix (a short
handoff is committed and decoded: HTTP 200 over stale pages). The
must-preserve cases are the legitimate handoffs #38704 names: a cached
prefix (prefill's prefix cache and decode's own), chunked prefill, a
rebootstrap with output tokens, a retracted request, a speculative (EAGLE)
handoff with its draft metadata, and attention-TP ranks committing together.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case
from probes.standins import (
    Ledger,
    construct_with,
    describe_finish,
    drop_kv_row,
    give_kv_row,
    make_req,
    pin_runtime,
    sg,
)
from probes.standins_memory import (
    CountingTokenToKVPoolAllocator,
    RecordingReqToMetadataIdxAllocator,
    patch_cache_helpers,
)
from probes.standins_scheduler import make_scheduler_shell
from probes.standins_transport import recording_sender_class

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
            req_to_token_pool=SimpleNamespace(req_to_token=torch.arange(8 * 1024, dtype=torch.int64).reshape(8, 1024)),
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
        self.pages = pages if pages is not None else CountingTokenToKVPoolAllocator(ledger, f"decode{rank}", 1024, PAGE_SIZE)
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
        decode_req = DecodeRequest(req=req, kv_receiver=CompletedTransferReceiver(self.ledger, req.bootstrap_room),
                                   **kwargs)
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
            "recorded_coverage": int(self.buffers.cached_tokens[decode_req.metadata_buffer_index, COVERAGE_SLOT])
            if hasattr(self.buffers, "cached_tokens") else None,  # no such buffer up to 0.5.2
            "committed": any(r is req for r in committed),
            "finish": reason,
            "refusal_message": getattr(req.finished_reason, "message", None) if reason else None,
            "streamed": [s["finish"] for s in self.ledger.of("stream", rid=req.rid)],
            "pages_held": self.pages.held_by(req.rid),
            "release_calls": self.ledger.count("release_kv_cache", rid=req.rid),
            "double_releases": self.ledger.count("pages_double_release"),
            "refusal_counter": getattr(self.queue, "transfer_coverage_refused_reqs", None),
        }


def coverage_rig(ctx, ranks: int = 1) -> MinAllReduce:
    """Pin the runtime, the check's default environment and the all-reduce stand-in."""
    pin_runtime(ctx)
    ctx.setenv(CHECK_ENV, None)  # the default
    collective = MinAllReduce(ranks)
    ctx.patch(sg("disaggregation.utils"), "dist", collective)
    return collective


def _release_from_every_rank(ctx, ledger: Ledger, sides) -> None:
    """The decode module's ``release_kv_cache`` frees a request's pages on whichever rank's pool
    holds them (each side has its own pool), and records the call."""
    pools = [s.pages for s in sides]

    def release_kv_cache(req, tree_cache, *args, **kwargs):
        for pool in pools:
            if pool.held_by(req.rid):
                pool.release(req.rid)
        ledger.record("release_kv_cache", rid=req.rid)

    ctx.patch_if_present(sg("disaggregation.decode"), "release_kv_cache", release_kv_cache)


def _run_ranks(sides, collective) -> list[list]:
    """Each decode rank's ``pop_transferred``, concurrently (they meet in the all-reduce)."""
    results: list[Any] = [None] * len(sides)

    def run(i):
        try:
            results[i] = sides[i].pop(collective)
        except BaseException as e:  # noqa: BLE001 - reported, and the barrier released
            results[i] = e
            collective.barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sides))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def require_coverage_slot() -> None:
    if not hasattr(metadata_buffers(), "cached_tokens"):
        raise NotApplicable("this release's MetadataBuffers has no cached_tokens buffer (added in 0.5.3): the "
                            "transferred-coverage check's spare slot, which carries the coverage, does not exist")


def one_handoff(ctx, *, decode_tokens: int, prefill_tokens: int, rid: str, room: int, output_ids=(),
                rebootstrap: bool = False, spec: bool = False, erase_coverage: bool = False,
                before_commit=None, check_env: str | None = None, **prefill_kw) -> dict[str, Any]:
    """Decode reserves ``decode_tokens``; prefill hands over a ``prefill_tokens``
    sequence; decode's transfer queue polls it. ``check_env``: the value of the
    check's environment variable (None: unset, the default every case runs with)."""
    require_coverage_slot()
    collective = coverage_rig(ctx)
    ctx.setenv(CHECK_ENV, check_env)
    ledger = Ledger()
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), None)
    decode = DecodeSide(ctx, ledger, spec=spec)
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), decode.pages)
    prefill = PrefillSide(ctx, ledger)
    decode_req = decode.expect(rid, room, decode_tokens, output_ids=output_ids, rebootstrap=rebootstrap)
    if before_commit is not None:
        before_commit(decode_req.req)
    preq = prefill.handoff(f"p-{rid}", prefill_tokens, room, spec=spec, **prefill_kw)
    if erase_coverage:  # an unpatched prefill never writes the slot
        prefill.buffers.cached_tokens[preq.metadata_buffer_index, COVERAGE_SLOT] = 0
    decode.land(prefill, preq, decode_req)
    committed = decode.pop(collective)
    obs = decode.outcome(decode_req, committed)
    obs["prefill_last_chunk_tokens"] = int(preq.start_send_idx)
    return obs


def refused(obs: dict[str, Any]) -> bool:
    finish = obs["finish"] or {}
    return (
        not obs["committed"]
        and finish.get("type") == "FINISH_ABORT"
        and int(finish.get("status_code") or 0) >= 500
        and len(obs["streamed"]) == 1
        and obs["pages_held"] == 0
        and obs["release_calls"] == 1
        and not obs["double_releases"]
    )


def _refusal(obs: dict[str, Any], what: str, must_say: str) -> Outcome:
    if refused(obs) and must_say in (obs["refusal_message"] or ""):
        return Outcome(SAFE, f"{what} refused: 500, pages released once, counter {obs['refusal_counter']}.", obs)
    if obs["committed"]:
        return Outcome(UNSAFE, f"{what} committed: decode would attend over {obs['reserved_tokens']} reserved "
                               f"tokens with {obs['prefill_last_chunk_tokens']} written.", obs)
    return Outcome(UNSAFE, f"{what} not refused cleanly (status, release or message).", obs)


def _commit(obs: dict[str, Any], what: str) -> Outcome:
    if obs["committed"] and obs["finish"] is None and obs["pages_held"] > 0 and not obs["release_calls"]:
        return Outcome(SAFE, f"{what} committed: coverage {obs['recorded_coverage']} for "
                             f"{obs['reserved_tokens']} reserved.", obs)
    return Outcome(UNSAFE, f"{what} was not committed.", obs)


# ---------------------------------------------------------------------------


@case(
    proves=("sbp-transfer-coverage",), needs=(">=0.5.3",), beyond_upstream=True,
    must_preserve=False,
    expect="A handoff whose recorded KV coverage is short of decode's reservation is refused at decode: HTTP 500, never committed, pages released once, counted.",
)
def short_coverage_refused(ctx) -> Outcome:
    """The incident's handoff: decode reserved 640 tokens, prefill wrote a
    1-token sequence (the stub of a rejected prompt) and signalled complete."""
    obs = one_handoff(ctx, decode_tokens=640, prefill_tokens=1, rid="short", room=601)
    return _refusal(obs, "The short handoff (1 of 640 tokens)", "short of the reservation")


@case(
    proves=("sbp-transfer-coverage",), needs=(">=0.5.3",), beyond_upstream=True,
    must_preserve=False,
    expect="A handoff from a prefill that recorded no coverage (an unpatched peer) is refused and reported as such, never silently committed.",
)
def unpatched_peer_refused(ctx) -> Outcome:
    """The metadata row as an unpatched prefill writes it: slot 7 never set."""
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="unpatched", room=602, erase_coverage=True)
    return _refusal(obs, "The handoff without recorded coverage", "no transferred KV coverage")


@case(
    proves=("sbp-transfer-coverage",), needs=(">=0.5.3",), beyond_upstream=True,
    must_preserve=False,
    expect="When one attention-TP rank sees a short coverage, every rank refuses the request together; none commits it alone.",
)
def tp_ranks_refuse_together(ctx) -> Outcome:
    """Two decode ranks: rank 0's metadata shows full coverage, rank 1's a short one."""
    return _two_ranks(ctx, short_on_rank1=True)


@case(needs=(">=0.5.3",), beyond_upstream=True, must_preserve=True, expect="A complete handoff is committed with its pages.")
def full_coverage_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="full", room=611)
    return _commit(obs, "The complete handoff")


@case(needs=(">=0.5.3",), beyond_upstream=True,
    must_preserve=True,
    expect="A handoff with a cached prefix (prefill's prefix cache hit, and a prefix decode already holds, so prefill sends only the rest) is committed.",
)
def cached_prefix_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="prefix", room=612,
                      decode_prefix=64, cached_prefix=128)
    return _commit(obs, "The handoff after a 64-token decode-held prefix and a 128-token prefill cache hit")


@case(needs=(">=0.5.3",), beyond_upstream=True, must_preserve=True, expect="A chunked prefill's handoff (several chunks, the last one completing it) is committed.")
def chunked_prefill_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="chunked", room=613, chunk_ends=(64, 128))
    return _commit(obs, "The three-chunk handoff")


def _rebootstrap_or_skip():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    fill = getattr(DecodePreallocQueue, "_pre_alloc_fill_len", None)
    if fill is None or "pd_rebootstrap_in_progress" not in inspect.getsource(fill):
        raise NotApplicable("decode has no PD rebootstrap in this release")


@case(
    needs=(">=0.5.16",), beyond_upstream=True,
    must_preserve=True,
    expect="A rebootstrap with output tokens (decode reserves prompt + emitted tokens, prefill recomputes them all) is committed.",
)
def rebootstrap_output_tokens_committed(ctx) -> Outcome:
    _rebootstrap_or_skip()
    obs = one_handoff(ctx, decode_tokens=100, prefill_tokens=105, rid="rebootstrap", room=614,
                      output_ids=(11, 12, 13, 14, 15), rebootstrap=True)
    return _commit(obs, "The rebootstrap (100 prompt + 5 output tokens)")


@case(
    needs=(">=0.5.16",), beyond_upstream=True,
    must_preserve=True,
    expect="A request that was retracted (its KV state reset by reset_for_retract) and handed off again is committed.",
)
def retracted_request_committed(ctx) -> Outcome:
    _rebootstrap_or_skip()

    def retract(req) -> None:  # the state retraction leaves, then decode's new reservation
        reserved = tree_fill_len(req)
        drop_kv_row(req)  # retraction released the request's KV first
        req.reset_for_retract()
        req.pd_rebootstrap_in_progress = True
        give_kv_row(req, 0, reserved)
        set_reservation(req, reserved)

    obs = one_handoff(ctx, decode_tokens=120, prefill_tokens=120, rid="retracted", room=615, rebootstrap=True,
                      before_commit=retract)
    return _commit(obs, "The retracted request's new handoff")


@case(needs=(">=0.5.3",), beyond_upstream=True,
    must_preserve=True,
    expect="A speculative (EAGLE) handoff, whose metadata carries the draft model's hidden states and top-k, is committed.",
)
def speculative_transfer_committed(ctx) -> Outcome:
    obs = one_handoff(ctx, decode_tokens=200, prefill_tokens=200, rid="spec", room=616, spec=True)
    return _commit(obs, "The EAGLE handoff")


@case(needs=(">=0.5.3",), beyond_upstream=True, must_preserve=True, expect="Two attention-TP ranks that both see a complete handoff commit it together.")
def tp_ranks_commit_together(ctx) -> Outcome:
    return _two_ranks(ctx, short_on_rank1=False)


def _two_ranks(ctx, *, short_on_rank1: bool) -> Outcome:
    require_coverage_slot()
    collective = coverage_rig(ctx, ranks=2)
    ledger = Ledger()
    sides = [DecodeSide(ctx, ledger, rank=r) for r in range(2)]
    _release_from_every_rank(ctx, ledger, sides)
    prefills = [PrefillSide(ctx, ledger) for _ in range(2)]
    obs = []
    decode_reqs = [s.expect(f"tp-r{s.rank}", 621, 200) for s in sides]
    for r, (side, prefill, dreq) in enumerate(zip(sides, prefills, decode_reqs)):
        written = 16 if (short_on_rank1 and r == 1) else 200
        preq = prefill.handoff(f"p-tp-r{r}", written, 621)
        side.land(prefill, preq, dreq)
    results = _run_ranks(sides, collective)
    for side, dreq, committed in zip(sides, decode_reqs, results):
        o = side.outcome(dreq, committed)
        o["streamed"] = [s["finish"] for s in ledger.of("stream", rid=dreq.req.rid)]
        o["release_calls"] = ledger.count("release_kv_cache", rid=dreq.req.rid)
        obs.append(o)
    details = {"ranks": obs}
    committed = [o["committed"] for o in obs]
    if short_on_rank1:
        if not any(committed) and all(refused(o) for o in obs):
            return Outcome(SAFE, "Both ranks refused the request (rank 1 saw 16 of 200 tokens).", details)
        if all(committed):
            return Outcome(UNSAFE, "Both ranks committed although rank 1's KV covers 16 of 200 tokens.", details)
        return Outcome(UNSAFE, f"The ranks disagreed (committed per rank: {committed}).", details)
    if all(committed) and all(o["finish"] is None for o in obs):
        return Outcome(SAFE, "Both ranks committed the complete handoff.", details)
    return Outcome(UNSAFE, f"The ranks did not both commit (committed per rank: {committed}).", details)


# --- decode host receive (0.5.21+): the reservation is made after Success ---


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


def _host_receive_or_skip() -> None:
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest

    if not hasattr(DecodePreallocQueue, "allocate_host_staged") or "host_staged" not in getattr(
            DecodeRequest, "__dataclass_fields__", {}):
        raise NotApplicable("decode has no host receive (allocate_host_staged) in this release")


def host_staged_handoff(ctx, *, prompt_tokens: int, prefill_tokens: int, rid: str, room: int) -> dict[str, Any]:
    """Decode admitted the request to host pages (``_pre_alloc_host``: no device
    reservation yet, ``kv_committed_len`` unset); prefill writes a
    ``prefill_tokens`` sequence there; decode's real transfer queue polls it."""
    from sglang.srt.disaggregation.decode import DecodeRequest

    _host_receive_or_skip()
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
    obs["held_for_drain"] = any(entry[0] is decode_req for entry in getattr(decode.queue, "_deferred_releases", []))
    obs["host_released"] = ledger.count("discard_host_backup", rid=rid)
    return obs


@case(
    proves=("sbp-transfer-coverage",), needs=(">=0.5.21",), beyond_upstream=True,
    must_preserve=False,
    expect="With decode host receive, a host-staged handoff whose recorded coverage is short of the prompt decode will reserve for it is refused (500, never committed, no device pages reserved, host pages held for the drain), not compared with the still-unset kv_committed_len.",
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
        return Outcome(SAFE, "The short host-staged handoff (1 of 640 tokens) refused: 500, no device pages "
                             f"reserved, host pages {'held for the drain ACK' if obs['held_for_drain'] else 'released once'}.", obs)
    if obs["committed"]:
        return Outcome(UNSAFE, f"The short host-staged handoff committed: decode reserved {obs['reserved_tokens']} "
                               f"device tokens after Success with {obs['prefill_last_chunk_tokens']} written.", obs)
    return Outcome(UNSAFE, "The short host-staged handoff not refused cleanly (status, pages or message).", obs)


@case(needs=(">=0.5.21",), beyond_upstream=True, must_preserve=True,
      expect="With decode host receive, a complete host-staged handoff is committed with the device pages allocate_host_staged reserves.")
def host_staged_full_coverage_committed(ctx) -> Outcome:
    obs = host_staged_handoff(ctx, prompt_tokens=200, prefill_tokens=200, rid="host-full", room=632)
    return _commit(obs, "The complete host-staged handoff")


# --- a refusal while a decode HiCache load-back is pending (0.5.16 - 0.5.19) ---


def _restore_side(ctx, ledger, rank: int, prompt_tokens: int, room: int):
    """A decode rank with HiCache on whose request restores a 32-token prefix
    from host memory: the load-back is queued and its copy still running."""
    import torch
    from sglang.srt.disaggregation.decode import HiCacheRestoreResult
    from sglang.srt.disaggregation.decode_hicache_mixin import DecodePrefixMatch

    from probes.standins_hicache import restore_tree, start_load_back

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


def _restore_rig_or_skip(*, refusal: bool = True) -> None:
    import importlib.util

    from sglang.srt.disaggregation import decode, utils

    if refusal and not hasattr(utils, "transfer_coverage_error"):
        raise NotApplicable("this tree has no transferred-coverage check, so no refusal to take the Failed path")
    fields = getattr(decode.DecodeRequest, "__dataclass_fields__", {})
    if (not hasattr(decode, "HiCacheRestoreGatedKVReceiver") or "hicache_restored_node" not in fields
            or importlib.util.find_spec("sglang.srt.mem_cache.hiradix_cache") is None):
        raise NotApplicable("decode has no HiCache restore by hicache_restored_node in this release")
    if {"hicache_restore_lock_receipt", "hicache_restore_lock"} & set(fields):
        raise NotApplicable("decode releases the restore through lock receipts here (0.5.20+), "
                            "which this rig does not build")
    from packaging.version import Version
    from sglang.version import __version__

    if Version(__version__) < Version("0.5.16"):
        raise NotApplicable("before 0.5.16 decode's restore state machine differs from the one this rig drives")


@case(
    proves=("sbp-transfer-coverage",), needs=("sbp-transfer-coverage", ">=0.5.16,<0.5.20"), beyond_upstream=True,
    must_preserve=False,
    expect="When the coverage check on one attention-TP rank refuses a request while another rank's HiCache load-back for it is still copying, that rank's Failed path (_clean_hicache_prefetch_resources) releases only decode's own lock: the tree's in-flight lock keeps the copy's device pages from eviction and reuse until the copy finishes, then they are reclaimed.",
)
def refusal_during_pending_restore_keeps_restore_pages(ctx) -> Outcome:
    """Rank 0 sees 16 of 200 tokens (refused); rank 1's restore is PENDING with
    its copy running, so rank 1 learns of the refusal only through the MIN
    all-reduce. Then memory pressure evicts everything evictable, before and
    after the copy finishes (the tree's real ``evict`` and ``loading_check``).
    0.5.20+ releases the restore through lock receipts, which this rig does not build."""
    from probes.standins_hicache import evict_all

    _restore_rig_or_skip()
    collective = coverage_rig(ctx, ranks=2)
    ledger = Ledger()
    plain = DecodeSide(ctx, ledger, rank=0)
    restoring, rdreq, hc = _restore_side(ctx, ledger, 1, 200, 641)
    _release_from_every_rank(ctx, ledger, (plain, restoring))
    pdreq = plain.expect("restore-r0", 641, 200)
    for side, dreq, written, prefix in ((plain, pdreq, 16, 0), (restoring, rdreq, 200, 32)):
        prefill = PrefillSide(ctx, ledger)
        side.land(prefill, prefill.handoff(f"p-{dreq.req.rid}", written, 641, decode_prefix=prefix), dreq)
    results = _run_ranks([plain, restoring], collective)
    outcome = restoring.outcome(rdreq, results[1])
    outcome["streamed"] = [s["finish"] for s in ledger.of("stream", rid=rdreq.req.rid)]
    outcome["release_calls"] = ledger.count("release_kv_cache", rid=rdreq.req.rid)
    evicted_while_copying = evict_all(hc)
    freed_while_copying = sorted(set(hc.pages.freed) & set(hc.restore_pages))
    hc.dma.done = True
    hc.tree.loading_check()
    evicted_after = evict_all(hc)
    freed_after = sorted(set(hc.pages.freed) & set(hc.restore_pages))
    details = {"rank1": outcome, "rank0": plain.outcome(pdreq, results[0]),
               "rank0_committed": any(r is pdreq.req for r in results[0]),
               "node_lock_after_refusal_and_copy": hc.node.lock_ref,
               "evicted_while_copying": evicted_while_copying, "restore_pages_freed_while_copying": freed_while_copying,
               "evicted_after_copy": evicted_after, "restore_pages_freed_after_copy": len(freed_after)}
    if not refused(outcome) or details["rank0_committed"]:
        return Outcome(UNSAFE, "The refusal did not reach the restoring rank's Failed path cleanly.", details)
    if freed_while_copying:
        return Outcome(UNSAFE, f"{len(freed_while_copying)} restore pages were freed for reuse while the load-back "
                               "still copied into them.", details)
    if len(freed_after) != len(hc.restore_pages):
        return Outcome(UNSAFE, "The restore pages were never reclaimed after the copy finished (a leak).", details)
    return Outcome(SAFE, f"The restoring rank refused on the MIN; its {len(hc.restore_pages)} restore pages stayed "
                         "locked by the tree's in-flight load-back until the copy finished, then were reclaimed.",
                   details)


@case(
    needs=(">=0.5.16,<0.5.20",), beyond_upstream=True,
    must_preserve=True,
    expect="A complete handoff whose decode HiCache restore is pending is held until the load-back finishes and then committed with the restored prefix.",
)
def restored_handoff_committed(ctx) -> Outcome:
    _restore_rig_or_skip(refusal=False)
    collective = coverage_rig(ctx)
    ledger = Ledger()
    side, dreq, hc = _restore_side(ctx, ledger, 0, 200, 642)
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
    return _commit(obs, "The restored handoff (32 restored + 168 transferred tokens)")
