"""An ABORTed room stays Failed (0.5.20's ``update_status``; #41402's variants below it): a
NIXL chunk that lands after the ABORT, a decode rank's transfer info that arrives after another
rank's ABORT. The probe: probes/cases/prefill_drain/.
"""

from __future__ import annotations

from types import SimpleNamespace

from ... import SAFE, UNSAFE, Outcome, case
from ...rigs.mooncake import ROOM, PrefillRig, deliver_to_bootstrap_thread, kv_indices
from ...standins import sg


def _status_name(KVPoll, value) -> str:
    """A room's KVPoll status by name (``KVPoll`` is a class of ints); ``None``: the room is cleared."""
    names = {
        getattr(KVPoll, n): n
        for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
    }
    return names.get(value, str(value))


def _writes_after_first_ack(ledger) -> int:
    """Writes posted after the first drain ACK left: decode may free (and reuse) the pages on it."""
    seen_ack, count = False, 0
    for event in ledger.events:
        seen_ack = seen_ack or event["kind"] == "drain_ack"
        count += seen_ack and event["kind"] == "write_posted"
    return count


def _nixl_healthy_room(ctx) -> dict:
    """The control: both chunks of a room no decode rank aborts land; the room concludes Success and its
    transfer metadata is dropped; a late ABORT for the concluded room (nothing in flight) is ACKed at once."""
    from ...rigs.nixl import ROOM as NIXL_ROOM
    from ...rigs.nixl import NixlPrefillRig

    rig = NixlPrefillRig(ctx)
    rig.run_worker([rig.chunk(0, last=False)])
    status_after_first = rig.mgr.request_status.get(NIXL_ROOM)
    rig.run_worker([rig.chunk(1, last=True)])
    status = rig.mgr.request_status.get(NIXL_ROOM)
    rig.abort_from(0)
    return {"status_after_first_chunk": _status_name(rig.KVPoll, status_after_first),
            "status_at_end": _status_name(rig.KVPoll, status),
            "metadata_kept": NIXL_ROOM in rig.mgr.transfer_infos,
            "late_abort_acks": rig.ledger.count("drain_ack"),
            "acks_while_writes_in_flight": rig.summary()["acks_while_writes_in_flight"]}


@case(
    proves=("pr35049-nixl",),
    needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, when the decode peers ABORT a room while its non-last chunk is in flight, the room "
           "stays Failed "
    "after that chunk lands: no write of the room's next chunk reaches decode after the drain ACK went out.",
)
def nixl_aborted_room_stays_failed_after_inflight_chunk(ctx) -> Outcome:
    """Terminal Failed on NIXL: the worker's Transferring update for a finished non-last chunk must not lift
    an ABORTed room back (Failed sorts lowest), or the next chunk writes into pages decode freed (and may have
    given to another request) on the ACK. 0.5.17-0.5.19 keep Failed sticky in ``NixlKVManager.update_status``
    (0.5.20 moved the rule into ``CommonKVManager``), so this holds wherever NIXL has a drain ACK; with the
    common rule of 0.5.19 alone the same run posts the next chunk's writes after the ACK. Control (an error
    when it fails): a room no decode rank aborts concludes Success, drops its metadata and ACKs a late ABORT
    at once."""
    from ...rigs.nixl import ROOM as NIXL_ROOM
    from ...rigs.nixl import NixlPrefillRig

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
    details["healthy_room"] = healthy = _nixl_healthy_room(ctx)
    if healthy["status_at_end"] != "Success" or healthy["metadata_kept"] or healthy["late_abort_acks"] != 1:
        raise RuntimeError(
            f"the control (a room no decode rank aborts) did not conclude as before: {healthy}"
        )
    still_failed = status_after_first == rig.KVPoll.Failed and status in (rig.KVPoll.Failed, None)
    if written_after == 0 and still_failed:
        return Outcome(
            SAFE,
            "The aborted room stayed Failed after its in-flight chunk landed; its next chunk "
            "wrote nothing after the drain ACK (the control room concluded Success).",
            details,
        )
    return Outcome(
        UNSAFE,
        f"The aborted room went {details['status_after_inflight_chunk']} after its in-flight "
        f"chunk landed, and {written_after} write(s) of its next chunk were posted after the drain ACK "
        "(into pages decode may have freed).",
        details,
    )


# 0.5.20 shipped the sticky-Failed rule without a fix record; the pack carries it in #41402's
# variants for 0.5.17 - 0.5.19, so that is what the case proves (0.5.20/0.5.21: exceptions).
@case(
    proves=("pr41402",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="When one decode rank ABORTs a room before the other rank's transfer info arrived, the room stays "
           "Failed "
    "when that info arrives: the scheduler's next chunk is refused and nothing is written after the drain "
    "ACK.",
)
def aborted_room_stays_failed_on_late_bootstrap(ctx) -> Outcome:
    """0.5.20's terminal Failed (update_status): the bootstrap thread's WaitingForInput for a room whose last
    decode rank registered late must not lift an ABORTed room back (Failed sorts lowest), or its chunks are
    sent into pages the ABORTing rank freed (and may have reused) on its drain ACK."""
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
        return Outcome(
            SAFE,
            "The aborted room stayed Failed when the late transfer info arrived; its chunk was "
            "refused and nothing was written after the drain ACK.",
            details,
        )
    return Outcome(
        UNSAFE,
        f"The late transfer info lifted the aborted room to {details['status_after_late_info']}; "
        f"{len(queued)} chunk(s) queued, {written_after} write(s) posted after the drain ACK (into pages "
        "decode may have freed).",
        details,
    )
