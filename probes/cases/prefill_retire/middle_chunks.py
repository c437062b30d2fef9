"""Aborted requests with middle chunks in flight: retirement waits for the last in-flight result.
The probe: probes/cases/prefill_retire/."""

from __future__ import annotations

from ... import Outcome, case, judged
from ...rigs.retire import RetireRig, retire_verdict, retired_once
from ...standins import (
    mark_aborted,
)


@case(
    proves=("pr36988",),
    must_preserve=False,
    expect='An aborted middle-chunk result waits for the in-flight later chunk; the final result retires '
           'once.',
)
def middle_chunk_inflight_delays_retirement(ctx) -> Outcome:
    """#36988 chunked prefill: while a later overlapped chunk is still running,
    an aborted middle-chunk result does not retire the request; the final
    chunk's result then retires it exactly once."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rig = RetireRig(ctx)
    req = rig.prefilled_req("aborted-chunked", 64, room=304)
    # The in-flight chunk counter: is_chunked up to 0.5.12.post1.
    setattr(req, "inflight_middle_chunks" if hasattr(req, "inflight_middle_chunks") else "is_chunked", 1)
    rig.shell.chunked_req = req  # its next chunk is already launched
    mark_aborted(req, FINISH_ABORT("Embedding validation failed."))
    rig.deliver_result([req])
    middle = rig.observe(req)
    early = (
        middle["release_kv_cache_calls"]
        or middle["metadata_frees"]
        or middle["streamed"]
        or middle["send_kv_chunk_calls"]
    )
    rig.shell.chunked_req = None
    mark = rig.ledger.mark()
    rig.deliver_result([req])
    final = rig.observe(req, since=mark)
    problems = retired_once(final)
    if early:
        problems.insert(0, "retired or sent while a later chunk was in flight")
    details = {"middle_result": middle, "final_result": final}
    details["violations"] = problems
    return judged(problems, "The middle result waited; the final result retired the request once.",
                  details, unsafe_prefix="Chunked abort mishandled: ")


@case(
    proves=("pr36988",),
    must_preserve=False,
    expect="An aborted request's middle-chunk result, with no later chunk of it launched, retires the "
           "request once: no KV chunk sent, not requeued, metadata buffer freed, KV released without insert "
           "once, abort streamed once.",
)
def aborted_middle_chunk_without_later_chunk_retired(ctx) -> Outcome:
    """#36988 chunked prefill: the request was aborted while a middle chunk ran and no later chunk of it
    was launched (it is no longer the scheduler's ``chunked_req``), so this middle result is its last
    in-flight result: it retires the request, or nothing ever releases its pages and metadata buffer."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rig = RetireRig(ctx)
    req = rig.prefilled_req("aborted-last-middle", 64, room=307)
    # The in-flight chunk counter: is_chunked up to 0.5.12.post1.
    setattr(req, "inflight_middle_chunks" if hasattr(req, "inflight_middle_chunks") else "is_chunked", 1)
    rig.shell.chunked_req = None  # no later chunk was launched
    mark_aborted(req, FINISH_ABORT("Client disconnected."))
    rig.deliver_result([req])
    obs = rig.observe(req)
    obs["requeued"] = any(r is req for r in rig.shell.waiting_queue)
    problems = retired_once(obs)
    if obs["requeued"]:
        problems.append("requeued as an optimistic retry")
    return retire_verdict(problems, "The last in-flight middle result retired the request once.", obs)

