"""0.5.22's standard where the pack differed (issue 26): a settled NIXL error drains, a skipped
chunk answers the ABORTs it held, a reopened room starts clean, and an ABORT during the Mooncake
state send stops the room's writes. The probe: probes/cases/prefill_drain/.
"""

from __future__ import annotations

from ... import Outcome, case, judged
from ...rigs.manager import CONSTRUCTED_ROOM, constructed, constructed_details
from ...rigs.mooncake import DECODE_PEERS, PrefillRig


def _nixl_targets_left(rig, room: int) -> list[str]:
    held = rig.mgr._deferred_ack_targets.get(room)
    if not held:
        return []
    if isinstance(held, dict):
        return sorted(f"{t[0]}:{t[1]}" for t in held.values())
    return [f"{held[0]}:{held[1]}"]


@case(
    proves=("pr41402",),
    needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, when a chunk's handle fails (ERR) and every other handle of the batch has settled, the "
           "chunk "
    "is uncounted and the decode peers' ABORTs for the failed room are each ACKed, with no count or target "
    "left.",
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
    from ...rigs.nixl import ROOM as NIXL_ROOM
    from ...rigs.nixl import NixlPrefillRig

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


def _nixl_cleared_room_skip(ctx, *, at_metadata_read: bool) -> dict:
    """Decode rank 0 ABORTs a room whose chunk is counted, the scheduler clears it, decode rank 1 ABORTs the
    cleared room; then the worker skips the chunk. ``at_metadata_read``: all three happen while the worker,
    having counted the chunk and seen the room live, is about to read its transfer metadata."""
    from ...rigs.nixl import DECODE_PEERS as NIXL_PEERS
    from ...rigs.nixl import ROOM as NIXL_ROOM
    from ...rigs.nixl import NixlPrefillRig, PausedAtMetadataRead

    rig = NixlPrefillRig(ctx)
    chunk = rig.chunk(0, last=False)
    seen: dict = {}

    def abort_clear_abort() -> None:
        rig.abort_from(0)
        seen["targets_before_clear"] = _nixl_targets_left(rig, NIXL_ROOM)
        rig.clear_sender()
        rig.abort_from(1)  # the other decode rank's ABORT reaches the cleared room
        seen["acks_before_skip"] = len(rig.ledger.of("drain_ack"))

    tolerate: tuple[type, ...] = ()
    if at_metadata_read:
        rig.mgr.transfer_infos = PausedAtMetadataRead(rig.mgr.transfer_infos, NIXL_ROOM, abort_clear_abort)
        tolerate = (AssertionError,)  # 0.5.18 asserts the metadata is there: its catch-all takes the chunk
    else:
        chunk.staging_counted = True  # counted at its first dequeue, then re-enqueued unsent
        rig.mgr._staging_outstanding[NIXL_ROOM] += 1
        abort_clear_abort()
    rig.run_worker([chunk], tolerate=tolerate)
    if at_metadata_read and not rig.mgr.transfer_infos.fired:
        raise RuntimeError("the worker never read the room's transfer metadata")
    details = rig.summary()
    details.update(seen, targets_left=_nixl_targets_left(rig, NIXL_ROOM),
                   chunks_counted_at_end=rig.mgr._staging_outstanding.get(NIXL_ROOM, 0))
    if seen["targets_before_clear"] != [f"{NIXL_PEERS[0][0]}:{NIXL_PEERS[0][1]}"]:
        raise RuntimeError(
            f"decode rank 0's ABORT was not held on the counted chunk ({seen['targets_before_clear']})"
        )
    return details


@case(
    proves=("pr41402",),
    needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, when a room is cleared while one of its chunks is still counted and decode ranks ABORT "
           "it "
    "before and after the clear, the worker's skip of that chunk ACKs each of them: no target is stranded, "
    "also "
    "when the clear lands while the worker is about to read the room's transfer metadata.",
)
def nixl_skipped_chunk_acks_cleared_room(ctx) -> Outcome:
    """Scenario: a NIXL room's chunk is counted but not yet written (the staging path re-enqueues a chunk it
    cannot place yet, counted at its first dequeue: stood in for by marking the chunk counted). Decode rank 0
    ABORTs (the room goes Failed, its target is held on the count), the scheduler clears the room, decode
    rank 1 ABORTs the cleared room, and then the worker dequeues the chunk and skips it (room not in
    ``request_status``). Second run, the same three events in the window between the worker counting a chunk
    of a live room and reading its transfer metadata (the scheduler and bootstrap threads run beside the
    worker): the worker finds no metadata and takes the "transfer metadata cleared" skip.

    Upstream behaviour (0.5.22; the gap named on upstream #37077): the ABORT for a cleared room registers
    while a chunk is counted, and the worker's skip branches pop the count and then try the drain ACK, so the
    targets the count held are answered.

    Proves: the #41402 backport's NIXL skip-path ACK (patches/pr41402, 0.5.17 - 0.5.21): without it the skip
    pops the count and the held targets are stranded (decode waits its full release timeout), and on 0.5.21
    the ABORT for the cleared room is neither registered nor answered. 0.5.18's worker asserts the metadata is
    there; its catch-all then settles the empty batch and ACKs."""
    runs = {"cleared_before_dequeue": _nixl_cleared_room_skip(ctx, at_metadata_read=False),
            "cleared_at_metadata_read": _nixl_cleared_room_skip(ctx, at_metadata_read=True)}
    details = {**runs["cleared_before_dequeue"], "cleared_at_metadata_read": runs["cleared_at_metadata_read"]}
    problems = []
    for name, run in runs.items():
        if run["acks_before_skip"]:
            problems.append(
                f"{run['acks_before_skip']} ACK(s) left while the chunk was still counted ({name})"
            )
        missing = [peer for peer, n in run["acks_per_peer"].items() if n < 1]
        if missing:
            problems.append(f"no drain ACK reached {missing} after the chunk was skipped ({name})")
        if run["targets_left"]:
            problems.append(f"targets {run['targets_left']} stranded on prefill ({name})")
        if run["writes_posted"]:
            problems.append(f"the cleared room's chunk was written ({run['writes_posted']}, {name})")
    return judged(
        problems,
        (
            f"The skipped chunk's count released both held ABORTs ({details['acks_per_peer']}), also when "
            "the clear "
            "landed at the worker's metadata read; nothing written, nothing stranded."
        ),
        details,
    )


@case(
    proves=("pr41402",),
    needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="On a prefill manager built by its constructor, a room reopened by its next request starts "
           "without the "
    "previous request's in-flight count and ACK targets: an ABORT with nothing in flight is ACKed at once.",
)
def constructed_manager_reopened_room_starts_clean(ctx) -> Outcome:
    """Scenario: a request's room keeps one chunk counted (a send the worker gave up on while it may still
    have been writing, as the failed-send path leaves it) and decode rank 1's ABORT held on it; the scheduler
    clears the room. The next request reuses the bootstrap room (opening status), and decode rank 0 ABORTs it
    with nothing of the new request queued or in flight.

    Upstream behaviour (0.5.22's ``CommonKVManager.update_status``): an opening status for an absent room also
    drops the room's deferred ACK targets and in-flight count (with the poison), so the new request's ABORT is
    answered at once and the old request's target is not carried over.

    Proves: the #41402 backport's reopen rule (patches/pr41402, 0.5.17 - 0.5.21): without it the stale count
    holds the new ABORT until decode's release timeout and the old target stays on prefill."""
    rig = constructed(ctx, counts_outstanding=True)
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
        details = constructed_details(rig)
        details.update(
            targets_held_by_old_request=held, acks_before_reopen=acks_before_reopen,
            count_after_reopen=count_after_reopen, targets_after_reopen=targets_after_reopen,
            acks_after_reopen=acks_after_reopen, targets_at_end=rig.targets_of(CONSTRUCTED_ROOM),
        )
    finally:
        rig.close()
    first = f"{DECODE_PEERS[0][0]}:{DECODE_PEERS[0][1]}"
    if not held or acks_before_reopen:
        raise RuntimeError(
            f"the old request's ABORT was not held on its count as planned ({held}, {acks_before_reopen})"
        )
    problems = []
    if count_after_reopen:
        problems.append(f"the reopened room kept the old request's in-flight count ({count_after_reopen})")
    if targets_after_reopen:
        problems.append(f"the reopened room kept the old request's ACK targets {targets_after_reopen}")
    if first not in acks_after_reopen:
        problems.append(
            f"the new request's ABORT with nothing in flight got no ACK (ACKs: {acks_after_reopen})"
        )
    return judged(
        problems,
        (f"The reopened room started with no count and no targets, and {first}'s ABORT was ACKed at once."),
        details,
    )


@case(
    proves=("pr41402",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="When both decode ranks ABORT a Mooncake room while its last chunk's state write is in flight, "
           "the "
    "worker writes nothing more for the room (no aux into decode's metadata slot, no next rank's KV) and "
    "each "
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
