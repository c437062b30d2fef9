"""Decode's transfer queue with a failed transfer, for the page_lifetime, flush_holds and mori_hold
cases (not a probe: no cases here).

The tree's ``DecodeTransferQueue`` (its real constructor, called with the parameters its release
asks for) with one request whose transfer failed (``TransferRig``), and the tree's real
``CommonKVReceiver`` notification path and ``CommonKVManager`` ACK tracker on instances built
without their network constructors: a backend that acknowledges drains
(``drain_acking_manager``, standing for Mooncake/NIXL), one without the capability
(``no_capability_manager``), the FAKE backend's own receiver (``fake_receiver``). Stand-ins: the
transport poll, the prefill peers' sockets (``PrefillPeerSocket``), the drain ACKs (``note_ack``),
the page pool and the metadata allocator; ``RaisedRecorder``/``WarningRecorder`` read the decode
module's log.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from ..standins import Ledger, construct_with, give_kv_row, make_req, pin_runtime, sg, sg_attr
from ..standins.memory import (
    CountingTokenToKVPoolAllocator,
    MetadataBuffersStandIn,
    RecordingReqToMetadataIdxAllocator,
    ReqToTokenPoolStandIn,
    patch_cache_helpers,
)
from ..standins.scheduler import make_scheduler_shell
from .coverage import MinAllReduce

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
PAGE_SIZE = 16
PROMPT_TOKENS = 64


def flag_from_env(manager_cls) -> bool:
    """``CommonKVManager.__init__``'s expression for
    ``enable_deferred_decode_kv_release``: the env flag (absent before
    0.5.19), and from 0.5.21 the backend class capability."""
    envs = sg_attr("environ", "envs")
    flag = False
    if envs is not None and hasattr(envs, DEFERRED_ENV):
        flag = bool(getattr(envs, DEFERRED_ENV).get())
    if hasattr(manager_cls, "supports_deferred_decode_kv_release"):
        flag = flag and bool(manager_cls.supports_deferred_decode_kv_release)
    return flag


def drain_acking_manager(ledger: Ledger):
    """A KV manager of a backend that acknowledges drains (Mooncake/NIXL)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    cls = type(
        "DrainAckingKVManager",
        (CommonKVManager,),
        {"supports_deferred_decode_kv_release": True},
    )
    mgr = object.__new__(cls)
    mgr.__dict__.update(
        request_status={},
        required_prefill_response_num_table={},
        prefill_response_tracker=defaultdict(set),
        addr_to_rooms_tracker=defaultdict(set),
        prefill_info_table={},
        failure_records={},
        failure_lock=threading.Lock(),
        _deferred_abort_ack_tracker={},
        _deferred_abort_generation=0,
        local_ip="10.0.0.3",
        rank_port=17000,
        defer_decode_allocation=False,
    )
    mgr.enable_deferred_decode_kv_release = flag_from_env(cls)
    return mgr


class PrefillPeerSocket:
    """Stands for the ZMQ socket to one prefill rank: records the ABORT."""

    def __init__(self, ledger: Ledger, rank: int) -> None:
        self.ledger, self.rank = ledger, rank

    def send_multipart(self, frames, *args, **kwargs):
        self.ledger.record("abort_sent", prefill_rank=self.rank)


def drain_acking_receiver(ledger: Ledger, mgr, room: int, prefill_ranks: int):
    """The tree's ``CommonKVReceiver`` after a published ``send_metadata``:
    ``prefill_ranks`` prefill ranks hold destinations for the room."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    def connect(self, bootstrap_info):
        return PrefillPeerSocket(ledger, bootstrap_info["rank"]), threading.Lock()

    def failure_exception(self):
        raise ConnectionError("probe: KV transfer failed on the prefill side")

    def poll(self):
        from sglang.srt.disaggregation.base import KVPoll

        return KVPoll.Failed

    members = {
        "_connect_to_bootstrap_server": connect,
        "failure_exception": failure_exception,
        "poll": poll,  # abstract before 0.5.22; the stand-in transport failed
    }
    if "init" in getattr(CommonKVReceiver, "__abstractmethods__", ()):
        # abstract up to 0.5.9; never called here: the metadata was published before the case starts
        members["init"] = lambda self, *args, **kwargs: None
    cls = type("DrainAckingKVReceiver", (CommonKVReceiver,), members)
    rcv = object.__new__(cls)
    rcv.__dict__.update(
        kv_mgr=mgr,
        bootstrap_room=room,
        bootstrap_addr="10.0.0.2:8998",
        bootstrap_infos=[
            {"rank": r, "rank_ip": "10.0.0.2", "rank_port": 18000 + r} for r in range(prefill_ranks)
        ],
        abort_notified=False,
        init_time=1.0,  # metadata was published: prefill may be writing
        conclude_state=None,
        _abort_generation=None,
        _owns_bootstrap_room=True,
        _lifecycle_lock=threading.Lock(),
        require_staging=False,
    )
    return rcv


def fake_receiver(room: int):
    """The FAKE backend (no drain-ACK capability): its real manager and receiver."""
    from sglang.srt.disaggregation.fake import conn

    # up to 0.5.4.post2 the FAKE backend has no manager of its own: its receiver keeps whatever it is given
    mgr = object.__new__(conn.FakeKVManager) if hasattr(conn, "FakeKVManager") else SimpleNamespace()
    FakeKVReceiver = conn.FakeKVReceiver
    return FakeKVReceiver(mgr=mgr, bootstrap_addr="10.0.0.2:8998", bootstrap_room=room)


def note_ack(mgr, room: int, rank: int, generation: int | None) -> None:
    """A drain ACK from one prefill rank, as the decode receiver thread records it."""
    params = inspect.signature(mgr.note_abort_ack).parameters
    if "generation" in params:
        mgr.note_abort_ack(room, rank, generation)
    else:
        mgr.note_abort_ack(room, rank)


def own_polls(ctx, side: str) -> None:
    """Up to 0.5.12.post1 a PD queue all-reduces its transfer objects' polls over a process group a
    CPU probe does not have: one TP rank here, so the all-reduce is the polls themselves (`side`:
    the disaggregation module whose queue polls, "decode" or "prefill")."""
    ctx.patch(sg(f"disaggregation.{side}"), "poll_and_all_reduce",
              lambda pollers, *a, **k: [p.poll() for p in pollers])


# What the tree's pop_transferred raises on a Failed poll up to 0.4.6.post4 (no failure branch).
TRANSFER_FAILED_STOP = "Transfer failed"


def failure_stops_decode() -> bool:
    """Read from the tree's code: a Failed poll stops decode (`raise Exception("Transfer failed")` in
    ``DecodeTransferQueue.pop_transferred``, up to 0.4.6.post4) instead of releasing the request; the
    pack's refused-room release there keeps that for a transfer's own Failed."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    source = inspect.getsource(DecodeTransferQueue.pop_transferred)
    return f'raise Exception("{TRANSFER_FAILED_STOP}")' in source


class TransferRig:
    """The tree's DecodeTransferQueue with one request whose transfer failed."""

    def __init__(self, ctx, deferred_env: str | None = None) -> None:
        from sglang.srt.disaggregation.decode import DecodeTransferQueue

        pin_runtime(ctx)
        ctx.setenv(DEFERRED_ENV, deferred_env)  # None: the release's default
        self.ledger = Ledger()
        self.pages = CountingTokenToKVPoolAllocator(self.ledger, "decode", 1024, PAGE_SIZE)
        patch_cache_helpers(ctx, self.ledger, sg("disaggregation.decode"), self.pages)
        self.metadata = RecordingReqToMetadataIdxAllocator(self.ledger)
        # Rows of token slots: up to 0.4.6.post4 the pack's refused-room release frees a
        # request's row through the scheduler's pools itself (no release_kv_cache helper).
        self.rows = ReqToTokenPoolStandIn(self.ledger)
        self.shell = make_scheduler_shell(self.ledger, token_to_kv_pool_allocator=self.pages,
                                          req_to_token_pool=self.rows, num_tokens_pre_allocated=0)
        self.queue = construct_with(
            DecodeTransferQueue,
            gloo_group=None,
            req_to_metadata_buffer_idx_allocator=self.metadata,
            tp_rank=0,
            metadata_buffers=MetadataBuffersStandIn(),
            scheduler=self.shell,
            tree_cache=self.shell.tree_cache,
        )
        self.queue.enable_host_receive = False
        from sglang.srt.disaggregation.base import KVPoll

        # The transport's verdict for every queued room: the transfer failed.
        self.queue._poll_with_metadata_gate = lambda: [KVPoll.Failed] * len(self.queue.queue)
        # Up to 0.5.12.post1 pop_transferred all-reduces the polls itself, over
        # a process group a CPU probe does not have; the same verdict stands in.
        if not hasattr(DecodeTransferQueue, "_poll_with_metadata_gate"):
            ctx.patch_if_present(
                sg("disaggregation.decode"),
                "poll_and_all_reduce",
                lambda pollers, *a, **k: [KVPoll.Failed] * len(pollers),
            )
        # 0.5.23 agrees the hold decision across decode ranks (`all_reduce_flags` over the
        # gloo group): one rank here, where the release's own code keeps the flags as they are.
        if hasattr(sg("disaggregation.utils"), "all_reduce_flags"):
            ctx.patch(sg("disaggregation.utils"), "dist", MinAllReduce(1))
        # This pack's sbp-abort-hold (below 0.5.13) agrees its release the same way, through
        # torch.distributed: one rank here, the flags as they are.
        if hasattr(DecodeTransferQueue, "_held_releases_due"):
            import torch.distributed

            ctx.patch(torch.distributed, "all_reduce", lambda tensor, *a, **k: None)
        self.queue.enable_staging = False

    @staticmethod
    def poll_receivers(ctx) -> None:
        """Up to 0.5.12.post1: the queue reads its receivers' own polls instead of the stand-in
        verdict."""
        own_polls(ctx, "decode")

    def enqueue(self, receiver, rid: str, room: int):
        from sglang.srt.disaggregation.decode import DecodeRequest

        req = make_req(rid, PROMPT_TOKENS, room=room)
        pages = self.pages.reserve(rid, PROMPT_TOKENS)
        row = self.rows.assign(self.pages.token_slots(pages)[:PROMPT_TOKENS])
        give_kv_row(req, row, PROMPT_TOKENS)
        decode_req = DecodeRequest(req=req, kv_receiver=receiver)
        decode_req.metadata_buffer_index = self.metadata.alloc()
        self.queue.queue.append(decode_req)
        return req

    def resolve(self) -> bool:
        """Run the release resolver if the release has one."""
        if not hasattr(self.queue, "resolve_deferred_releases"):
            return False
        # 0.5.23 logs and drops an exception of one release so the others still run: here that
        # is a stand-in the tree's code does not fit, an error, never a verdict on the pages.
        with decode_log(RaisedRecorder()) as recorder:
            self.queue.resolve_deferred_releases()
        if recorder.raised:
            raise RuntimeError(f"the release isolated an exception while resolving: {recorder.raised[0]}")
        return True

    def release_due(self) -> None:
        """The release's own pass over held pages: its resolver (0.5.13 on), else, where the
        pack's sbp-abort-hold holds (below 0.5.13), the next ``pop_transferred``, which releases
        what is due."""
        if not self.resolve() and hasattr(self.queue, "_held_releases_due"):
            self.queue.pop_transferred()

    def snapshot(self, req) -> dict[str, Any]:
        return {
            "pages_held": self.pages.held_by(req.rid),
            "release_calls": self.ledger.count("release_kv_cache", rid=req.rid),
            "metadata_frees": self.ledger.count("metadata_free"),
            "deferred_entries": len(getattr(self.queue, "_deferred_releases", ())),
            # what metrics read (0.5.22, and the pack's #41404 backports); None where absent
            "held_count_reported": (
                self.queue.num_pending_deferred_releases()
                if callable(getattr(self.queue, "num_pending_deferred_releases", None))
                else None
            ),
        }


def no_capability_manager(ledger: Ledger):
    """A KV manager of a backend without the drain-ACK capability: any
    ``CommonKVManager`` that does not opt in (Mori itself: probes/cases/mori_hold.py)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    # No opt-in of its own: the release's CommonKVManager default decides.
    cls = type("NoDrainAckKVManager", (CommonKVManager,), {})
    mgr = object.__new__(cls)
    mgr.__dict__.update(drain_acking_manager(ledger).__dict__)
    mgr.enable_deferred_decode_kv_release = flag_from_env(cls)
    return mgr


class RaisedRecorder(logging.Handler):
    """Collects the records a logger wrote with an exception attached (``logger.exception``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.raised: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.raised.append(
                f"{record.getMessage()}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            )


@contextlib.contextmanager
def decode_log(recorder: logging.Handler):
    """`recorder` attached to the tree's decode module logger for the block."""
    decode_logger = logging.getLogger(sg("disaggregation.decode").__name__)
    decode_logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        decode_logger.removeHandler(recorder)


class WarningRecorder(logging.Handler):
    """Collects the WARNING records of the decode module's logger."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
