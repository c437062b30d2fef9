"""Rejected requests at the PD doors (the fix, #38935): retired at the door, no handoff, the 400
streamed once. The probe: probes/cases/admission/."""

from __future__ import annotations

from typing import Any

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case, judged
from ...rigs.door import REJECTION, DoorRig, handoff_summary, retired_cleanly
from ...standins import (
    Ledger,
    aborted_prefetch_releasable,
    construct_with,
    describe_finish,
    has_method,
    make_req,
    reject_at_intake,
)

# ---------------------------------------------------------------------------
# rejected requests at the doors (the fix)


@case(
    proves=("pr38935",),
    must_preserve=False,
    expect='A request rejected through set_finish_with_abort is retired at PrefillBootstrapQueue.add: no KV '
           'sender, no bootstrap queue entry, no metadata buffer, its 400 streamed once.',
)
def prefill_door_rejected_not_enqueued(ctx) -> Outcome:
    """#38935 prefill door: a request rejected by ``set_finish_with_abort``
    gets no KV sender, no bootstrap queue entry, no metadata buffer, and the
    client receives the original 400 exactly once."""
    rig = DoorRig(ctx)
    req = make_req("rejected-p", 9000, room=101)
    reject_at_intake(req, REJECTION)
    rig.prefill_door(req)
    obs = rig.observe(req)
    obs["prompt_tokens_after_rejection"] = len(req.origin_input_ids)
    if retired_cleanly(obs):
        return Outcome(SAFE, "Retired at the prefill door: no sender, not queued, 400 streamed once.", obs)
    return Outcome(UNSAFE, "Admitted at the prefill door; " + handoff_summary(obs) + ".", obs)


@case(
    proves=("pr38935",),
    must_preserve=False,
    expect='A request rejected through set_finish_with_abort is retired at DecodePreallocQueue.add: no KV '
           'receiver, no prealloc queue entry, its 400 streamed once.',
)
def decode_door_rejected_not_enqueued(ctx) -> Outcome:
    """#38935 decode door: a rejected request gets no KV receiver and no
    prealloc queue entry; the 400 is streamed once."""
    rig = DoorRig(ctx)
    req = make_req("rejected-d", 9000, room=102)
    reject_at_intake(req, REJECTION)
    rig.decode_door(req)
    obs = rig.observe(req)
    if retired_cleanly(obs):
        return Outcome(SAFE, "Retired at the decode door: no receiver, not queued, 400 streamed once.", obs)
    return Outcome(UNSAFE, "Admitted at the decode door; " + handoff_summary(obs) + ".", obs)


class _ClientStream:
    """Stands for the output streamer as the client sees it. Like the tree's
    own streamer, a finished request goes out once: one whose finished output
    already went out (``finished_output``) is skipped, and emitting one sets
    it. Records what went out."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs):
        for req in reqs:
            if req.finished() and getattr(req, "finished_output", False):
                continue
            if req.finished() and hasattr(req, "finished_output"):
                req.finished_output = True
            self.ledger.record("stream", rid=req.rid, finish=describe_finish(req.finished_reason))


@case(
    proves=("pr38935",),
    needs=(">=0.4.6.post4",),
    must_preserve=False,
    expect="A request whose intake abort was already promoted into finished_reason and streamed is retired "
           "at PrefillBootstrapQueue.add and at DecodePreallocQueue.add: no KV sender or receiver, no queue "
           "entry, no metadata buffer, its cache-side state released, and the client gets the 400 exactly "
           "once.",
)
def finished_abort_retired_at_doors(ctx) -> Outcome:
    """#38935 (as upstream's predicate, ``is_aborted``): an abort already
    promoted into ``finished_reason`` (``update_finish_state``) and streamed
    reaches each door; it gets no handoff object and no queue entry, and is
    not streamed a second time."""
    rig = DoorRig(ctx)
    if not hasattr(make_req("probe-finished-output", 1, room=0), "finished_output"):
        raise NotApplicable(
            "requests of this release carry no finished_output (from 0.4.6.post4): nothing records that a "
            "finish went out, the streamer sends a finished request on every call, and no path streams a "
            "request before its door, so an already-streamed abort cannot reach one"
        )
    client = _ClientStream(rig.ledger)
    rig.shell.output_streamer = client
    if "stream_output" in rig.shell.__dict__:  # up to 0.5.12.post1 the scheduler streams itself
        rig.shell.stream_output = client.stream_output
    doors: dict[str, Any] = {}
    for side, room in (("prefill", 103), ("decode", 104)):
        req = make_req(f"finished-abort-{side}", 9000, room=room)
        reject_at_intake(req, REJECTION)
        if hasattr(req, "update_finish_state"):
            req.update_finish_state()  # the 400 promoted into finished_reason ...
        elif hasattr(req, "to_finish"):  # up to 0.5.12.post1 the scheduler promotes it inline
            req.finished_reason, req.to_finish = req.to_finish, None
        # up to 0.5.4.post1 the abort is written into finished_reason at once: nothing to promote
        client.stream_output([req], False)  # ... and streamed to the client
        if side == "prefill":
            rig.prefill_door(req)
        else:
            rig.decode_door(req)
        doors[side] = rig.observe(req)
    # Where the tree cannot drop an aborted prefetch (0.4.9.post3 - 0.5.1.post3) there is nothing to release.
    releases_due = 1 if aborted_prefetch_releasable() else 0
    failed = [
        side
        for side, obs in doors.items()
        if not (retired_cleanly(obs) and obs["release_aborted_request_calls"] == releases_due)
    ]
    if not failed:
        return Outcome(
            SAFE, "Retired at both doors: no handoff object, not queued, the 400 streamed once in all.", doors
        )
    return Outcome(
        UNSAFE,
        "; ".join(
            f"{side} door: {handoff_summary(doors[side])}, cache-side release "
            f"{doors[side]['release_aborted_request_calls']} time(s)"
            for side in failed
        )
        + ".",
        doors,
    )


def _streaming_session():
    """A real streaming ``Session`` of the tree, marked in flight as ``create_req`` marks it when the
    session's request is created (None where sessions keep no in-flight state)."""
    try:
        from sglang.srt.session.session_controller import Session
    except ImportError:
        return None
    if not callable(getattr(Session, "abort_req", None)):
        return None
    session = construct_with(Session, capacity_of_str_len=1 << 16, session_id="probe-stream", streaming=True)
    if not hasattr(session, "_inflight"):
        return None
    session._inflight = True
    return session


@case(
    proves=("pr38935",),
    needs=(">=0.5.11",),
    must_preserve=False,
    expect="A rejected request of a streaming session is retired at PrefillBootstrapQueue.add with no "
           "handoff, its "
    "400 streamed once, its session no longer in flight (the session's next request is accepted), and the "
    "cache-side state it took before the door (a HiCache storage prefetch) released once through the tree "
    "cache.",
)
def rejected_session_request_releases_session_and_cache(ctx) -> Outcome:
    """#38935's retirement undoes what was taken before the door: ``create_req`` marked the streaming
    session in flight and ``_prefetch_kvcache`` may have started a HiCache storage prefetch. The tree's own
    ``_release_aborted_request`` runs here (with HiCache storage on), down to the recording tree cache."""
    session = _streaming_session()
    if session is None:
        raise NotApplicable(
            "streaming sessions keep no in-flight state in this release (no Session.abort_req)"
        )
    rig = DoorRig(ctx)
    if has_method("managers.scheduler.Scheduler", "_release_aborted_request"):
        del rig.shell._release_aborted_request  # the tree's own, not the rig's recorder
    rig.shell.enable_hicache_storage = True
    req = make_req("rejected-session", 9000, room=105)
    req.session = session
    reject_at_intake(req, REJECTION)
    rig.prefill_door(req)
    obs = rig.observe(req)
    led = rig.ledger
    obs["cache_releases"] = (
        led.count("tree_release_aborted", rid=req.rid)
        + led.count("tree_finish", outcome="ABORT")
        + obs["release_aborted_request_calls"]
    )
    obs["session_still_in_flight"] = bool(session._inflight)
    problems = []
    if not retired_cleanly(obs):
        problems.append(handoff_summary(obs))
    if obs["session_still_in_flight"]:
        problems.append("the streaming session is still in flight, so it refuses every later request")
    if obs["cache_releases"] != 1:
        problems.append(f"cache-side state released {obs['cache_releases']} time(s)")
    obs["violations"] = problems
    return judged(problems, (
        "Retired at the prefill door: session detached, cache-side state released once, 400 streamed "
        "once."), obs)

