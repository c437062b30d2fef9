"""Decode page lifetime after a failed transfer (#35049, #37454, #40645, #41023,
#41402, #41404; incident gate 4).

A transfer that fails on the decode side may still have RDMA writes from
prefill ranks in flight toward the pages decode preallocated. If decode
returns those pages to the allocator at once, the next request can be given
them and have them overwritten by the late write. The fix chain holds the
pages (and the metadata slot) in ``DecodeTransferQueue._deferred_releases``
until every notified prefill rank has sent its drain ACK
(``CommonKVManager.register_deferred_abort_room`` / ``note_abort_ack`` /
``is_abort_release_safe``), then releases them exactly once. #35049 added it
behind ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` (off by default,
decode-initiated aborts only), #37454 gated it on a backend capability,
#41023 turned it on by default and #41404 holds on every failure.

All cases but two run with the release's DEFAULT environment (the variable
unset), which is what operators run; ``explicit_deferral_on_incapable_backend_is_reported``
and ``explicit_deferral_warnings_not_repeated`` set it to 1, as an operator who
asks for deferral does, and capture the decode module's warnings.

How it is driven: the tree's ``DecodeTransferQueue`` (its real constructor,
called with the parameters its release asks for), its real
``pop_transferred`` and ``resolve_deferred_releases``, and the tree's real
``CommonKVReceiver`` notification path and ``CommonKVManager`` ACK tracker on
instances built without their network constructors. Stand-ins: the transport
poll (reports ``KVPoll.Failed`` for the room, in place of the all-reduced
poll), the prefill peers' sockets (record the ABORT each rank is sent), the
drain ACKs (delivered by calling ``note_abort_ack`` as the receiver thread
would), the page pool (CountingTokenToKVPoolAllocator, fed by the ``release_kv_cache``
recorder) and the metadata allocator. ``enable_host_receive`` is forced off
(host-staged receive is a different path). The capable backend is a
``CommonKVManager`` subclass that opts in (``supports_deferred_decode_kv_release
= True``), standing for Mooncake/NIXL; its ``enable_deferred_decode_kv_release``
is computed with the constructor's own expression (the environment flag, and
the class capability where the release has one).

Absent structures, decided per case:
- ``failed_transfer_holds_pages_until_drain`` on 0.5.17/0.5.18 (no deferral
  at all) is ``unsafe``, not ``not-applicable``: the unsafe behaviour is
  observable there, the real ``pop_transferred`` returns the pages at once.
- ``ack_before_registration_not_counted`` and ``ack_after_release_not_counted``
  exercise the ACK tracker itself; where ``CommonKVManager`` has no tracker
  (0.5.17/0.5.18) there is nothing to drive: ``not-applicable``.
- ``no_capability_backend_releases_at_once`` runs everywhere (the FAKE
  backend exists in every release).
- ``explicit_deferral_on_incapable_backend_is_reported`` is ``not-applicable``
  where the release has no deferral variable (before 0.5.19). Its backend is
  a ``CommonKVManager`` without an opt-in of its own (any backend without
  the capability); Mori's own decode is judged by the ``mori_hold`` probe.
- ``waiting_timeout_holds_pages_until_drain`` runs the real
  ``CommonKVReceiver._check_waiting_timeout``; ``scheduler_abort_keeps_raced_ack``
  the real ``Scheduler.abort_request`` on a decode scheduler shell, with a
  prefill socket that answers the ABORT with its ACK at once; it is
  ``not-applicable`` where decode has no ACK tracker (before 0.5.19).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case, judged
from probes.standins import Ledger, construct_with, give_kv_row, make_req, pin_runtime, sg, sg_attr
from probes.standins_memory import (
    CountingTokenToKVPoolAllocator,
    MetadataBuffersStandIn,
    RecordingReqToMetadataIdxAllocator,
    patch_cache_helpers,
)
from probes.standins_scheduler import InertCollaborator, make_scheduler_shell
from probes.transfer_coverage import MinAllReduce

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
PAGE_SIZE = 16
PROMPT_TOKENS = 64


def _flag_from_env(manager_cls) -> bool:
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


def _drain_acking_manager(ledger: Ledger):
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
    mgr.enable_deferred_decode_kv_release = _flag_from_env(cls)
    return mgr


class _PrefillPeerSocket:
    """Stands for the ZMQ socket to one prefill rank: records the ABORT."""

    def __init__(self, ledger: Ledger, rank: int) -> None:
        self.ledger, self.rank = ledger, rank

    def send_multipart(self, frames, *args, **kwargs):
        self.ledger.record("abort_sent", prefill_rank=self.rank)


def _drain_acking_receiver(ledger: Ledger, mgr, room: int, prefill_ranks: int):
    """The tree's ``CommonKVReceiver`` after a published ``send_metadata``:
    ``prefill_ranks`` prefill ranks hold destinations for the room."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    def connect(self, bootstrap_info):
        return _PrefillPeerSocket(ledger, bootstrap_info["rank"]), threading.Lock()

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


def _fake_receiver(room: int):
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
        self.shell = make_scheduler_shell(self.ledger, token_to_kv_pool_allocator=self.pages)
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
        self.queue.enable_staging = False

    def enqueue(self, receiver, rid: str, room: int):
        from sglang.srt.disaggregation.decode import DecodeRequest

        req = make_req(rid, PROMPT_TOKENS, room=room)
        self.pages.reserve(rid, PROMPT_TOKENS)
        give_kv_row(req, 0, PROMPT_TOKENS)
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
        with _decode_log(_RaisedRecorder()) as recorder:
            self.queue.resolve_deferred_releases()
        if recorder.raised:
            raise RuntimeError(f"the release isolated an exception while resolving: {recorder.raised[0]}")
        return True

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


# ---------------------------------------------------------------------------


@case(
    # disaggregation.common (the receiver this case drives) arrives in 0.4.7
    proves=("pr35049", "pr41023", "pr41404"), needs=(">=0.4.7",),
    must_preserve=False,
    expect='With the default environment, a failed transfer that decode did not initiate keeps its pages and metadata slot until every prefill rank has ACKed the drain, then releases them exactly once.',
)
def failed_transfer_holds_pages_until_drain(ctx) -> Outcome:
    """#41404 + #41023: a failure decode did not initiate (prefill fault,
    transport error) reaching ``pop_transferred`` under the default env holds
    the pages until both prefill ranks ACK the drain, then releases them once."""
    rig = TransferRig(ctx)
    mgr = _drain_acking_manager(rig.ledger)
    rcv = _drain_acking_receiver(rig.ledger, mgr, room=501, prefill_ranks=2)
    req = rig.enqueue(rcv, "failed-transfer", 501)
    steps: list[dict[str, Any]] = []

    def step(name: str, all_acked: bool) -> None:
        steps.append({"step": name, "all_acks_in": all_acked, **rig.snapshot(req)})

    rig.queue.pop_transferred()
    step("pop_transferred(Failed)", False)
    has_resolver = rig.resolve()
    step("resolve, no ACK", False)
    generation = getattr(rcv, "_abort_generation", None)
    if hasattr(mgr, "note_abort_ack"):
        note_ack(mgr, 501, 0, generation)
        rig.resolve()
        step("ACK rank 0, resolve", False)
        note_ack(mgr, 501, 1, generation)
        rig.resolve()
        step("ACK rank 1, resolve", True)
    rig.resolve()
    step("resolve again", hasattr(mgr, "note_abort_ack"))

    details = {
        "deferred_release_flag": bool(getattr(rig.queue, "enable_deferred_kv_release", False)),
        "backend_flag": bool(getattr(mgr, "enable_deferred_decode_kv_release", False)),
        "has_resolver": has_resolver,
        "abort_sent_to_prefill_ranks": sorted(e["prefill_rank"] for e in rig.ledger.of("abort_sent")),
        "double_releases": rig.ledger.count("pages_double_release"),
        "steps": steps,
    }
    freed_early = [s["step"] for s in steps if not s["all_acks_in"] and s["pages_held"] == 0]
    final = steps[-1]
    released_once = final["pages_held"] == 0 and final["release_calls"] == 1 and final["metadata_frees"] == 1
    # The held count operators see must say what is held: one request while its pages are, none after.
    miscounted = [s["step"] for s in steps
                  if s["held_count_reported"] is not None and s["held_count_reported"] != int(s["pages_held"] > 0)]
    if miscounted:
        return Outcome(UNSAFE, f"num_pending_deferred_releases() disagrees with the pages held (at: {miscounted[0]}).",
                       details)
    if not freed_early and released_once and not details["double_releases"]:
        return Outcome(
            SAFE,
            "Pages held through the failure and the first ACK, released once after both drain ACKs.",
            details,
        )
    if freed_early:
        return Outcome(
            UNSAFE,
            f"Pages returned to the allocator before every drain ACK (first at: {freed_early[0]}).",
            details,
        )
    return Outcome(UNSAFE, "Pages were not released exactly once after the drain ACKs.", details)


def _tracker_or_skip():
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    if not hasattr(CommonKVManager, "register_deferred_abort_room"):
        raise NotApplicable("CommonKVManager has no deferred-abort ACK tracker in this release (no #35049)")


@case(
    proves=("pr35049",), needs=("pr35049", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect='A drain ACK that arrives before the room is registered does not count toward its release.',
)
def ack_before_registration_not_counted(ctx) -> Outcome:
    """#35049: an ACK for a room that is not held (it arrived before the room
    was registered) is dropped; after registration the room still needs
    fresh ACKs."""
    _tracker_or_skip()
    pin_runtime(ctx)
    ledger = Ledger()
    mgr = _drain_acking_manager(ledger)
    note_ack(mgr, 502, 0, 1)  # early ACK (a previous generation's, where generations exist)
    generation = mgr.register_deferred_abort_room(502)
    safe_after_early = mgr.is_abort_release_safe(502, 1)
    note_ack(mgr, 502, 0, generation)
    safe_after_fresh = mgr.is_abort_release_safe(502, 1)
    details = {
        "release_safe_after_early_ack": safe_after_early,
        "release_safe_after_fresh_ack": safe_after_fresh,
    }
    if not safe_after_early and safe_after_fresh:
        return Outcome(SAFE, "The early ACK was ignored; only the ACK after registration counted.", details)
    return Outcome(UNSAFE, "An ACK from before registration counted toward release.", details)


@case(
    proves=("pr35049",), needs=("pr35049", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="A drain ACK that arrives after the room was released does not count for the room's next request.",
)
def ack_after_release_not_counted(ctx) -> Outcome:
    """#35049: once a room was released, a late ACK for it is dropped, so a
    reused ``bootstrap_room`` is not pre-acknowledged for its next request."""
    _tracker_or_skip()
    pin_runtime(ctx)
    ledger = Ledger()
    mgr = _drain_acking_manager(ledger)
    first = mgr.register_deferred_abort_room(503)
    note_ack(mgr, 503, 0, first)
    drained = mgr.is_abort_release_safe(503, 1)
    mgr.clear_deferred_abort_state(503)  # what the release does
    note_ack(mgr, 503, 1, first)  # a late duplicate from another rank
    tracked_after_late = 503 in mgr._deferred_abort_ack_tracker
    second = mgr.register_deferred_abort_room(503)  # room reused by a new request
    safe_on_reuse = mgr.is_abort_release_safe(503, 1)
    details = {
        "first_hold_drained": drained,
        "room_tracked_after_late_ack": tracked_after_late,
        "reused_room_release_safe_without_ack": safe_on_reuse,
        "second_registration_returned_generation": second is not None,
    }
    if drained and not tracked_after_late and not safe_on_reuse:
        return Outcome(SAFE, "The late ACK was dropped; the reused room waits for its own ACK.", details)
    return Outcome(UNSAFE, "A late ACK survived release and counted for the reused room.", details)


@case(
    # up to 0.4.6.post4 decode has no failed-transfer path (pop_transferred raises "Transfer failed")
    needs=(">=0.4.6.post5",),
    must_preserve=True,
    expect="A backend without the drain-ACK capability releases a failed transfer's pages at once, exactly once.",
)
def no_capability_backend_releases_at_once(ctx) -> Outcome:
    """#37454 must-preserve: a backend without the drain-ACK capability
    (FAKE) releases a failed transfer's pages at once, exactly once, and
    holds nothing."""
    rig = TransferRig(ctx)
    rcv = _fake_receiver(504)
    req = rig.enqueue(rcv, "fake-failed", 504)
    rig.queue.pop_transferred()
    after_pop = rig.snapshot(req)
    rig.resolve()
    after_resolve = rig.snapshot(req)
    details = {
        "after_pop_transferred": after_pop,
        "after_resolve": after_resolve,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    ok = (
        after_pop["pages_held"] == 0
        and after_pop["release_calls"] == 1
        and after_pop["metadata_frees"] == 1
        and after_pop["deferred_entries"] == 0
        and after_resolve["release_calls"] == 1
        and not details["double_releases"]
    )
    if ok:
        return Outcome(
            SAFE, "The FAKE backend's failed transfer was released at once, exactly once.", details
        )
    return Outcome(
        UNSAFE, "The FAKE backend's failed transfer was not released at once exactly once.", details
    )


def _no_capability_manager(ledger: Ledger):
    """A KV manager of a backend without the drain-ACK capability: any
    ``CommonKVManager`` that does not opt in (Mori itself: probes/mori_hold.py)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    # No opt-in of its own: the release's CommonKVManager default decides.
    cls = type("NoDrainAckKVManager", (CommonKVManager,), {})
    mgr = object.__new__(cls)
    mgr.__dict__.update(_drain_acking_manager(ledger).__dict__)
    mgr.enable_deferred_decode_kv_release = _flag_from_env(cls)
    return mgr


class _RaisedRecorder(logging.Handler):
    """Collects the records a logger wrote with an exception attached (``logger.exception``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.raised: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.raised.append(f"{record.getMessage()}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}")


@contextlib.contextmanager
def _decode_log(recorder: logging.Handler):
    """`recorder` attached to the tree's decode module logger for the block."""
    decode_logger = logging.getLogger(sg("disaggregation.decode").__name__)
    decode_logger.addHandler(recorder)
    try:
        yield recorder
    finally:
        decode_logger.removeHandler(recorder)


class _WarningRecorder(logging.Handler):
    """Collects the WARNING records of the decode module's logger."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@case(
    needs=("pr35049",),
    must_preserve=True,
    expect="With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 set, a transfer decode aborted on a backend without the drain-ACK capability either keeps its pages held (the deferral asked for) or releases them exactly once; whether a warning named the variable is reported.",
)
def explicit_deferral_on_incapable_backend_is_reported(ctx) -> Outcome:
    """#37454/#41023 must-preserve: before the capability gate, setting the
    variable made every ``CommonKVManager`` backend (Mori too) hold a
    decode-aborted transfer's pages; after it, such a backend releases them at
    once. An operator who set the variable is then told so by a warning."""
    envs = sg_attr("environ", "envs")
    if envs is None or not hasattr(envs, DEFERRED_ENV):
        raise NotApplicable(f"no {DEFERRED_ENV} in this release (no #35049): there is no deferral to ask for")
    rig = TransferRig(ctx, deferred_env="1")
    mgr = _no_capability_manager(rig.ledger)
    rcv = _drain_acking_receiver(rig.ledger, mgr, room=505, prefill_ranks=1)
    req = rig.enqueue(rcv, "incapable-aborted", 505)
    rcv.abort()  # decode aborts the request mid-transfer
    with _decode_log(_WarningRecorder()) as recorder:
        rig.queue.pop_transferred()
    after_pop = rig.snapshot(req)
    warnings = [m for m in recorder.messages if DEFERRED_ENV in m]
    details = {
        "backend_flag": bool(mgr.enable_deferred_decode_kv_release),
        "after_pop_transferred": after_pop,
        "warnings_naming_the_variable": warnings,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    held = after_pop["pages_held"] > 0 and after_pop["deferred_entries"] == 1
    released_once = after_pop["pages_held"] == 0 and after_pop["release_calls"] == 1
    # The verdict is the pages' fate (held, or released exactly once); whether the operator was
    # told is reported, not judged: upstream 0.5.21/0.5.22 release silently, the pack warns on
    # 0.5.19/0.5.20 (tests/test_matrix.py checks the warning there).
    if held:
        return Outcome(SAFE, "The pages were held, as the variable asks.", details)
    if released_once and not details["double_releases"]:
        told = "and a warning named the variable" if warnings else "silently (no warning named the variable)"
        return Outcome(SAFE, f"The pages were released at once, exactly once, {told}.", details)
    return Outcome(UNSAFE, "The pages were neither held nor released exactly once.", details)


@case(
    needs=("pr35049",),
    must_preserve=True,
    expect="With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 set, two aborted transfers on a backend without "
    "the drain-ACK capability, one on a backend with it, and one failed before any prefill rank learned its pages "
    "are each held or released exactly once; no warning names a backend that does defer, and no backend is "
    "warned about twice (one decode scheduler).",
)
def explicit_deferral_warnings_not_repeated(ctx) -> Outcome:
    """Must-preserve beside ``explicit_deferral_on_incapable_backend_is_reported``: the pack's warning (patched
    0.5.19/0.5.20) is said once per backend and never for a backend that holds the pages; upstream says
    nothing, which also keeps this."""
    envs = sg_attr("environ", "envs")
    if envs is None or not hasattr(envs, DEFERRED_ENV):
        raise NotApplicable(f"no {DEFERRED_ENV} in this release (no #35049): there is no deferral to ask for")
    rig = TransferRig(ctx, deferred_env="1")
    incapable = _no_capability_manager(rig.ledger)
    capable = _drain_acking_manager(rig.ledger)
    transfers = []
    for mgr, room in ((incapable, 508), (incapable, 509), (capable, 510), (capable, 511)):
        rcv = _drain_acking_receiver(rig.ledger, mgr, room=room, prefill_ranks=1)
        transfers.append((type(mgr).__name__, rig.enqueue(rcv, f"explicit-{room}", room)))
        if room == 511:
            # Bootstrap never completed: no prefill rank learned these pages, so there is nobody to
            # wait for and the capable backend releases at once, which is not the backend's fault.
            rcv.bootstrap_infos = None
        else:
            rcv.abort()  # decode aborts the request mid-transfer
    fates = {}
    with _decode_log(_WarningRecorder()) as recorder:
        for _backend, req in transfers:  # one failed transfer per scheduler step
            rig.queue.pop_transferred()
            snap = rig.snapshot(req)
            held = snap["pages_held"] > 0
            fates[req.rid] = "held" if held else ("released once" if snap["release_calls"] == 1 else "neither")
    warnings = [m for m in recorder.messages if DEFERRED_ENV in m]
    per_backend = {name: sum(1 for m in warnings if name in m) for name in {b for b, _ in transfers}}
    details = {
        "fates": fates,
        "warnings_per_backend": per_backend,
        "warnings_naming_the_variable": warnings,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    problems = [f"{rid}: pages neither held nor released exactly once" for rid, f in fates.items() if f == "neither"]
    if details["double_releases"]:
        problems.append("pages released twice")
    if per_backend.get(type(capable).__name__):
        problems.append("a warning named a backend that defers")
    if any(n > 1 for n in per_backend.values()):
        problems.append(f"a backend was warned about more than once: {per_backend}")
    return judged(problems, (
        f"Each transfer held or released once ({fates}); warnings per backend {per_backend}."), details)


@case(
    proves=("pr35049", "pr41404"), needs=(">=0.5.13",),
    must_preserve=False,
    expect="When decode's receiver times out waiting for a published room's KV, every prefill rank gets one ABORT at "
    "the timeout; the failed transfer then keeps its pages until every prefill rank ACKed the drain and releases "
    "them exactly once.",
)
def waiting_timeout_holds_pages_until_drain(ctx) -> Outcome:
    """#41404 on the waiting-timeout path (``CommonKVReceiver._check_waiting_timeout``): prefill may still be
    writing the room when decode gives up waiting, so the timeout notifies every prefill rank (through
    ``ensure_abort_notified`` in the backports) and the failure is held like any other."""
    from sglang.srt.disaggregation.base import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    if not callable(getattr(CommonKVReceiver, "_check_waiting_timeout", None)):
        raise NotApplicable("decode's receiver has no waiting timeout of its own in this release")
    rig = TransferRig(ctx)
    mgr = _drain_acking_manager(rig.ledger)
    mgr.__dict__.update(waiting_timeout=0, connection_lock=threading.Lock(), connection_pool={})
    rcv = _drain_acking_receiver(rig.ledger, mgr, room=506, prefill_ranks=2)
    rcv._connection_pool_entries = {}
    mgr.request_status[506] = KVPoll.WaitingForInput
    req = rig.enqueue(rcv, "waiting-timeout", 506)
    polled = CommonKVReceiver._check_waiting_timeout(rcv)  # init_time is long past the timeout
    aborts_at_timeout = sorted(e["prefill_rank"] for e in rig.ledger.of("abort_sent"))
    rig.queue.pop_transferred()
    held_after_pop = rig.snapshot(req)
    generation = getattr(rcv, "_abort_generation", None)
    if hasattr(mgr, "note_abort_ack"):
        note_ack(mgr, 506, 0, generation)
        note_ack(mgr, 506, 1, generation)
    rig.resolve()
    final = rig.snapshot(req)
    details = {
        "timeout_poll": getattr(polled, "name", str(polled)),
        "aborts_at_timeout": aborts_at_timeout,
        "aborts_in_all": sorted(e["prefill_rank"] for e in rig.ledger.of("abort_sent")),
        "after_pop_transferred": held_after_pop,
        "after_both_acks": final,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    problems = []
    if polled != KVPoll.Failed or aborts_at_timeout != [0, 1]:
        problems.append(f"the timeout did not send one ABORT to each prefill rank (sent to {aborts_at_timeout})")
    if details["aborts_in_all"] != [0, 1]:
        problems.append(f"ABORTs sent in all: {details['aborts_in_all']}")
    if held_after_pop["pages_held"] == 0:
        problems.append("pages released before any drain ACK")
    if final["pages_held"] or final["release_calls"] != 1 or final["metadata_frees"] != 1 or details["double_releases"]:
        problems.append("pages not released exactly once after both drain ACKs")
    return judged(problems, (
        "One ABORT per prefill rank at the timeout; pages held until both ACKs, released once."), details)


class _QuiescentPrefillSocket(_PrefillPeerSocket):
    """Stands for the socket to a prefill rank whose writes for the room already drained: it answers the
    ABORT with its drain ACK at once (the ACK races back before the sender returns)."""

    def __init__(self, ledger: Ledger, rank: int, receiver) -> None:
        super().__init__(ledger, rank)
        self.receiver = receiver

    def send_multipart(self, frames, *args, **kwargs):
        super().send_multipart(frames)
        rcv = self.receiver
        note_ack(rcv.kv_mgr, rcv.bootstrap_room, self.rank, getattr(rcv, "_abort_generation", None))
        self.ledger.record("ack_raced_back", prefill_rank=self.rank)


@case(
    proves=("pr40645",), needs=("pr35049", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="When the decode scheduler aborts a request in its transfer queue (AbortReq) and a prefill rank's drain "
    "ACK races back before the abort handling returns, that ACK is counted: the pages are held until every prefill "
    "rank ACKed, then released exactly once.",
)
def scheduler_abort_keeps_raced_ack(ctx) -> Outcome:
    """#41404: the receiver arms drain-ACK accounting before its ABORT leaves; the scheduler's re-arm after
    ``abort()`` (which wiped an ACK that had already raced back) is gone. Drives the real
    ``Scheduler.abort_request`` on a decode scheduler shell over the real transfer queue."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import AbortReq

    if not hasattr(sg("disaggregation.common.conn").CommonKVManager, "register_deferred_abort_room"):
        raise NotApplicable("decode has no drain-ACK accounting in this release (no #35049)")
    rig = TransferRig(ctx)
    mgr = _drain_acking_manager(rig.ledger)
    rcv = _drain_acking_receiver(rig.ledger, mgr, room=507, prefill_ranks=2)
    rank0 = _QuiescentPrefillSocket(rig.ledger, 0, rcv)
    rcv._connect_to_bootstrap_server = lambda info: (
        (rank0 if info["rank"] == 0 else _PrefillPeerSocket(rig.ledger, info["rank"])), threading.Lock()
    )
    req = rig.enqueue(rcv, "user-aborted", 507)
    shell = rig.shell
    shell.__dict__.update(
        disaggregation_mode=DisaggregationMode.DECODE,
        disagg_decode_transfer_queue=rig.queue,
        disagg_decode_prealloc_queue=SimpleNamespace(queue=[], retracted_queue=[]),
        mm_receiver=None,
        dllm_config=None,
        grammar_manager=InertCollaborator("grammar_manager"),
        # nothing running (up to 0.5.15.post1 abort_request reads its reqs unguarded)
        running_batch=SimpleNamespace(reqs=[], is_empty=lambda: True),
        last_batch=None,
        cur_batch=None,  # abort_request reads it up to 0.5.15.post1
        enable_continuous_input_polling=False,  # 0.5.22: no batch waits in a result queue
        result_queue=[],
    )
    type(shell).abort_request(shell, construct_with(AbortReq, rid="user-aborted", abort_all=False))
    rig.queue.pop_transferred()
    after_pop = rig.snapshot(req)
    note_ack(mgr, 507, 1, getattr(rcv, "_abort_generation", None))
    rig.resolve()
    final = rig.snapshot(req)
    details = {
        "aborts_sent": sorted(e["prefill_rank"] for e in rig.ledger.of("abort_sent")),
        "acks_raced_back": [e["prefill_rank"] for e in rig.ledger.of("ack_raced_back")],
        "after_pop_transferred": after_pop,
        "after_rank1_ack": final,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    problems = []
    if details["aborts_sent"] != [0, 1]:
        problems.append(f"ABORTs sent to prefill ranks {details['aborts_sent']}, not one to each")
    if after_pop["pages_held"] == 0:
        problems.append("pages released before rank 1 ACKed")
    elif final["pages_held"]:
        problems.append("rank 0's raced ACK was lost: pages still held after every rank ACKed (until the timeout)")
    elif final["release_calls"] != 1 or final["metadata_frees"] != 1 or details["double_releases"]:
        problems.append("pages not released exactly once")
    return judged(problems, "The raced ACK counted: pages held until both ranks ACKed, then released once.",
                  details)
