"""A failed transfer's pages held until every prefill rank's drain ACK (#35049, #41023, #41404),
and the ACK tracker's early and late ACKs (#35049). The probe: probes/cases/page_lifetime/.
"""

from __future__ import annotations

import time
from typing import Any

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case
from ...rigs.failed_transfer import (
    TIMEOUT_ENV,
    TransferRig,
    drain_acking_manager,
    drain_acking_receiver,
    note_ack,
)
from ...standins import Ledger, pin_runtime

HOLD_TIMEOUT = 0.3


@case(
    # disaggregation.common (the receiver this case drives) arrives in 0.4.7; below 0.5.13 (no drain ACK)
    # this pack's sbp-abort-hold holds instead, until prefill's final Success or the timeout
    proves=("pr35049|sbp-abort-hold", "pr41023|sbp-abort-hold", "pr41404|sbp-abort-hold"),
    needs=(">=0.4.7",),
    must_preserve=False,
    expect='With the default environment, a failed transfer that decode did not initiate keeps its pages and '
           'metadata slot until every prefill rank has ACKed the drain (below 0.5.13, where no ACK exists: '
           'until the deferred-release timeout), then releases them exactly once.',
)
def failed_transfer_holds_pages_until_drain(ctx) -> Outcome:
    """#41404 + #41023: a failure decode did not initiate (prefill fault,
    transport error) reaching ``pop_transferred`` under the default env holds
    the pages until both prefill ranks ACK the drain, then releases them once.
    A tree with sbp-abort-hold and no ACK tracker (below 0.5.13) waits for each rank's final
    Success, which a prefill fault never sends: held until the timeout (0.3 s here), as 0.5.22
    holds a drain no ACK ends."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    success_hold = hasattr(DecodeTransferQueue, "_held_releases_due")
    if success_hold:
        ctx.setenv(TIMEOUT_ENV, str(HOLD_TIMEOUT))
    rig = TransferRig(ctx)
    mgr = drain_acking_manager(rig.ledger)
    rcv = drain_acking_receiver(rig.ledger, mgr, room=501, prefill_ranks=2)
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
    elif success_hold:
        time.sleep(HOLD_TIMEOUT + 0.2)
        rig.release_due()  # the hold's release pass: the next pop_transferred
        step("the timeout passed, pop_transferred", True)
    rig.resolve()
    step("resolve again", hasattr(mgr, "note_abort_ack") or success_hold)

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
    miscounted = [
        s["step"]
        for s in steps
        if s["held_count_reported"] is not None and s["held_count_reported"] != int(s["pages_held"] > 0)
    ]
    if miscounted:
        return Outcome(
            UNSAFE,
            f"num_pending_deferred_releases() disagrees with the pages held (at: {miscounted[0]}).",
            details,
        )
    if not freed_early and released_once and not details["double_releases"]:
        return Outcome(
            SAFE,
            "Pages held through the failure, released once at the deferred-release timeout (no drain ACK "
            "exists on this release; no final Success came)." if success_hold else
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
    mgr = drain_acking_manager(ledger)
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
    mgr = drain_acking_manager(ledger)
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
