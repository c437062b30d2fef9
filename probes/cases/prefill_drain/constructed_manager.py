"""The drain-ACK registry as the manager's constructor sets it up (issue 14):
probes/rigs/manager.py builds the tree's ``CommonKVManager`` through ``__init__``. The probe:
probes/cases/prefill_drain/.
"""

from __future__ import annotations

from typing import Any

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case, judged
from ...rigs.manager import CONSTRUCTED_ROOM, constructed, constructed_details
from ...rigs.mooncake import DECODE_PEERS


@case(
    proves=("pr40645",),
    needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor, ABORTs from both decode ranks for a room with a "
           "chunk "
    "outstanding are each held per endpoint, nothing is ACKed before the chunk drains, and each rank gets "
    "its ACK "
    "when it does (also when one rank's transfer info had not reached this prefill rank yet).",
)
def constructed_manager_holds_an_ack_per_aborting_peer(ctx) -> Outcome:
    """#41402's fan-out on the registry ``CommonKVManager.__init__`` creates (the per-endpoint target dict):
    the other cases fill that registry in by hand. The outstanding count stands for one queued chunk, as the
    transfer worker counts it; its drain is the worker's decrement and ``_maybe_ack_drained_abort``. 0.5.21
    also fans the ACK out to the room's registered decode ranks, so the second run lets rank 1 ABORT before
    its transfer info arrived (it is known to this rank only by its ABORT)."""
    runs: dict[str, Any] = {}
    for label, known in (
        ("both_ranks_registered", DECODE_PEERS),
        ("rank_1_not_yet_registered", DECODE_PEERS[:1]),
    ):
        rig = constructed(ctx, counts_outstanding=True)
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
            details = constructed_details(rig)
            details.update(targets_held_while_outstanding=held, acks_before_drain=early)
            runs[label] = details
        finally:
            rig.close()
    peers = [f"{ip}:{port}" for ip, port in DECODE_PEERS]
    problems = []
    for label, details in runs.items():
        missing = [p for p in peers if p not in details["acks_to"]]
        if details["acks_before_drain"] or missing:
            problems.append(
                f"{label}: held {details['targets_held_while_outstanding']}, ACKed before the drain "
                f"{details['acks_before_drain']}, never ACKed {missing}"
            )
    return judged(problems, (
        "No ACK left before the chunk drained and each rank got its ACK when it did, with and without"
        " rank 1's transfer info."), runs)


@case(
    proves=("pr41402",),
    needs=("pr41402", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor, poisoning a room (a failed send) drops its held "
           "ACK "
    "targets, a later ABORT for it is neither held nor ACKed, and the room's next request clears the poison "
    "(its ABORT is ACKed).",
)
def constructed_manager_poisoned_room_withholds_ack_until_reopened(ctx) -> Outcome:
    """0.5.22's failed-send rule (#41402 backport) on the poisoned-room set ``CommonKVManager.__init__``
    creates: ``poison_deferred_ack_room`` is what the transfer worker calls after a send that may still be
    writing."""
    from ...rigs.manager import registry_class

    if not hasattr(registry_class(), "poison_deferred_ack_room"):
        raise NotApplicable(
            "no failed-send rule in this release (no poisoned rooms): "
            "failed_send_withholds_ack_while_writes_in_flight "
            "judges what a failed send does to the drain ACK here"
        )
    rig = constructed(ctx, counts_outstanding=True)
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
        details = constructed_details(rig)
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
    proves=("pr35049-ack",),
    needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor (no transfer backend's write count added), "
           "clearing an "
    "aborted room's sender leaves none of its ACK targets behind (no leak on prefill), and ACKs only where "
    "the "
    "manager counts outstanding writes and the count shows the room drained.",
)
def cleared_sender_drops_target_without_drain_accounting(ctx) -> Outcome:
    """#40645's ``CommonKVSender.clear``: a manager without ``_staging_outstanding`` cannot tell when a room
    drained, so clear() drops the target rather than ACK (no shipped backend registers targets without the
    count, but the common API allows it). From 0.5.22 ``CommonKVManager.__init__`` sets the count up itself,
    so clear() ACKs the quiescent room instead; both leave nothing behind."""
    from sglang.srt.disaggregation.base import KVPoll

    rig = constructed(ctx, counts_outstanding=False)
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
        details = constructed_details(rig)
        details.update(
            manager_counts_outstanding=counted, targets_before_clear=held, targets_after_clear=left
        )
    finally:
        rig.close()
    if not held:
        raise RuntimeError("the ACK target was not registered as planned")
    unproven_acks = [] if counted else details["acks_to"]
    if not left and not unproven_acks:
        how = (
            f"ACKed {details['acks_to']} on a drained count"
            if counted
            else "sent no ACK (no count to prove a drain)"
        )
        return Outcome(SAFE, f"clear() dropped the held target ({held[0]}) and {how}.", details)
    return Outcome(
        UNSAFE,
        f"After clear() the room still holds {left}; ACKs without a drain count: {unproven_acks}.",
        details,
    )
