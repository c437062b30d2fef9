"""The aborts decode starts itself (#41404): its receiver's waiting timeout, and the scheduler's
AbortReq with a drain ACK that races back. The probe: probes/cases/page_lifetime/.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from ... import NotApplicable, Outcome, case, judged
from ...rigs.failed_transfer import (
    PrefillPeerSocket,
    TransferRig,
    drain_acking_manager,
    drain_acking_receiver,
    note_ack,
)
from ...standins import Ledger, construct_with, sg
from ...standins.scheduler import InertCollaborator


@case(
    proves=("pr35049", "pr41404"),
    needs=(">=0.5.13",),
    must_preserve=False,
    expect="When decode's receiver times out waiting for a published room's KV, every prefill rank gets one "
           "ABORT at "
    "the timeout; the failed transfer then keeps its pages until every prefill rank ACKed the drain and "
    "releases "
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
    mgr = drain_acking_manager(rig.ledger)
    mgr.__dict__.update(waiting_timeout=0, connection_lock=threading.Lock(), connection_pool={})
    rcv = drain_acking_receiver(rig.ledger, mgr, room=506, prefill_ranks=2)
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
        problems.append(
            f"the timeout did not send one ABORT to each prefill rank (sent to {aborts_at_timeout})"
        )
    if details["aborts_in_all"] != [0, 1]:
        problems.append(f"ABORTs sent in all: {details['aborts_in_all']}")
    if held_after_pop["pages_held"] == 0:
        problems.append("pages released before any drain ACK")
    if (
        final["pages_held"]
        or final["release_calls"] != 1
        or final["metadata_frees"] != 1
        or details["double_releases"]
    ):
        problems.append("pages not released exactly once after both drain ACKs")
    return judged(problems, (
        "One ABORT per prefill rank at the timeout; pages held until both ACKs, released once."), details)


class _QuiescentPrefillSocket(PrefillPeerSocket):
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
    proves=("pr40645",),
    needs=("pr35049", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="When the decode scheduler aborts a request in its transfer queue (AbortReq) and a prefill rank's "
           "drain "
    "ACK races back before the abort handling returns, that ACK is counted: the pages are held until every "
    "prefill "
    "rank ACKed, then released exactly once.",
)
def scheduler_abort_keeps_raced_ack(ctx) -> Outcome:
    """#41404: the receiver arms drain-ACK accounting before its ABORT leaves; the scheduler's re-arm after
    ``abort()`` (which wiped an ACK that had already raced back) is gone. Drives the real
    ``Scheduler.abort_request`` on a decode scheduler shell over the real transfer queue."""

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import AbortReq

    if not hasattr(sg("disaggregation.common.conn").CommonKVManager, "register_deferred_abort_room"):
        raise NotApplicable("decode has no drain-ACK accounting in this release (no #35049)")
    rig = TransferRig(ctx)
    mgr = drain_acking_manager(rig.ledger)
    rcv = drain_acking_receiver(rig.ledger, mgr, room=507, prefill_ranks=2)
    rank0 = _QuiescentPrefillSocket(rig.ledger, 0, rcv)
    rcv._connect_to_bootstrap_server = lambda info: (
        (rank0 if info["rank"] == 0 else PrefillPeerSocket(rig.ledger, info["rank"])), threading.Lock()
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
        problems.append(
            "rank 0's raced ACK was lost: pages still held after every rank ACKed (until the timeout)"
        )
    elif final["release_calls"] != 1 or final["metadata_frees"] != 1 or details["double_releases"]:
        problems.append("pages not released exactly once")
    return judged(problems, "The raced ACK counted: pages held until both ranks ACKed, then released once.",
                  details)
