"""Releases whose decode has no waiting timeout (0.4.5.post1 - 0.4.9): sbp-refused-room's report,
prefill side and decode side (the package docstring tells the story; the sides:
probes/rigs/refused_room.py)."""

from __future__ import annotations

from ... import Outcome, case, judged
from ...rigs.refused_room import (
    DECODE_IP,
    DECODE_PORT,
    REFUSED_ROOM,
    VALID_ROOM,
    MooncakeSide,
    decode_receiver,
    decode_rig,
    refuse_at_prefill,
    status_frames,
)


@case(
    proves=("sbp-refused-room",),
    needs=(">=0.4.5.post1,<0.4.9.post1",),
    must_preserve=False,
    expect="A request prefill's door refuses is reported to every decode rank registered for its room, "
           "whether "
    "decode registered before or after the refusal; prefill keeps nothing for the room.",
)
def prefill_reports_refused_room(ctx) -> Outcome:
    runs = [refuse_at_prefill(ctx, register_first=first) for first in (True, False)]
    problems = []
    for run in runs:
        run.pop("wire")
        run.pop("prefill")
        told = [r for r in run["reports"] if r["room"] == str(REFUSED_ROOM)
                and r["endpoint"] == f"tcp://{DECODE_IP}:{DECODE_PORT}"]
        if run["sender_created"]:
            problems.append(f"{run['order']}: the refused request got a KV sender")
        if len(told) != 1:
            problems.append(f"{run['order']}: decode was told {len(told)} time(s) (expected once)")
        if run["prefill_keeps_registration"]:
            problems.append(f"{run['order']}: prefill still keeps decode's registration for the room")
    return judged(problems, "Both orders: decode told once, prefill keeps nothing for the room.",
                  {"runs": runs}, unsafe_prefix="Decode is left waiting: ")


@case(
    proves=("sbp-refused-room",),
    needs=(">=0.4.5.post1,<0.4.9.post1",),
    must_preserve=False,
    expect="Decode's reservation for a room prefill refused is released on prefill's report (pages and "
           "metadata "
    "slot returned, the request aborted once), and the next valid request is still served.",
)
def decode_releases_refused_room(ctx) -> Outcome:
    from sglang.srt.disaggregation.base import KVPoll

    refused_at = refuse_at_prefill(ctx, register_first=True)
    wire = refused_at["wire"]  # what real prefill code sent
    decode = MooncakeSide(ctx, "DECODE", [])
    rig = decode_rig(ctx)
    baseline = rig.pages.available_size()

    def receiver(room: int):
        return decode_receiver(decode, room)

    refused = rig.enqueue(receiver(REFUSED_ROOM), "refused", REFUSED_ROOM)
    refused.return_logprob = True  # its abort answers with the (empty) logprob lists a client asked for
    rig.queue.pop_transferred()
    held_before_report = rig.pages.held_by("refused")
    for message in wire:
        decode.socket_in.put(message["frames"])
    decode.run("decode_thread")
    rig.queue.pop_transferred()
    after = rig.snapshot(refused)
    streamed = rig.ledger.of("stream", rid="refused")
    free_vs_baseline = rig.pages.available_size() - baseline
    # The next valid request: prefill's Success for its room (as the tree's prefill sends it),
    # through the same thread.
    valid = rig.enqueue(receiver(VALID_ROOM), "valid", VALID_ROOM)
    decode.socket_in.put(status_frames(refused_at["prefill"], VALID_ROOM, KVPoll.Success))
    decode.run("decode_thread")
    served = rig.queue.pop_transferred()
    obs = {
        "reports_from_prefill": len(wire),
        "pages_held_before_report": held_before_report,
        "refused_after_report": after,
        "refused_streams": len(streamed),
        "pages_free_vs_baseline_after_report": free_vs_baseline,
        # the request itself, or up to 0.4.6.post4 its DecodeRequest
        "valid_served": any(r is valid or getattr(r, "req", None) is valid for r in served),
    }
    problems = []
    if after["pages_held"] or free_vs_baseline:
        problems.append(f"decode still holds {after['pages_held']} page(s) of the refused request")
    if after["metadata_frees"] != 1:
        problems.append(f"its metadata slot freed {after['metadata_frees']} time(s)")
    if len(streamed) != 1:
        problems.append(f"the refused request was finished to its client {len(streamed)} time(s)")
    if not obs["valid_served"]:
        problems.append("the next valid request was not served")
    return judged(problems, "Released on prefill's report; the next valid request served.", obs,
                  unsafe_prefix="Decode's reservation is held: ")
