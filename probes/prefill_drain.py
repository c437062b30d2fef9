"""Prefill-side drain ACKs (#35049, #40645, #41402 and 0.5.22's failed-send
rule; issue 13).

Decode holds a failed request's pages until every prefill rank ACKs that its
writes into them drained. The ACK comes from the prefill: the Mooncake
transfer worker counts a room's chunks in flight (``_staging_outstanding``)
and ``CommonKVManager._maybe_ack_drained_abort`` sends the ACK once the count
is zero to every decode endpoint that sent an ABORT. A send that fails on the
transfer engine's wall-clock timeout leaves the batch still writing while the
worker decrements the count, so an ACK sent then lets decode free pages a
write can still land on. 0.5.22 withholds the ACK for such a room for good
(``poison_deferred_ack_room``, ``_poison_unsettled_send``); decode falls back
to its release timeout.

How it is driven: the tree's real ``MooncakeKVManager.transfer_worker`` (its
failure branches, the outstanding count, the drain ACK), the real ABORT
handler (the bootstrap thread's loop body, run in the probe's thread; the
``_handle_abort_notification`` method from 0.5.22), the real
``CommonKVManager`` ACK registry and the real ``CommonKVSender.clear``, on a
manager built without its network constructor. Stand-ins: the transfer
engine under ``send_kvcache``/``send_aux`` (``TransferEngineStandIn``: writes
complete, time out while still running, are held in flight, or crash the
worker), the ZMQ pushes to decode (``DecodePeerWire``), the server socket the
ABORTs arrive on, the DSA/CP layout decision (no skipping). Two decode
ranks share the room (decode TP 2 against prefill TP 1), each with its own
endpoint, as in #41402.

These cases run with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``
on (the default from 0.5.21 and in the patched trees; an opt-in on 0.5.19 and
0.5.20) except ``without_capability_keeps_immediate_ack``, which turns it off
as a backend without the capability has it. On 0.5.17/0.5.18 the prefill has
no drain-ACK accounting (no #35049): those cases are ``not-applicable``.

NIXL (``nixl_failed_handle_withholds_ack``): the tree's real
``NixlKVManager.transfer_worker`` and ABORT handler on a manager built without
its constructor (probes/nixl_rig.py; the ``nixl`` package is never imported),
with a NIXL agent stand-in whose handles are DONE, ERR or still running.
``failed_aux_or_state_send_withholds_ack`` fails the last chunk's aux or state
write instead of the KV write. Not driven here: Ascend's own
``send_kvcache``; it reaches the drain ACK through this very worker.

Terminal Failed (0.5.20's ``update_status``): ``aborted_room_stays_failed_on_late_bootstrap``
delivers a late decode rank's transfer info through the real bootstrap thread
after another rank's ABORT, then offers the room's chunk through the real
``add_transfer_request``; ``nixl_aborted_room_stays_failed_after_inflight_chunk``
lets a non-last NIXL chunk land after the ABORT. The per-layer wait
(``per_layer_send_reports_failure_after_every_write``) runs the real
``send_kvcache`` on a real thread pool over ``PerLayerEngineStandIn``; it needs
no drain accounting, so it also runs on 0.5.16-0.5.18.

The registry as the constructor sets it up (issue 14): the ``constructed_*`` cases and
``cleared_sender_drops_target_without_drain_accounting`` build the tree's ``CommonKVManager``
through its real ``__init__`` (probes/manager_rig.py: a real ZMQ socket on localhost; the
bootstrap-port sync, the bootstrap registration and the PP group stood in for).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case, judged
from probes.mooncake_rig import (
    DECODE_PEERS,
    DEFERRED_ENV,
    ROOM,
    PrefillRig,
    deferral_flag,
    deliver_to_bootstrap_thread,
    kv_indices,
)
from probes.standins import Ledger, pin_runtime, sg


def _verdict_no_ack_in_flight(rig: PrefillRig, safe_text: str, what: str) -> Outcome:
    details = rig.summary()
    early = details["acks_while_writes_in_flight"]
    # Duplicate ACKs are reported, not judged: decode counts ACKs per prefill
    # rank in a set, so a second one cannot release anything earlier.
    if early == 0:
        return Outcome(SAFE, safe_text, details)
    return Outcome(UNSAFE, f"{early} drain ACK(s) sent while a write {what} was still in flight.", details)


# ---------------------------------------------------------------------------


@case(
    proves=("pr41402",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="After a send that timed out with its write still running, no drain ACK leaves (during the transfer, "
    "after the failure, after clear(), or for a late ABORT) while the write is still running.",
)
def failed_send_withholds_ack_while_writes_in_flight(ctx) -> Outcome:
    rig = PrefillRig(ctx, plan=["timeout"])
    # Decode rank 0 aborts while the transfer is running (its own timeout).
    original_submit = rig.engine.submit

    def submit_with_abort(kind, room):
        ret = original_submit(kind, room)
        if kind == "kv" and not rig.ledger.count("abort_received"):
            rig.abort_from(0)
        return ret

    rig.engine.submit = submit_with_abort
    ended = rig.run_worker([rig.chunk()])
    # Decode saw Failed and (since #41404) sends ABORT on every failure.
    rig.abort_from(1)
    rig.clear_sender()
    rig.abort_from(0)  # a late duplicate after clear()
    rig.engine.settle()
    outcome = _verdict_no_ack_in_flight(
        rig,
        "No drain ACK left while the timed-out write was in flight (the room's ACK is withheld; decode "
        "releases on its timeout).",
        "of the failed send",
    )
    outcome.details["worker"] = ended
    return outcome


@case(
    proves=("pr40645",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="When ABORTs from both decode peers arrive while a write is in flight and the write then completes, "
    "each peer gets its drain ACK, after the write landed.",
)
def abort_during_transfer_acks_each_peer_once_after_drain(ctx) -> Outcome:
    rig = PrefillRig(ctx, plan=["hold"])
    rig.engine.during = lambda: (rig.abort_from(0), rig.abort_from(1))
    ended = rig.run_worker([rig.chunk()])
    rig.clear_sender()
    outcome = _verdict_no_ack_in_flight(rig, "", "")
    counts = outcome.details["acks_per_peer"]
    outcome.details["worker"] = ended
    if outcome.verdict == SAFE and all(n >= 1 for n in counts.values()):
        return Outcome(SAFE, f"Each decode peer got its drain ACK after the write landed ({counts}).", outcome.details)
    if outcome.verdict == SAFE:
        return Outcome(UNSAFE, f"A decode peer that asked got no drain ACK: {counts}.", outcome.details)
    return outcome


@case(
    proves=("pr35049-ack",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="ABORTs that arrive before the chunk is sent are ACKed to each decode peer and nothing is written "
    "after the ACK.",
)
def abort_before_transfer_acks_each_peer_once(ctx) -> Outcome:
    rig = PrefillRig(ctx)
    rig.abort_from(0)
    rig.abort_from(1)
    mark = rig.ledger.mark()
    ended = rig.run_worker([rig.chunk()])
    rig.clear_sender()
    details = rig.summary()
    details["worker"] = ended
    written_after = rig.ledger.since(mark).count("write_posted")
    counts = details["acks_per_peer"]
    details["writes_after_abort"] = written_after
    if written_after == 0 and all(n >= 1 for n in counts.values()):
        return Outcome(SAFE, f"The chunk was skipped and each decode peer got its ACK ({counts}).", details)
    return Outcome(UNSAFE, f"Writes after the ABORT: {written_after}; ACKs per peer: {counts}.", details)


@case(
    proves=("pr35049-ack",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="ABORTs for a room whose transfer already succeeded are ACKed to each decode peer, with nothing in flight.",
)
def abort_after_transfer_acks_each_peer_once(ctx) -> Outcome:
    rig = PrefillRig(ctx)
    ended = rig.run_worker([rig.chunk()])
    status = rig.mgr.request_status.get(ROOM)
    rig.abort_from(0)
    rig.abort_from(1)
    outcome = _verdict_no_ack_in_flight(rig, "", "")
    counts = outcome.details["acks_per_peer"]
    outcome.details.update(worker=ended, status_after_transfer=getattr(status, "name", str(status)))
    if outcome.verdict == SAFE and all(n >= 1 for n in counts.values()):
        return Outcome(SAFE, f"Each decode peer got its ACK for the concluded room ({counts}).", outcome.details)
    if outcome.verdict == SAFE:
        return Outcome(UNSAFE, f"A decode peer that asked got no ACK for the concluded room: {counts}.", outcome.details)
    return outcome


@case(
    proves=("pr35049-ack",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="When the transfer worker dies with a write posted, no drain ACK leaves for the room while it runs "
    "(ABORTs, clear()).",
)
def worker_crash_withholds_ack(ctx) -> Outcome:
    rig = PrefillRig(ctx, plan=["crash"])
    ended = rig.run_worker([rig.chunk()])
    if ended != "died" or "crash" not in rig.summary()["writes_posted"]:
        raise RuntimeError(f"the worker did not die on the planned crash (it {ended})")
    rig.abort_from(0)
    rig.clear_sender()
    rig.abort_from(1)
    rig.engine.settle()
    outcome = _verdict_no_ack_in_flight(
        rig, "No drain ACK left for the dead worker's room while its write was in flight.", "of the dead worker"
    )
    outcome.details["worker"] = ended
    return outcome


@case(
    needs=("pr35049-ack",),
    must_preserve=True,
    expect="A transfer whose writes all complete reaches Success, tells each decode peer once, and sends no ACK.",
)
def successful_transfer_untouched(ctx) -> Outcome:
    rig = PrefillRig(ctx)
    ended = rig.run_worker([rig.chunk()])
    status = rig.mgr.request_status.get(ROOM)
    details = rig.summary()
    poisoned = ROOM in getattr(rig.mgr, "_deferred_ack_poisoned_rooms", ())
    details.update(
        worker=ended,
        status=getattr(status, "name", str(status)),
        status_messages=rig.ledger.count("status_to_decode"),
        room_poisoned=poisoned,
    )
    ok = (
        status == rig.KVPoll.Success
        and details["status_messages"] == len(DECODE_PEERS)
        and not rig.acks()
        and not poisoned
    )
    if ok:
        return Outcome(SAFE, "Success, one status message per decode peer, no ACK, room not poisoned.", details)
    return Outcome(UNSAFE, "The successful transfer did not conclude as before.", details)


@case(
    needs=("pr35049-ack",),
    must_preserve=True,
    expect="Without the drain-ACK capability (deferred release off) an ABORT after a failed send is answered at "
    "once, as before: decode releases immediately and waits for nothing.",
)
def without_capability_keeps_immediate_ack(ctx) -> Outcome:
    rig = PrefillRig(ctx, deferred=False, plan=["timeout"])
    ended = rig.run_worker([rig.chunk()])
    rig.abort_from(0)
    details = rig.summary()
    details.update(worker=ended, deferred_release=bool(rig.mgr.enable_deferred_decode_kv_release))
    acks = details["acks_per_peer"]
    first = f"{DECODE_PEERS[0][0]}:{DECODE_PEERS[0][1]}"
    if not details["deferred_release"] and acks.get(first) == 1:
        return Outcome(SAFE, "The ABORT was answered at once with one legacy ABORT_ACK.", details)
    return Outcome(UNSAFE, f"The legacy ABORT answer changed: ACKs per peer {acks}.", details)


@case(
    proves=("pr41402",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="After a Mooncake aux (metadata slot) or state write fails with the write still running, no drain ACK "
    "leaves for the room while it runs (ABORTs from both decode peers, clear(), a late ABORT).",
)
def failed_aux_or_state_send_withholds_ack(ctx) -> Outcome:
    """0.5.22's failed-send rule (#41402 backport) on the last chunk's other writes: the aux write targets
    decode's metadata slot and the state write its Mamba/SWA state pages, both freed with the held release,
    so a failed one withholds the ACK like a failed KV write."""
    runs: dict[str, Any] = {}
    early = 0
    for what, plan in (("aux", ["complete", "timeout"]), ("state", ["complete", "timeout"])):
        rig = PrefillRig(ctx, plan=plan)
        chunk = rig.chunk()
        if what == "state":
            chunk.state_indices = [[3]]  # a hybrid model's state slot, sent with the last chunk
        ended = rig.run_worker([chunk])
        rig.abort_from(0)
        rig.abort_from(1)
        rig.clear_sender()
        rig.abort_from(0)  # a late duplicate after clear()
        rig.engine.settle()
        details = rig.summary()
        details["worker"] = ended
        posted = [e["what"] for e in rig.ledger.of("write_posted", mode="timeout")]
        if posted != [what]:
            raise RuntimeError(f"the planned {what} write did not time out (timed out: {posted})")
        runs[what] = details
        early += details["acks_while_writes_in_flight"]
    if early == 0:
        return Outcome(SAFE, "No drain ACK left while a timed-out aux or state write was in flight.", runs)
    failed = [w for w, d in runs.items() if d["acks_while_writes_in_flight"]]
    return Outcome(UNSAFE, f"Drain ACK(s) sent while the failed {' and '.join(failed)} write was in flight.", runs)


@case(
    proves=("pr41402",), needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, a chunk whose transfer handle fails (ERR) while a sibling handle still writes holds decode's "
    "pages (the backend defers release) and no drain ACK leaves while the sibling runs: not for a later chunk of "
    "the failed room, not after clear(), not for a late ABORT.",
)
def nixl_failed_handle_withholds_ack(ctx) -> Outcome:
    """#41023 (NIXL's capability) and #41402 (the failed-send rule, NIXL's worker and ABORT handler): an ERR
    handle aborts the batch while its sibling may still be writing, so the room's drain ACK is withheld for
    good and decode releases on its timeout."""
    from probes.nixl_rig import NixlPrefillRig

    rig = NixlPrefillRig(ctx, plan=["err", "running"])
    rig.run_worker([rig.chunk(0, last=False)])
    rig.abort_from(0)  # decode saw the failure and aborts the room
    rig.run_worker([rig.chunk(1, last=True)])  # the room's next chunk was already queued
    rig.clear_sender()
    rig.abort_from(1)  # the other decode rank's ABORT, after the room was cleared
    in_flight_before_settle = rig.agent.in_flight
    rig.agent.settle()
    details = rig.summary()
    details["sibling_writes_running_at_end"] = in_flight_before_settle
    if in_flight_before_settle != 1 or not rig.ledger.count("worker_failure"):
        raise RuntimeError("the planned ERR/running batch did not happen as planned")
    problems = []
    if not details["deferred_release"]:
        problems.append("NIXL has no drain-ACK capability here, so decode releases the failed transfer's pages at once")
    if details["acks_while_writes_in_flight"]:
        problems.append(f"{details['acks_while_writes_in_flight']} drain ACK(s) sent while the sibling write ran")
    return judged(problems, (
        "NIXL defers, and no drain ACK left while the sibling of the failed handle was writing "
        "(decode releases on its timeout)."), details)


def _status_name(KVPoll, value) -> str:
    """A room's KVPoll status by name (``KVPoll`` is a class of ints); ``None``: the room is cleared."""
    names = {getattr(KVPoll, n): n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")}
    return names.get(value, str(value))


def _writes_after_first_ack(ledger) -> int:
    """Writes posted after the first drain ACK left: decode may free (and reuse) the pages on it."""
    seen_ack, count = False, 0
    for event in ledger.events:
        seen_ack = seen_ack or event["kind"] == "drain_ack"
        count += seen_ack and event["kind"] == "write_posted"
    return count


@case(
    proves=("pr35049-nixl",), needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, when the decode peers ABORT a room while its non-last chunk is in flight, the room stays Failed "
    "after that chunk lands: no write of the room's next chunk reaches decode after the drain ACK went out.",
)
def nixl_aborted_room_stays_failed_after_inflight_chunk(ctx) -> Outcome:
    """Terminal Failed on NIXL: the worker's Transferring update for a finished non-last chunk must not lift an
    ABORTed room back (Failed sorts lowest), or the next chunk writes into pages decode freed (and may have given
    to another request) on the ACK. 0.5.17-0.5.19 keep Failed sticky in ``NixlKVManager.update_status`` (0.5.20
    moved the rule into ``CommonKVManager``), so this holds wherever NIXL has a drain ACK; with the common rule
    of 0.5.19 alone the same run posts the next chunk's writes after the ACK."""
    from probes.nixl_rig import ROOM as NIXL_ROOM
    from probes.nixl_rig import NixlPrefillRig

    rig = NixlPrefillRig(ctx, plan=["hold"])
    rig.agent.during = lambda: (rig.abort_from(0), rig.abort_from(1))
    rig.run_worker([rig.chunk(0, last=False)])
    aborts = rig.ledger.of("abort_received")
    if len(aborts) != 2 or any(a["writes_in_flight"] != 1 for a in aborts):
        raise RuntimeError("the ABORTs did not arrive while the first chunk was in flight as planned")
    status_after_first = rig.mgr.request_status.get(NIXL_ROOM)
    rig.run_worker([rig.chunk(1, last=True)])  # the room's next chunk, queued before the ABORT
    status = rig.mgr.request_status.get(NIXL_ROOM)
    details = rig.summary()
    written_after = _writes_after_first_ack(rig.ledger)
    details.update(
        status_after_inflight_chunk=_status_name(rig.KVPoll, status_after_first),
        status_at_end=_status_name(rig.KVPoll, status),
        writes_after_drain_ack=written_after,
    )
    still_failed = status_after_first == rig.KVPoll.Failed and status in (rig.KVPoll.Failed, None)
    if written_after == 0 and still_failed:
        return Outcome(SAFE, "The aborted room stayed Failed after its in-flight chunk landed; its next chunk "
                       "wrote nothing after the drain ACK.", details)
    return Outcome(UNSAFE, f"The aborted room went {details['status_after_inflight_chunk']} after its in-flight "
                   f"chunk landed, and {written_after} write(s) of its next chunk were posted after the drain ACK "
                   "(into pages decode may have freed).", details)


# 0.5.20 shipped the sticky-Failed rule without a fix record; the pack carries it in #41402's
# variants for 0.5.17 - 0.5.19, so that is what the case proves (0.5.20/0.5.21: exceptions).
@case(
    proves=("pr41402",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="When one decode rank ABORTs a room before the other rank's transfer info arrived, the room stays Failed "
    "when that info arrives: the scheduler's next chunk is refused and nothing is written after the drain ACK.",
)
def aborted_room_stays_failed_on_late_bootstrap(ctx) -> Outcome:
    """0.5.20's terminal Failed (update_status): the bootstrap thread's WaitingForInput for a room whose last
    decode rank registered late must not lift an ABORTed room back (Failed sorts lowest), or its chunks are sent
    into pages the ABORTing rank freed (and may have reused) on its drain ACK."""
    rig = PrefillRig(ctx)
    mgr, KVPoll = rig.mgr, rig.KVPoll
    # The room as it stands before decode rank 1 registered: rank 0's info only, still Bootstrapping.
    late_session, late = list(mgr.transfer_infos[ROOM].items())[1]
    del mgr.transfer_infos[ROOM][late_session]
    mgr.request_status[ROOM] = KVPoll.Bootstrapping
    rig.abort_from(0)  # decode rank 0 gives up on the room (its own timeout, a client abort)
    frames = [
        str(ROOM).encode(), late.endpoint.encode(), str(late.dst_port).encode(), late_session.encode(),
        late.dst_kv_indices.tobytes(), str(late.dst_aux_index).encode(), b"",
        str(late.required_dst_info_num).encode(), b"", b"",
    ]
    deliver_to_bootstrap_thread(rig, frames)  # decode rank 1's transfer info arrives late
    if late_session not in mgr.transfer_infos.get(ROOM, {}):
        raise RuntimeError("the bootstrap thread did not take decode rank 1's transfer info")
    status_after_info = mgr.request_status.get(ROOM)
    # The scheduler's next chunk of the room, offered through the real door (refused for a Failed room).
    queued: list = []
    mgr.disaggregation_mode = sg("disaggregation.utils").DisaggregationMode.PREFILL
    mgr.transfer_queues = [SimpleNamespace(put=queued.append)]
    mgr.add_transfer_request(ROOM, kv_indices(4), slice(0, 4), True, aux_index=0)
    ended = rig.run_worker(queued) if queued else "nothing queued"
    details = rig.summary()
    written_after = _writes_after_first_ack(rig.ledger)
    status = mgr.request_status.get(ROOM)
    details.update(
        worker=ended,
        chunks_queued=len(queued),
        status_after_late_info=_status_name(rig.KVPoll, status_after_info),
        status_at_end=_status_name(rig.KVPoll, status),
        writes_after_drain_ack=written_after,
    )
    if written_after == 0 and status_after_info == KVPoll.Failed:
        return Outcome(SAFE, "The aborted room stayed Failed when the late transfer info arrived; its chunk was "
                       "refused and nothing was written after the drain ACK.", details)
    return Outcome(UNSAFE, f"The late transfer info lifted the aborted room to {details['status_after_late_info']}; "
                   f"{len(queued)} chunk(s) queued, {written_after} write(s) posted after the drain ACK (into pages "
                   "decode may have freed).", details)


LAYER_PTRS = (1 << 20, 2 << 20)  # two layers of prefill KV (source pointers)
DECODE_LAYER_PTRS = [3 << 20, 4 << 20]  # the same two layers on decode


@case(
    # send_kvcache takes the thread pool as an argument from 0.4.7 (before: self.executor, not driven here)
    proves=("pr35049-inflight",), needs=(">=0.4.7",),
    must_preserve=False,
    expect="When one per-layer write of a Mooncake chunk (custom memory pool) fails while another layer's write is "
    "still landing in decode's pages, send_kvcache reports the failure only after every per-layer write finished.",
)
def per_layer_send_reports_failure_after_every_write(ctx) -> Outcome:
    """#35049's groundwork (``_await_transfer_futures``): the transfer worker's failure branch decrements the
    room's in-flight count and may send the drain ACK as soon as ``send_kvcache`` returns, so returning at the
    first failed per-layer future lets decode free pages a sibling layer's write still lands on. Drives the
    tree's real ``send_kvcache`` (its per-layer futures on a real thread pool) over a stand-in engine."""
    import concurrent.futures

    from probes.standins_transfer_engine import PerLayerEngineStandIn

    pin_runtime(ctx)
    ctx.setenv(DEFERRED_ENV, "true")
    module = sg("disaggregation.mooncake.conn")
    cls = module.MooncakeKVManager
    # 0.5.19+ check the unified-memory layout first; this rank does not use unified memory.
    ctx.patch_if_present(module, "get_memory", lambda: SimpleNamespace(enable_unified_memory=False))
    ledger = Ledger()
    engine = PerLayerEngineStandIn(ledger, list(LAYER_PTRS), 64, {0: "fail", 1: "writing"})
    mgr = object.__new__(cls)
    mgr.__dict__.update(
        kv_args=SimpleNamespace(
            kv_data_ptrs=list(LAYER_PTRS), kv_item_lens=[64, 64], kv_layer_ids=None, mla_compression_ratios=None,
            prefill_start_layer=0, prefill_end_layer=len(LAYER_PTRS), num_draft_entries=0, page_size=1,
        ),
        is_mla_backend=True,
        is_hybrid_mla_backend=False,
        attn_tp_size=1,
        pp_rank=0,
        pp_size=1,
        enable_custom_mem_pool=True,  # the per-layer futures path
        custom_mem_pool_type=None,
        engine=engine,
    )
    mgr.enable_deferred_decode_kv_release = deferral_flag(cls)
    outcome: dict[str, Any] = {}

    def send() -> None:
        try:
            outcome["ret"] = mgr.send_kvcache(
                "10.0.1.1:19000", kv_indices(4), list(DECODE_LAYER_PTRS), kv_indices(4), pool
            )
        except Exception as exc:  # noqa: BLE001 - reported, and judged a rig error below
            outcome["raised"] = f"{type(exc).__name__}: {exc}"[:200]
        ledger.record("send_returned", writes_running=engine.writes_running)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(LAYER_PTRS)) as pool:
        caller = threading.Thread(target=send, daemon=True)
        caller.start()
        started = engine.sibling_writing.wait(10)
        caller.join(2.0)  # an early return happens within milliseconds of the failure
        returned_while_writing = not caller.is_alive()
        engine.land()
        caller.join(10)
    if "raised" in outcome or not started or caller.is_alive():
        raise RuntimeError(f"the per-layer send did not run as planned: {outcome or 'no return'}")
    details = {
        "deferred_release": bool(mgr.enable_deferred_decode_kv_release),
        "returned": outcome.get("ret"),
        "returned_while_a_write_ran": returned_while_writing,
        "events": [{k: v for k, v in e.items() if k != "session"} for e in ledger.events],
    }
    if returned_while_writing:
        return Outcome(UNSAFE, "send_kvcache reported the failed layer while another layer's write was still "
                       "landing in decode's pages.", details)
    if not outcome.get("ret"):
        return Outcome(UNSAFE, "send_kvcache lost the failed layer's status (returned 0).", details)
    return Outcome(SAFE, f"send_kvcache reported the failure ({outcome['ret']}) only after every per-layer write "
                   "finished.", details)


# ---------------------------------------------------------------------------
# The drain-ACK registry as the manager's constructor sets it up (issue 14):
# probes/manager_rig.py builds the tree's CommonKVManager through __init__.

CONSTRUCTED_ROOM = 711


def _constructed(ctx, *, counts_outstanding: bool):
    from probes.manager_rig import ConstructedPrefillManager

    return ConstructedPrefillManager(ctx, counts_outstanding=counts_outstanding)


def _constructed_details(rig) -> dict[str, Any]:
    return {
        "constructor_started_threads": rig.threads_started,
        "registered_to_bootstrap": rig.ledger.count("registered_to_bootstrap"),
        "acks_to": rig.acks_to(),
        "events": [{k: v for k, v in e.items() if k in ("kind", "endpoint", "writes_in_flight", "room")}
                   for e in rig.ledger.events],
    }


@case(
    proves=("pr40645",), needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor, ABORTs from both decode ranks for a room with a chunk "
    "outstanding are each held per endpoint, nothing is ACKed before the chunk drains, and each rank gets its ACK "
    "when it does (also when one rank's transfer info had not reached this prefill rank yet).",
)
def constructed_manager_holds_an_ack_per_aborting_peer(ctx) -> Outcome:
    """#41402's fan-out on the registry ``CommonKVManager.__init__`` creates (the per-endpoint target dict): the
    other cases fill that registry in by hand. The outstanding count stands for one queued chunk, as the transfer
    worker counts it; its drain is the worker's decrement and ``_maybe_ack_drained_abort``. 0.5.21 also fans the
    ACK out to the room's registered decode ranks, so the second run lets rank 1 ABORT before its transfer info
    arrived (it is known to this rank only by its ABORT)."""
    runs: dict[str, Any] = {}
    for label, known in (("both_ranks_registered", DECODE_PEERS), ("rank_1_not_yet_registered", DECODE_PEERS[:1])):
        rig = _constructed(ctx, counts_outstanding=True)
        try:
            mgr = rig.mgr
            rig.open_room(CONSTRUCTED_ROOM, known)
            mgr._staging_outstanding[CONSTRUCTED_ROOM] += 1  # one chunk queued for the room
            for ip, port in DECODE_PEERS:
                rig.abort_from(CONSTRUCTED_ROOM, ip, port)
            held = rig.targets_of(CONSTRUCTED_ROOM)
            early = list(rig.acks_to())
            mgr._staging_outstanding[CONSTRUCTED_ROOM] -= 1  # the chunk drained
            mgr._maybe_ack_drained_abort(CONSTRUCTED_ROOM)
            details = _constructed_details(rig)
            details.update(targets_held_while_outstanding=held, acks_before_drain=early)
            runs[label] = details
        finally:
            rig.close()
    peers = [f"{ip}:{port}" for ip, port in DECODE_PEERS]
    problems = []
    for label, details in runs.items():
        missing = [p for p in peers if p not in details["acks_to"]]
        if details["acks_before_drain"] or missing:
            problems.append(f"{label}: held {details['targets_held_while_outstanding']}, ACKed before the drain "
                            f"{details['acks_before_drain']}, never ACKed {missing}")
    return judged(problems, (
        "No ACK left before the chunk drained and each rank got its ACK when it did, with and without"
        " rank 1's transfer info."), runs)


@case(
    proves=("pr41402",), needs=("pr41402", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor, poisoning a room (a failed send) drops its held ACK "
    "targets, a later ABORT for it is neither held nor ACKed, and the room's next request clears the poison "
    "(its ABORT is ACKed).",
)
def constructed_manager_poisoned_room_withholds_ack_until_reopened(ctx) -> Outcome:
    """0.5.22's failed-send rule (#41402 backport) on the poisoned-room set ``CommonKVManager.__init__`` creates:
    ``poison_deferred_ack_room`` is what the transfer worker calls after a send that may still be writing."""
    from probes.manager_rig import registry_class

    if not hasattr(registry_class(), "poison_deferred_ack_room"):
        raise NotApplicable(
            "no failed-send rule in this release (no poisoned rooms): failed_send_withholds_ack_while_writes_in_flight "
            "judges what a failed send does to the drain ACK here"
        )
    rig = _constructed(ctx, counts_outstanding=True)
    try:
        mgr = rig.mgr
        first, second = (f"{ip}:{port}" for ip, port in DECODE_PEERS)
        rig.open_room(CONSTRUCTED_ROOM, DECODE_PEERS)
        mgr._staging_outstanding[CONSTRUCTED_ROOM] += 1  # one chunk queued for the room
        rig.abort_from(CONSTRUCTED_ROOM, *DECODE_PEERS[0])
        held_before = rig.targets_of(CONSTRUCTED_ROOM)
        mgr.poison_deferred_ack_room(CONSTRUCTED_ROOM)  # the chunk's send failed, its write may still run
        held_after_poison = rig.targets_of(CONSTRUCTED_ROOM)
        rig.abort_from(CONSTRUCTED_ROOM, *DECODE_PEERS[1])  # the other rank's ABORT, after the failure
        held_after_late = rig.targets_of(CONSTRUCTED_ROOM)
        mgr._staging_outstanding[CONSTRUCTED_ROOM] -= 1  # the worker gave up on the chunk
        mgr._maybe_ack_drained_abort(CONSTRUCTED_ROOM)
        rig.clear_sender(CONSTRUCTED_ROOM)
        acks_while_poisoned = list(rig.acks_to())
        # The room's next request (bootstrap rooms are reused) opens it again.
        rig.open_room(CONSTRUCTED_ROOM, DECODE_PEERS)
        rig.abort_from(CONSTRUCTED_ROOM, *DECODE_PEERS[0])
        acks_after_reopen = rig.acks_to()[len(acks_while_poisoned):]
        details = _constructed_details(rig)
        details.update(
            targets_before_poison=held_before, targets_after_poison=held_after_poison,
            targets_after_late_abort=held_after_late, acks_while_poisoned=acks_while_poisoned,
            acks_after_reopen=acks_after_reopen,
        )
    finally:
        rig.close()
    problems = []
    if held_before != [first]:
        problems.append(f"the first ABORT was not held ({held_before})")
    if held_after_poison or held_after_late:
        problems.append(f"the poisoned room still held targets ({held_after_poison or held_after_late})")
    if acks_while_poisoned:
        problems.append(f"ACKs sent for the poisoned room: {acks_while_poisoned}")
    if first not in acks_after_reopen:
        problems.append(f"the reopened room's ABORT was not ACKed to {first} (ACKs: {acks_after_reopen})")
    return judged(problems, (
        f"The poison dropped {first}'s target, {second}'s late ABORT was neither held nor ACKed, and "
        f"the room's next request was ACKed again."), details)


@case(
    proves=("pr35049-ack",), needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor (no transfer backend's write count added), clearing an "
    "aborted room's sender leaves none of its ACK targets behind (no leak on prefill), and ACKs only where the "
    "manager counts outstanding writes and the count shows the room drained.",
)
def cleared_sender_drops_target_without_drain_accounting(ctx) -> Outcome:
    """#40645's ``CommonKVSender.clear``: a manager without ``_staging_outstanding`` cannot tell when a room
    drained, so clear() drops the target rather than ACK (no shipped backend registers targets without the
    count, but the common API allows it). From 0.5.22 ``CommonKVManager.__init__`` sets the count up itself, so
    clear() ACKs the quiescent room instead; both leave nothing behind."""
    from sglang.srt.disaggregation.base import KVPoll

    rig = _constructed(ctx, counts_outstanding=False)
    try:
        counted = rig.constructor_counts_outstanding
        mgr = rig.mgr
        rig.open_room(CONSTRUCTED_ROOM, DECODE_PEERS)
        mgr.update_status(CONSTRUCTED_ROOM, KVPoll.Failed)
        # The ABORT handler holds the target; a manager without the count has nothing to ACK on.
        mgr.register_deferred_ack_target(CONSTRUCTED_ROOM, *rig.ack_target_args(*DECODE_PEERS[0]))
        held = rig.targets_of(CONSTRUCTED_ROOM)
        rig.clear_sender(CONSTRUCTED_ROOM)
        left = rig.targets_of(CONSTRUCTED_ROOM)
        details = _constructed_details(rig)
        details.update(manager_counts_outstanding=counted, targets_before_clear=held, targets_after_clear=left)
    finally:
        rig.close()
    if not held:
        raise RuntimeError("the ACK target was not registered as planned")
    unproven_acks = [] if counted else details["acks_to"]
    if not left and not unproven_acks:
        how = f"ACKed {details['acks_to']} on a drained count" if counted else "sent no ACK (no count to prove a drain)"
        return Outcome(SAFE, f"clear() dropped the held target ({held[0]}) and {how}.", details)
    return Outcome(UNSAFE, f"After clear() the room still holds {left}; ACKs without a drain count: {unproven_acks}.",
                   details)


# ---------------------------------------------------------------------------
# 0.5.22's standard where the pack differed (issue 26): a settled NIXL error
# drains, a skipped chunk answers the ABORTs it held, a reopened room starts
# clean, and an ABORT during the Mooncake state send stops the room's writes.


def _nixl_targets_left(rig, room: int) -> list[str]:
    held = rig.mgr._deferred_ack_targets.get(room)
    if not held:
        return []
    if isinstance(held, dict):
        return sorted(f"{t[0]}:{t[1]}" for t in held.values())
    return [f"{held[0]}:{held[1]}"]


@case(
    proves=("pr41402",), needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, when a chunk's handle fails (ERR) and every other handle of the batch has settled, the chunk "
    "is uncounted and the decode peers' ABORTs for the failed room are each ACKed, with no count or target left.",
)
def nixl_settled_error_uncounts_and_acks(ctx) -> Outcome:
    """Scenario: a NIXL prefill rank sends a room's last chunk to two decode ranks; the first KV handle fails
    (ERR), the other handles land (DONE). Decode sees the failure and, since #41404, both ranks send an ABORT
    and hold their pages for the drain ACK; then the scheduler clears the room.

    Upstream behaviour (0.5.21's and 0.5.22's ``NixlKVManager.transfer_worker`` except branch): once
    ``_await_handles(..., failure_seen=True)`` reports every handle settled, the worker concludes the failure,
    decrements the room's chunk count and tries the drain ACK, so the ABORTs are answered at once.

    Proves: the #41402 backport's NIXL error path (patches/pr41402, 0.5.17 - 0.5.20): without it the count
    stays at 1, the targets are held (clear() keeps them while counted) and decode waits its full release
    timeout while prefill keeps the count and target entries (0.5.20), or the room is poisoned on every error
    (0.5.17 - 0.5.19 before this change)."""
    from probes.nixl_rig import ROOM as NIXL_ROOM
    from probes.nixl_rig import NixlPrefillRig

    rig = NixlPrefillRig(ctx, plan=["err"])  # the first KV write fails; every other handle lands
    rig.run_worker([rig.chunk(0, last=True)])
    if not rig.ledger.count("worker_failure") or rig.agent.in_flight:
        raise RuntimeError("the planned ERR batch did not fail with every handle settled")
    count_after_failure = rig.mgr._staging_outstanding.get(NIXL_ROOM, 0)
    rig.abort_from(0)  # both decode ranks saw the failure and ABORT the room
    rig.abort_from(1)
    rig.clear_sender()
    details = rig.summary()
    left = _nixl_targets_left(rig, NIXL_ROOM)
    details.update(
        chunks_counted_after_failure=count_after_failure,
        chunks_counted_at_end=rig.mgr._staging_outstanding.get(NIXL_ROOM, 0),
        targets_left=left,
    )
    problems = []
    if count_after_failure:
        problems.append(f"the settled failed chunk stayed counted ({count_after_failure})")
    missing = [peer for peer, n in details["acks_per_peer"].items() if n < 1]
    if missing:
        problems.append(f"no drain ACK reached {missing} (decode holds its pages until the release timeout)")
    if left:
        problems.append(f"prefill still holds ACK targets {left} after clear()")
    if details["acks_while_writes_in_flight"]:
        problems.append("a drain ACK left while a write was in flight")
    return judged(problems, (
        f"The settled failed chunk was uncounted and each decode rank got its drain ACK "
        f"({details['acks_per_peer']}), nothing left behind."), details)


@case(
    proves=("pr41402",), needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, when a room is cleared while one of its chunks is still counted and decode ranks ABORT it "
    "before and after the clear, the worker's skip of that chunk ACKs each of them: no target is stranded.",
)
def nixl_skipped_chunk_acks_cleared_room(ctx) -> Outcome:
    """Scenario: a NIXL room's chunk is counted but not yet written (the staging path re-enqueues a chunk it
    cannot place yet, counted at its first dequeue: stood in for by marking the chunk counted). Decode rank 0
    ABORTs (the room goes Failed, its target is held on the count), the scheduler clears the room, decode
    rank 1 ABORTs the cleared room, and then the worker dequeues the chunk and skips it (room not in
    ``request_status``). The "transfer metadata cleared" skip branch gets the same change but is not driven:
    no sequence found here holds a target there.

    Upstream behaviour (0.5.22; the gap named on upstream #37077): the ABORT for a cleared room registers while
    a chunk is counted, and the worker's skip branches pop the count and then try the drain ACK, so the targets
    the count held are answered.

    Proves: the #41402 backport's NIXL skip-path ACK (patches/pr41402, 0.5.17 - 0.5.21): without it the skip
    pops the count and the held targets are stranded (decode waits its full release timeout), and on 0.5.21 the
    ABORT for the cleared room is neither registered nor answered."""
    from probes.nixl_rig import DECODE_PEERS as NIXL_PEERS
    from probes.nixl_rig import ROOM as NIXL_ROOM
    from probes.nixl_rig import NixlPrefillRig

    rig = NixlPrefillRig(ctx)
    chunk = rig.chunk(0, last=False)
    chunk.staging_counted = True  # counted at its first dequeue, then re-enqueued unsent
    rig.mgr._staging_outstanding[NIXL_ROOM] += 1
    rig.abort_from(0)
    held_before_clear = _nixl_targets_left(rig, NIXL_ROOM)
    rig.clear_sender()
    rig.abort_from(1)  # the other decode rank's ABORT reaches the cleared room
    acks_before_skip = len(rig.ledger.of("drain_ack"))
    rig.run_worker([chunk])
    details = rig.summary()
    left = _nixl_targets_left(rig, NIXL_ROOM)
    details.update(
        targets_before_clear=held_before_clear,
        acks_before_skip=acks_before_skip,
        targets_left=left,
        chunks_counted_at_end=rig.mgr._staging_outstanding.get(NIXL_ROOM, 0),
    )
    if held_before_clear != [f"{NIXL_PEERS[0][0]}:{NIXL_PEERS[0][1]}"]:
        raise RuntimeError(f"decode rank 0's ABORT was not held on the counted chunk ({held_before_clear})")
    problems = []
    if acks_before_skip:
        problems.append(f"{acks_before_skip} ACK(s) left while the chunk was still counted")
    missing = [peer for peer, n in details["acks_per_peer"].items() if n < 1]
    if missing:
        problems.append(f"no drain ACK reached {missing} after the chunk was skipped")
    if left:
        problems.append(f"targets {left} stranded on prefill")
    if details["writes_posted"]:
        problems.append(f"the cleared room's chunk was written ({details['writes_posted']})")
    return judged(problems, (
        f"The skipped chunk's count released both held ABORTs ({details['acks_per_peer']}), nothing written, "
        "nothing stranded."), details)


@case(
    proves=("pr41402",), needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor, a room reopened by its next request starts without the "
    "previous request's in-flight count and ACK targets: an ABORT with nothing in flight is ACKed at once.",
)
def constructed_manager_reopened_room_starts_clean(ctx) -> Outcome:
    """Scenario: a request's room keeps one chunk counted (a send the worker gave up on while it may still have
    been writing, as the failed-send path leaves it) and decode rank 1's ABORT held on it; the scheduler clears
    the room. The next request reuses the bootstrap room (opening status), and decode rank 0 ABORTs it with
    nothing of the new request queued or in flight.

    Upstream behaviour (0.5.22's ``CommonKVManager.update_status``): an opening status for an absent room also
    drops the room's deferred ACK targets and in-flight count (with the poison), so the new request's ABORT is
    answered at once and the old request's target is not carried over.

    Proves: the #41402 backport's reopen rule (patches/pr41402, 0.5.17 - 0.5.21): without it the stale count
    holds the new ABORT until decode's release timeout and the old target stays on prefill."""
    rig = _constructed(ctx, counts_outstanding=True)
    try:
        mgr = rig.mgr
        rig.open_room(CONSTRUCTED_ROOM, DECODE_PEERS)
        mgr._staging_outstanding[CONSTRUCTED_ROOM] += 1  # the previous request's chunk, never uncounted
        rig.abort_from(CONSTRUCTED_ROOM, *DECODE_PEERS[1])
        held = rig.targets_of(CONSTRUCTED_ROOM)
        rig.clear_sender(CONSTRUCTED_ROOM)
        acks_before_reopen = list(rig.acks_to())
        rig.open_room(CONSTRUCTED_ROOM, DECODE_PEERS)  # the next request reuses the room
        count_after_reopen = mgr._staging_outstanding.get(CONSTRUCTED_ROOM, 0)
        targets_after_reopen = rig.targets_of(CONSTRUCTED_ROOM)
        rig.abort_from(CONSTRUCTED_ROOM, *DECODE_PEERS[0])
        acks_after_reopen = rig.acks_to()[len(acks_before_reopen):]
        details = _constructed_details(rig)
        details.update(
            targets_held_by_old_request=held, acks_before_reopen=acks_before_reopen,
            count_after_reopen=count_after_reopen, targets_after_reopen=targets_after_reopen,
            acks_after_reopen=acks_after_reopen, targets_at_end=rig.targets_of(CONSTRUCTED_ROOM),
        )
    finally:
        rig.close()
    first = f"{DECODE_PEERS[0][0]}:{DECODE_PEERS[0][1]}"
    if not held or acks_before_reopen:
        raise RuntimeError(f"the old request's ABORT was not held on its count as planned ({held}, {acks_before_reopen})")
    problems = []
    if count_after_reopen:
        problems.append(f"the reopened room kept the old request's in-flight count ({count_after_reopen})")
    if targets_after_reopen:
        problems.append(f"the reopened room kept the old request's ACK targets {targets_after_reopen}")
    if first not in acks_after_reopen:
        problems.append(f"the new request's ABORT with nothing in flight got no ACK (ACKs: {acks_after_reopen})")
    return judged(problems, (
        f"The reopened room started with no count and no targets, and {first}'s ABORT was ACKed at once."), details)


@case(
    proves=("pr41402",), needs=("pr35049-ack",),
    must_preserve=False,
    expect="When both decode ranks ABORT a Mooncake room while its last chunk's state write is in flight, the "
    "worker writes nothing more for the room (no aux into decode's metadata slot, no next rank's KV) and each "
    "rank gets its drain ACK after the state write landed.",
)
def abort_during_state_send_writes_nothing_more(ctx) -> Outcome:
    """Scenario: a hybrid model's last chunk on Mooncake: the KV write lands, the state write (Mamba/SWA state
    pages) is in flight when both decode ranks ABORT the room (it goes Failed), then the state write lands.

    Upstream behaviour (0.5.22's ``MooncakeKVManager.transfer_worker``): right after ``maybe_send_extra`` the
    worker stops the room when it is Failed (an ABORT during the send, or the failed send itself), before the
    aux write and the status conclusion; the chunk's count then drains and the ACK goes out.

    Proves: the #41402 backport's state-send stop (patches/pr41402, 0.5.17 - 0.5.21): without it the worker
    still writes the aux slot (and the next decode rank's KV/state/aux) of a room both ranks gave up, after
    their ABORT."""
    rig = PrefillRig(ctx, plan=["complete", "hold"])  # rank 0's KV lands; its state write is held in flight
    chunk = rig.chunk()
    chunk.state_indices = [[3]]  # a hybrid model's state slot, sent with the last chunk
    rig.engine.during = lambda: (rig.abort_from(0), rig.abort_from(1))
    ended = rig.run_worker([chunk])
    rig.clear_sender()
    events = rig.ledger.events
    first_abort = next((i for i, e in enumerate(events) if e["kind"] == "abort_received"), None)
    if first_abort is None:
        raise RuntimeError("the ABORTs did not arrive during the state write as planned")
    held = [e for e in events[:first_abort] if e["kind"] == "write_posted"]
    if [e["what"] for e in held][-1:] != ["state"]:
        raise RuntimeError(f"the ABORTs did not arrive during the state write ({[e['what'] for e in held]})")
    after = [e["what"] for e in events[first_abort:] if e["kind"] == "write_posted"]
    details = rig.summary()
    details.update(worker=ended, writes_after_abort=after)
    problems = []
    if after:
        problems.append(f"{len(after)} write(s) posted after the ABORT ({after})")
    missing = [peer for peer, n in details["acks_per_peer"].items() if n < 1]
    if missing:
        problems.append(f"no drain ACK reached {missing}")
    if details["acks_while_writes_in_flight"]:
        problems.append("a drain ACK left while the state write was in flight")
    return judged(problems, (
        f"Nothing was written after the ABORT, and each decode rank got its ACK after the state write landed "
        f"({details['acks_per_peer']})."), details)
