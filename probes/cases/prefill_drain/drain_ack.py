"""When the prefill's drain ACK leaves (#35049, #40645, #41402's failed-send rule): the Mooncake
transfer worker's chunk outcomes (complete, timed out while still writing, held in flight, a crashed
worker, a failed aux or state write) and the NIXL failed handle. The probe: probes/cases/prefill_drain/.
"""

from __future__ import annotations

from typing import Any

from ... import SAFE, UNSAFE, Outcome, case, judged
from ...rigs.mooncake import DECODE_PEERS, ROOM, PrefillRig


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
    proves=("pr41402",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="After a send that timed out with its write still running, no drain ACK leaves (during the "
           "transfer, "
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
    proves=("pr40645",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="When ABORTs from both decode peers arrive while a write is in flight and the write then "
           "completes, "
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
        return Outcome(
            SAFE, f"Each decode peer got its drain ACK after the write landed ({counts}).", outcome.details
        )
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
    proves=("pr35049-ack",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="ABORTs for a room whose transfer already succeeded are ACKed to each decode peer, with nothing "
           "in flight.",
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
        return Outcome(
            SAFE, f"Each decode peer got its ACK for the concluded room ({counts}).", outcome.details
        )
    if outcome.verdict == SAFE:
        return Outcome(
            UNSAFE, f"A decode peer that asked got no ACK for the concluded room: {counts}.", outcome.details
        )
    return outcome


@case(
    proves=("pr35049-ack",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="When the transfer worker dies with a write posted, no drain ACK leaves for the room while it "
           "runs "
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
        rig,
        "No drain ACK left for the dead worker's room while its write was in flight.",
        "of the dead worker",
    )
    outcome.details["worker"] = ended
    return outcome


@case(
    needs=("pr35049-ack",),
    must_preserve=True,
    expect="A transfer whose writes all complete reaches Success, tells each decode peer once, and sends no "
           "ACK.",
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
        return Outcome(
            SAFE, "Success, one status message per decode peer, no ACK, room not poisoned.", details
        )
    return Outcome(UNSAFE, "The successful transfer did not conclude as before.", details)


@case(
    needs=("pr35049-ack",),
    must_preserve=True,
    expect="Without the drain-ACK capability (deferred release off) an ABORT after a failed send is answered "
           "at "
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
    proves=("pr41402",),
    needs=("pr35049-ack",),
    must_preserve=False,
    expect="After a Mooncake aux (metadata slot) or state write fails with the write still running, no drain "
           "ACK "
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
    return Outcome(
        UNSAFE, f"Drain ACK(s) sent while the failed {' and '.join(failed)} write was in flight.", runs
    )


def _nixl_failed_batch(ctx, plan: list[str]) -> dict:
    """One NIXL failed batch (``plan``: the first chunk's writes), ABORTs, the room's next chunk, clear() and
    a late ABORT; the summary with the writes still running before the probe settled them."""
    from ...rigs.nixl import NixlPrefillRig

    rig = NixlPrefillRig(ctx, plan=plan)
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
        raise RuntimeError(f"the planned {plan} batch did not happen as planned")
    return details


@case(
    proves=("pr41402",),
    needs=("pr35049-nixl", ">=0.4.5.post3"),  # NIXL: 0.4.5.post3
    must_preserve=False,
    expect="On NIXL, a chunk whose transfer handle fails (ERR) while a sibling handle still writes, or whose "
    "handle's state cannot be read while its write still runs, holds decode's pages (the backend defers "
    "release) "
    "and no drain ACK leaves while that write runs: not for a later chunk of the failed room, not after "
    "clear(), "
    "not for a late ABORT.",
)
def nixl_failed_handle_withholds_ack(ctx) -> Outcome:
    """#41023 (NIXL's capability) and #41402 (the failed-send rule, NIXL's worker and ABORT handler): an ERR
    handle aborts the batch while its sibling may still be writing, so the room's drain ACK is withheld for
    good and decode releases on its timeout. A handle whose state read raises (the agent lost track of it)
    proves nothing about its write either: the settle wait counts it as running (the pack's
    ``_await_handles`` on 0.5.13 - 0.5.19, upstream's from 0.5.20), so it withholds the ACK the same way."""
    runs = {"err_with_running_sibling": _nixl_failed_batch(ctx, ["err", "running"]),
            "unreadable_state": _nixl_failed_batch(ctx, ["unreadable"])}
    details = {**runs["err_with_running_sibling"], "unreadable_state": runs["unreadable_state"]}
    problems = []
    if not details["deferred_release"]:
        problems.append(
            "NIXL has no drain-ACK capability here, so decode releases the failed transfer's pages at once"
        )
    for name, run in runs.items():
        if run["acks_while_writes_in_flight"]:
            problems.append(
                f"{run['acks_while_writes_in_flight']} drain ACK(s) sent while the write ran ({name})"
            )
    return judged(problems, (
        "NIXL defers, and no drain ACK left while the sibling of the failed handle, or the write whose state "
        "could not be read, was still writing (decode releases on its timeout)."), details)
