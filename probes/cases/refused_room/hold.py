"""Releases with the pack's hold (0.4.7 - 0.5.12.post1): a refused room's reservation ends at once.

sbp-abort-hold keeps a failed transfer's pages until every prefill rank the room waits for sent its
last word (its final Success) or the deferred-release timeout. Prefill's door (#38935) refuses an
over-pool request before a KV sender exists, so no rank ever sends that Success: after the router's
abort, decode kept the reservation it made for the whole prompt until the timeout (live: 400 tokens
for 45 s; 0.5.22 within 4.2 s). With ``sbp-refused-hold`` prefill reports the refused room
(ROOM_REFUSED) and decode counts it as the rank's last word; on 0.4.7 - 0.4.9 the report is
``sbp-refused-room``'s and sbp-abort-hold's variants there count it.

Driven end to end: the tree's real prefill ``MooncakeKVManager`` (constructor, bootstrap thread,
transfer workers; probes/rigs/mooncake_prefill.py) behind the real prefill door
(``PrefillBootstrapQueue.add``), the frames it pushed handed to the real decode ``MooncakeKVManager``'s
decode thread (probes/rigs/mooncake_decode.py), the real ``MooncakeKVReceiver.abort`` (the router's
abort through ``Scheduler.abort_request``) and the real ``DecodeTransferQueue.pop_transferred``. A
tree whose prefill has no ``refuse_room`` sends nothing, as its prefill does. Both orders run: decode
registers before the refusal and hears it before the abort; the refusal comes first, decode registers
after it and hears it only once its abort started the hold. Where decode's ``abort_request`` cannot
reach a transferring request (``MooncakeKVReceiver.abort``: 0.4.9.post5 on) the report alone fails
the room: the steps are the same without the abort.
"""

from __future__ import annotations

from typing import Any

from ... import NotApplicable, Outcome, case, judged
from ...rigs.door import REJECTION, DoorRig
from ...rigs.failed_transfer import TIMEOUT_ENV, TransferRig
from ...rigs.mooncake_decode import MooncakeDecodeSide
from ...rigs.mooncake_prefill import MooncakePrefillSide
from ...standins import make_req, reject_at_intake, sg

ROOM = 7401
PAGES = 4


def _one_order(ctx, *, register_first: bool) -> dict[str, Any]:
    prefill = None
    module = sg("disaggregation.mooncake.conn")
    if hasattr(module.MooncakeKVManager, "refuse_room"):
        prefill = MooncakePrefillSide(ctx)
        doors = DoorRig(ctx)
        doors.prefill_queue.kv_manager = prefill.mgr
        twin = make_req("refused", 9000, room=ROOM)
        reject_at_intake(twin, REJECTION)
        kept = module.REFUSED_ROOMS_KEPT
        if register_first:
            # A registration already stored is reported even when the memory of refused rooms (kept
            # only for late registrations) is full: keep none here; the other order needs it.
            module.REFUSED_ROOMS_KEPT = 0
        try:
            for step in (["register", "refuse"] if register_first else ["refuse", "register"]):
                if step == "register":
                    prefill.register(ROOM, PAGES)
                else:
                    doors.prefill_door(twin)
                prefill.run_workers()
        finally:
            module.REFUSED_ROOMS_KEPT = kept
    # Decode after the door: TransferRig's recorders of decode's cache helpers must be the last set.
    decode = MooncakeDecodeSide(ctx)
    rig = TransferRig(ctx)
    rig.poll_receivers(ctx)
    recv = decode.receiver(ROOM, prefill_ranks=1)
    req = rig.enqueue(recv, "refused", ROOM)

    def hear_prefill() -> None:
        for frames in prefill.wire if prefill else ():
            decode.deliver_frames(frames)

    steps = []
    if register_first:
        hear_prefill()
        aborted = _router_abort(recv)
        rig.queue.pop_transferred()
    else:
        aborted = _router_abort(recv)
        rig.queue.pop_transferred()
        steps.append({"step": "abort, pop_transferred (hold)", **rig.snapshot(req)})
        hear_prefill()
    rig.queue.pop_transferred()
    steps.append({"step": "next pop_transferred", **rig.snapshot(req)})
    return {
        "order": ("registered, refused, reported, aborted" if register_first
                  else "refused, registered, aborted, reported")
        + ("" if aborted else " (no abort: decode cannot abort a transfer)"),
        "reports": len(prefill.wire) if prefill else 0,
        "prefill_keeps": prefill.keeps(ROOM) if prefill else [],
        "steps": steps,
        "client_answers": len(rig.ledger.of("stream", rid="refused")),
        "room_state_left": sorted(name for name in ("held_rooms", "request_status", "failure_records")
                                  if ROOM in (getattr(decode.mgr, name, None) or {})),
    }


def _router_abort(recv) -> bool:
    """The router aborts decode's twin once prefill answered its 400; decode's ``abort_request``
    reaches a transferring request from 0.4.9.post5 (``MooncakeKVReceiver.abort``), not before.
    Whether the abort reached it."""
    if not callable(getattr(recv, "abort", None)):
        return False
    recv.abort()
    return True


def _two_ranks(ctx) -> dict[str, Any] | None:
    """Two prefill ranks write the room (heterogeneous TP) and both refuse it; decode reads the room's
    failure after the first report: the pages wait for the second (the other rank could still be
    writing, for all decode knows), then go at the next poll. None where a status names no rank."""
    decode = MooncakeDecodeSide(ctx)
    if not decode.ranked:
        return None
    # the report's wire value (-1 in every variant; a tree without the report names none)
    refused = getattr(sg("disaggregation.mooncake.conn"), "ROOM_REFUSED", -1)
    rig = TransferRig(ctx)
    rig.poll_receivers(ctx)
    recv = decode.receiver(ROOM, prefill_ranks=2)
    req = rig.enqueue(recv, "refused", ROOM)
    decode.deliver(ROOM, refused, 0)
    _router_abort(recv)
    rig.queue.pop_transferred()
    steps = [{"step": "rank 0 refused, pop_transferred", **rig.snapshot(req)}]
    decode.deliver(ROOM, refused, 1)
    rig.queue.pop_transferred()
    steps.append({"step": "rank 1 refused, pop_transferred", **rig.snapshot(req)})
    return {"order": "two ranks refused, one report before the failure is read", "steps": steps,
            "client_answers": len(rig.ledger.of("stream", rid="refused")),
            "room_state_left": sorted(name for name in ("held_rooms", "request_status", "failure_records")
                                      if ROOM in (getattr(decode.mgr, name, None) or {}))}


@case(
    # on 0.4.7 - 0.4.9 sbp-refused-room's report ends the hold (sbp-abort-hold's variants count it)
    proves=("sbp-refused-hold|sbp-refused-room",),
    needs=("sbp-abort-hold",),
    must_preserve=False,
    expect="A request prefill's door refused releases decode's reservation (pages and metadata slot, "
           "once) at decode's next poll after the router's abort, not at the deferred-release timeout, "
           "in both orders of registration, refusal, report and abort; prefill keeps nothing for the room; "
           "where two prefill ranks write the room, not before both reported.",
)
def refused_room_ends_decode_hold(ctx) -> Outcome:
    if not hasattr(sg("disaggregation.decode").DecodeTransferQueue, "_held_releases_due"):
        raise NotApplicable("decode releases a failed transfer at once in this tree (no sbp-abort-hold): "
                            "nothing holds a refused room's reservation")
    ctx.setenv(TIMEOUT_ENV, "30")
    runs = [_one_order(ctx, register_first=first) for first in (True, False)]
    problems = []
    ranks = _two_ranks(ctx)
    if ranks is not None:
        runs.append(ranks)
        if not ranks["steps"][0]["pages_held"]:
            problems.append(f"{ranks['order']}: pages returned before rank 1's report")
    for run in runs:
        last = run["steps"][-1]
        if last["pages_held"] or last["release_calls"] != 1 or last["metadata_frees"] != 1:
            problems.append(f"{run['order']}: {last['pages_held']} page(s) still held, released "
                            f"{last['release_calls']} time(s), metadata freed "
                            f"{last['metadata_frees']} time(s)")
        if run["client_answers"] != 1:
            problems.append(f"{run['order']}: the client was answered {run['client_answers']} time(s)")
        if run.get("prefill_keeps"):
            problems.append(f"{run['order']}: prefill still keeps the room in {run['prefill_keeps']}")
        if run["room_state_left"] and not last["pages_held"]:
            problems.append(f"{run['order']}: decode still keeps the room in {run['room_state_left']}")
    return judged(problems, "Released at the next poll in both orders; prefill keeps nothing.",
                  {"runs": runs},
                  unsafe_prefix="Decode holds a refused request's reservation until the timeout: ")
