"""Below 0.5.13: a failed transfer's pages held until prefill stopped writing them (this pack's
``sbp-abort-hold``; issue 41). The probe: probes/cases/page_lifetime/.

0.5.10 - 0.5.12.post1 and older have no decode-to-prefill ABORT and no drain ACK, so the chain
the other page_lifetime cases judge (#35049 ... #41404) cannot exist there; what stops decode
from freeing pages a late write still reaches is that it waits for every prefill rank's final
Success (sent only after the rank's last write) or the deferred-release timeout. Driven: the
tree's real ``DecodeTransferQueue.pop_transferred`` (TransferRig), a real decode
``MooncakeKVManager`` built by its constructor with its real decode thread taking the prefill
ranks' statuses, the real ``MooncakeKVReceiver.abort`` decode's ``abort_request`` calls and its
real ``poll``. Stand-ins: the page pool and metadata allocator (TransferRig), the TP all-reduce
of the polls (one rank: the polls themselves) and of the hold decision (one rank: the flags).
"""

from __future__ import annotations

import time

from ... import NotApplicable, Outcome, case, judged
from ...rigs.failed_transfer import TIMEOUT_ENV, TransferRig
from ...rigs.mooncake_decode import MooncakeDecodeSide
from ...standins import sg

ROOM = 7301


def _applies(decode_abort: bool) -> bool:
    """Applicability from the tree's code (the matrix may not know the release): these cases judge
    decode without a drain ACK. True where its Mooncake decode counts each prefill rank's Success
    (0.4.8.post1 on); below, one prefill rank writes a decode room and a status names no rank."""
    import inspect

    common, mooncake = sg("disaggregation.common.conn"), sg("disaggregation.mooncake.conn")
    if "abort_notified" in inspect.getsource(common):
        raise NotApplicable("decode tells prefill of an abort in this release (ABORT, drain ACK: 0.5.13 on): "
                            "the #35049 chain's cases judge it")
    ranked = "required_prefill_response_num_table" in inspect.getsource(mooncake) + inspect.getsource(common)
    if not ranked and decode_abort:
        raise NotApplicable("decode does not count each prefill rank's Success in this release "
                            "(from 0.4.8.post1)")
    if decode_abort and not callable(getattr(mooncake.MooncakeKVReceiver, "abort", None)):
        raise NotApplicable("decode's abort_request cannot reach a transferring request in this release "
                            "(MooncakeKVReceiver.abort: 0.4.9.post5 on)")
    return ranked


def _rig(ctx, timeout: str | None = None) -> tuple[TransferRig, MooncakeDecodeSide]:
    if not hasattr(sg("disaggregation.mooncake.conn").MooncakeKVManager, "start_decode_thread"):
        raise NotApplicable("this release's Mooncake decode manager has no decode thread of its own")
    ctx.setenv(TIMEOUT_ENV, timeout)
    rig = TransferRig(ctx)
    rig.poll_receivers(ctx)
    return rig, MooncakeDecodeSide(ctx)


@case(
    proves=("sbp-abort-hold",),
    # decode's abort_request reaches its transfer queue (MooncakeKVReceiver.abort) from 0.4.9.post5; the
    # pack's hold serves 0.4.7 - 0.5.12.post1 (from 0.5.13 the drain ACK)
    needs=(">=0.4.9.post5,<0.5.13",),
    must_preserve=False,
    expect="A transfer decode aborts while prefill may still write it keeps its pages and metadata slot "
           "(its client answered at once) until every prefill rank the room waits for has sent its final "
           "Success, then releases them exactly once.",
)
def aborted_transfer_held_until_prefill_done(ctx) -> Outcome:
    from sglang.srt.disaggregation.base import KVPoll

    _applies(decode_abort=True)
    rig, decode = _rig(ctx)
    recv = decode.receiver(ROOM, prefill_ranks=2)
    req = rig.enqueue(recv, "aborted", ROOM)
    decode.deliver(ROOM, KVPoll.Success, 0)     # rank 0 finished before the abort
    recv.abort()                                # Scheduler.abort_request on a transfer-queue request
    steps = []
    rig.queue.pop_transferred()
    steps.append({"step": "abort, pop_transferred", **rig.snapshot(req)})
    rig.queue.pop_transferred()
    steps.append({"step": "pop_transferred again (rank 1 still writing)", **rig.snapshot(req)})
    decode.deliver(ROOM, KVPoll.Success, 1)     # rank 1's last write done
    rig.queue.pop_transferred()
    steps.append({"step": "rank 1's Success, pop_transferred", **rig.snapshot(req)})
    rig.queue.pop_transferred()
    steps.append({"step": "pop_transferred again", **rig.snapshot(req)})
    streams = len(rig.ledger.of("stream", rid="aborted"))
    details = {"steps": steps, "client_answers": streams,
               "double_releases": rig.ledger.count("pages_double_release"),
               "room_state_left": sorted(name for name in ("held_rooms", "request_status", "failure_records")
                                         if ROOM in (getattr(decode.mgr, name, None) or {}))}
    problems = []
    early = [s["step"] for s in steps[:2] if s["pages_held"] == 0]
    if early:
        problems.append(f"pages returned while prefill rank 1 may still write them (at: {early[0]})")
    final = steps[-1]
    if final["pages_held"] or final["release_calls"] != 1 or final["metadata_frees"] != 1:
        problems.append(f"after both ranks' Success: {final['pages_held']} page(s) held, released "
                        f"{final['release_calls']} time(s), metadata freed {final['metadata_frees']} time(s)")
    if streams != 1 or details["double_releases"]:
        problems.append(f"the client was answered {streams} time(s); "
                        f"{details['double_releases']} double release(s)")
    if details["room_state_left"]:
        problems.append(f"the room is still kept in {details['room_state_left']}")
    return judged(problems, "Held through the abort while rank 1 wrote; released once after its Success.",
                  details, unsafe_prefix="")


@case(
    proves=("sbp-abort-hold",),
    # the pack's hold serves 0.4.7 - 0.5.12.post1 (the drain ACK: 0.5.13); from 0.4.7 decode takes a
    # prefill rank's Failed as final and frees at once (0.4.7 - 0.4.8: one writer per room)
    needs=(">=0.4.7,<0.5.13",),
    must_preserve=False,
    expect="A transfer a prefill rank reports Failed (its other writes may still land) keeps its pages until "
           "the deferred-release timeout even when the other rank succeeded meanwhile, then releases them "
           "exactly once (0.4.7 - 0.4.8: the room's one writer reports Failed).",
)
def prefill_failure_held_until_timeout(ctx) -> Outcome:
    from sglang.srt.disaggregation.base import KVPoll

    ranked = _applies(decode_abort=False)
    rig, decode = _rig(ctx, timeout="0.3")
    recv = decode.receiver(ROOM, prefill_ranks=2 if ranked else 1)
    req = rig.enqueue(recv, "prefill-failed", ROOM)
    decode.deliver(ROOM, KVPoll.Failed, 0)
    rig.queue.pop_transferred()
    if ranked:  # the other rank finishes its writes while decode holds the room
        decode.deliver(ROOM, KVPoll.Success, 1)
    rig.queue.pop_transferred()
    before = rig.snapshot(req)
    time.sleep(0.5)
    rig.queue.pop_transferred()
    after = rig.snapshot(req)
    details = {"before_timeout": before, "after_timeout": after,
               "double_releases": rig.ledger.count("pages_double_release")}
    problems = []
    if before["pages_held"] == 0:
        problems.append("pages returned at the failure, before the timeout")
    if after["pages_held"] or after["release_calls"] != 1 or after["metadata_frees"] != 1:
        problems.append(f"after the timeout: {after['pages_held']} page(s) held, released "
                        f"{after['release_calls']} time(s)")
    return judged(problems, "Held until the timeout, released once.", details, unsafe_prefix="")
