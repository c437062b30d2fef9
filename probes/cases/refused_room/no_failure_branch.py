"""Releases whose decode had no failure branch (0.4.5.post1 - 0.4.6.post4: a Failed poll raised
"Transfer failed" and stopped decode): the pack's refused-room release there is for a refused room
only, and agreed across decode ranks (the package docstring tells the story)."""

from __future__ import annotations

from typing import Any

from ... import NotApplicable, Outcome, case, judged
from ...rigs.failed_transfer import TRANSFER_FAILED_STOP, TransferRig, failure_stops_decode
from ...rigs.refused_room import (
    REFUSED_ROOM,
    FirstTokenBuffers,
    MooncakeSide,
    decode_receiver,
    decode_rig,
    refuse_at_prefill,
    status_frames,
)
from ...standins import sg

FAILED_ROOM = 4244


def no_failure_branch(elsewhere: str) -> None:
    """The cases here run where a Failed poll stops decode (up to 0.4.6.post4, read from the code);
    elsewhere they are not applicable: `elsewhere` says what judges that release instead."""
    if not failure_stops_decode():
        raise NotApplicable(f"decode has a failed-transfer path of its own (0.4.6.post5 on): {elsewhere}")


def pop(rig: TransferRig) -> str | None:
    """One transfer-queue poll; the release's own stop on a Failed poll is returned, not raised."""
    try:
        rig.queue.pop_transferred()
    except Exception as exc:  # noqa: BLE001 - the release's own stop, recorded by the caller
        if str(exc) != TRANSFER_FAILED_STOP:
            raise
        return str(exc)
    return None


@case(
    needs=(">=0.4.5.post1,<0.4.6.post5",),
    must_preserve=True,
    expect="A transfer's own Failed is not taken for a refusal: decode keeps the room's pages (the release "
           "stops, as it did), since later chunks of the room may still be written.",
)
def transfer_failure_not_released_as_refused(ctx) -> Outcome:
    """Up to 0.4.6.post4 decode has no failure branch: a Failed poll raised "Transfer failed". The
    pack's release there is for a room prefill reported refused, and only for it: a failed chunk's
    Failed (which 0.4.5.post1 - 0.4.6.post3's decode thread stores as it comes) must not free pages
    that the room's later chunks may still write (the page-lifetime class)."""
    from sglang.srt.disaggregation.base import KVPoll

    no_failure_branch("the page_lifetime cases judge when it releases")
    prefill = MooncakeSide(ctx, "PREFILL", [])
    decode = MooncakeSide(ctx, "DECODE", [])
    rig = decode_rig(ctx)
    req = rig.enqueue(decode_receiver(decode, FAILED_ROOM), "failed", FAILED_ROOM)
    # A failed chunk: the tree's prefill records Failed and syncs it to decode.
    decode.socket_in.put(status_frames(prefill, FAILED_ROOM, KVPoll.Failed))
    decode.run("decode_thread")
    stopped = pop(rig)
    after = rig.snapshot(req)
    obs = {"decode_status": int(decode.mgr.request_status[FAILED_ROOM]), "decode_stopped_with": stopped,
           "after_failed": after, "streams": len(rig.ledger.of("stream", rid="failed"))}
    problems = []
    if not after["pages_held"]:
        problems.append("decode released the pages of a room whose later chunks may still be written")
    if after["metadata_frees"] or obs["streams"]:
        problems.append("decode finished the request as if prefill had refused it")
    return judged(problems, "The pages stay with the room (decode stops, or waits, as the release does).",
                  obs, unsafe_prefix="A transfer failure was taken for a refusal: ")


class TwoRankAllReduce:
    """``poll_and_all_reduce`` over two decode ranks run one after the other: MIN of this rank's
    poller and the peer rank's for the same room (``peers``: id(receiver) -> the other rank's
    receiver; a poller is a receiver, or the tree's wrapper of one in ``.receiver``). A collective
    takes every rank's value before any rank acts on the result: within one poll round (``new_round``)
    each value is read once, when the first rank asks, as both ranks' calls would meet."""

    def __init__(self, peers: dict[int, Any]) -> None:
        self.peers = peers
        self.values: dict[tuple[str, int], int] = {}

    def new_round(self) -> None:
        self.values.clear()

    def _value(self, poller) -> int:
        receiver = getattr(poller, "receiver", poller)
        key = (type(poller).__name__, id(receiver))
        if key not in self.values:
            self.values[key] = int(poller.poll())
        return self.values[key]

    def __call__(self, pollers, *args, **kwargs) -> list[int]:
        out = []
        for poller in pollers:
            receiver = getattr(poller, "receiver", poller)
            peer = self.peers[id(receiver)]
            peer_poller = type(poller)(peer) if poller is not receiver else peer
            out.append(min(self._value(poller), self._value(peer_poller)))
        return out


@case(
    proves=("sbp-refused-room",),
    needs=(">=0.4.5.post1,<0.4.6.post5",),
    must_preserve=False,
    expect="With two decode ranks the refused room is released on both together, once both heard prefill's "
           "report: before that neither rank releases nor stops, and their queues stay alike.",
)
def refused_room_released_on_every_rank_together(ctx) -> Outcome:
    """Where the pack gives decode its release (0.4.5.post1 - 0.4.6.post4) the decision is agreed like
    the polls (MIN over the attention-TP group): the report reaches the two ranks one after the other,
    and between the two a rank that acted alone would leave the ranks' queues different (the next
    all-reduce would pair different requests) or stop decode on the other rank's Failed."""
    no_failure_branch("the release's own all-reduce of the polls agrees its release")
    wire = refuse_at_prefill(ctx, register_first=True)["wire"]  # what real prefill code sent
    ranks = []
    for _rank in (0, 1):
        decode = MooncakeSide(ctx, "DECODE", [])
        rig = TransferRig(ctx)
        rig.queue.metadata_buffers = FirstTokenBuffers()
        req = rig.enqueue(decode_receiver(decode, REFUSED_ROOM), "refused", REFUSED_ROOM)
        ranks.append((decode, rig, req))
    (d0, r0, _), (d1, r1, _) = ranks
    a, b = r0.queue.queue[0].kv_receiver, r1.queue.queue[0].kv_receiver
    collective = TwoRankAllReduce({id(a): b, id(b): a})
    ctx.patch(sg("disaggregation.decode"), "poll_and_all_reduce", collective)

    def step() -> list[dict[str, Any]]:
        collective.new_round()
        views = []
        for _decode, rig, req in ranks:
            stopped = pop(rig)
            views.append({"queued": len(rig.queue.queue), "stopped_with": stopped,
                          "streams": len(rig.ledger.of("stream", rid="refused")), **rig.snapshot(req)})
        return views

    for message in wire:  # the report reaches rank 0 only
        d0.socket_in.put(message["frames"])
    d0.run("decode_thread")
    one_heard = step()
    for message in wire:  # then rank 1
        d1.socket_in.put(message["frames"])
    d1.run("decode_thread")
    both_heard = step()
    obs = {"reports_from_prefill": len(wire), "one_rank_heard": one_heard, "both_heard": both_heard}
    problems = []
    if any(v["stopped_with"] for v in one_heard + both_heard):
        problems.append("a rank stopped decode on a refused room")
    if len({v["queued"] for v in one_heard}) != 1 or len({v["queued"] for v in both_heard}) != 1:
        problems.append("the ranks' queues differ after a poll")
    if any(v["pages_held"] == 0 for v in one_heard):
        problems.append("a rank released before every rank heard the report")
    if any(v["pages_held"] or v["metadata_frees"] != 1 or v["streams"] != 1 for v in both_heard):
        problems.append("the room was not released once on every rank after both heard the report")
    return judged(problems, "Released on both ranks at the same poll, once both heard the report.", obs,
                  unsafe_prefix="The ranks did not release together: ")
