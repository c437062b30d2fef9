"""Must-preserve requests at the PD doors: valid and re-entering requests are admitted, not
retired, and non-PD dispatch is untouched. The probe: probes/cases/admission/."""

from __future__ import annotations

from typing import Any

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case
from ...rigs.door import REJECTION, DoorRig, handoff_summary
from ...standins import (
    has_retraction_backup_slot,
    make_req,
    mark_aborted,
    reject_at_intake,
    set_retraction_backup,
)


def _finish_abort(message: str):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message)



# ---------------------------------------------------------------------------
# must-preserve: valid and re-entering requests


def _admitted(obs: dict[str, Any], *, side: str) -> bool:
    if side == "prefill":
        ok = obs["sender_created"] and obs["prefill_bootstrap_queued"]
    elif side == "decode":
        ok = obs["receiver_created"] and obs["decode_prealloc_queued"]
    else:  # decode retracted queue
        ok = obs["decode_retracted_queued"]
    return bool(ok) and not obs["streamed"]


def _not_retired_outcome(obs: dict[str, Any], side: str, what: str) -> Outcome:
    if _admitted(obs, side=side):
        return Outcome(
            SAFE, f"{what} was admitted normally at the {side.split('_')[0]} door; nothing streamed.", obs
        )
    return Outcome(UNSAFE, f"{what} was not admitted normally; " + handoff_summary(obs) + ".", obs)


@case(
    must_preserve=True,
    expect='A valid request gets a KV sender and a bootstrap queue entry at the prefill door.',
)
def prefill_door_valid_admitted(ctx) -> Outcome:
    """A valid request still gets its sender and a bootstrap queue entry."""
    rig = DoorRig(ctx)
    req = make_req("valid-p", 64, room=201)
    rig.prefill_door(req)
    return _not_retired_outcome(rig.observe(req), "prefill", "A valid request")


@case(
    must_preserve=True,
    expect='A valid request gets a KV receiver and a prealloc queue entry at the decode door.',
)
def decode_door_valid_admitted(ctx) -> Outcome:
    """A valid request still gets its receiver and a prealloc queue entry."""
    rig = DoorRig(ctx)
    req = make_req("valid-d", 64, room=202)
    rig.decode_door(req)
    return _not_retired_outcome(rig.observe(req), "decode", "A valid request")


@case(
    must_preserve=True,
    expect='A re-entering request with a pending abort that owns a metadata buffer is admitted, not retired.',
)
def prefill_door_metadata_owner_not_retired(ctx) -> Outcome:
    """A re-entering request with a pending abort (abort method 3) that still
    owns a metadata buffer is not retired: its queue owes that release."""
    rig = DoorRig(ctx)
    req = make_req("reenter-mb", 64, room=203)
    req.metadata_buffer_index = rig.shell.req_to_metadata_buffer_idx_allocator.alloc()
    mark_aborted(req, _finish_abort("Abort in running batch."))  # finished_reason before 0.5.4.post2
    mark = rig.ledger.mark()
    rig.prefill_door(req)
    obs = rig.observe(req)
    obs["metadata_buffers_taken"] = rig.ledger.since(mark).count("metadata_alloc")
    return _not_retired_outcome(obs, "prefill", "A request owning a metadata buffer")


@case(
    needs=(">=0.5.18",),
    must_preserve=True,
    expect='A re-entering request with a pending abort that holds a retraction backup is admitted, not '
           'retired.',
)
def prefill_door_retraction_backup_not_retired(ctx) -> Outcome:
    """A re-entering request with a pending abort that holds a host
    retraction backup is not retired (only its queue frees the backup)."""
    rig = DoorRig(ctx)
    req = make_req("reenter-backup", 64, room=204)
    if not has_retraction_backup_slot(req):
        raise NotApplicable("requests of this release cannot hold a host retraction backup (added in 0.5.18)")
    set_retraction_backup(req, object())
    mark_aborted(req, _finish_abort("Abort in running batch."))  # finished_reason before 0.5.4.post2
    rig.prefill_door(req)
    obs = rig.observe(req)
    set_retraction_backup(req, None)
    return _not_retired_outcome(obs, "prefill", "A request holding a retraction backup")


@case(
    must_preserve=True,
    expect='A preempted re-entry (is_retracted, no resources) carrying to_finish is admitted at the prefill '
           'door, not retired.',
)
def prefill_door_preempted_reentry_not_retired(ctx) -> Outcome:
    """A preempted request (``is_retracted``, seqlen <= 1, no backup) that
    carries ``to_finish`` and re-enters through the bare dispatcher is not
    retired at the prefill door."""
    rig = DoorRig(ctx)
    req = make_req("preempted-p", 1, room=205)
    req.is_retracted = True
    mark_aborted(req, _finish_abort("Abort in running batch."))  # finished_reason before 0.5.4.post2
    rig.prefill_door(req)
    return _not_retired_outcome(rig.observe(req), "prefill", "A preempted re-entry")


@case(
    needs=(">=0.4.7.post1",),
    must_preserve=True,
    expect='A retracted request with a pending abort enters the decode retracted queue, not retirement.',
)
def decode_door_retracted_not_retired(ctx) -> Outcome:
    """``DecodePreallocQueue.add(req, is_retracted=True)`` with a pending
    abort puts the request in the retracted queue, which owns its host
    backup; the door does not retire it."""
    rig = DoorRig(ctx)
    req = make_req("retracted-d", 64, room=206)
    req.is_retracted = True
    mark_aborted(req, _finish_abort("Abort in running batch."))  # finished_reason before 0.5.4.post2
    rig.decode_door(req, is_retracted=True)
    return _not_retired_outcome(rig.observe(req), "decode_retracted", "A retracted request")


@case(
    needs=(">=0.5.16",),
    must_preserve=True,
    expect='A rebootstrapping request with a pending abort gets its receiver and prealloc entry, not '
           'retirement.',
)
def decode_door_rebootstrap_not_retired(ctx) -> Outcome:
    """A PD rebootstrap (``is_rebootstrap=True``) carrying ``to_finish`` goes
    through the normal receiver path, not retirement."""
    import inspect

    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    if "is_rebootstrap" not in inspect.signature(DecodePreallocQueue.add).parameters:
        raise NotApplicable(
            "DecodePreallocQueue.add has no is_rebootstrap flag: no PD rebootstrap in this release"
        )
    rig = DoorRig(ctx)
    req = make_req("rebootstrap-d", 64, room=207)
    mark_aborted(req, _finish_abort("Abort in running batch."))  # finished_reason before 0.5.4.post2
    rig.decode_door(req, is_rebootstrap=True)
    return _not_retired_outcome(rig.observe(req), "decode", "A rebootstrapping request")


@case(
    must_preserve=True,
    expect='A preempted re-entry (req.is_retracted) carrying to_finish is admitted at the decode door, not '
           'retired.',
)
def decode_door_preempted_reentry_not_retired(ctx) -> Outcome:
    """A preempted request (``req.is_retracted`` set, no door flag) carrying
    ``to_finish`` is not retired at the decode door."""
    rig = DoorRig(ctx)
    req = make_req("preempted-d", 1, room=208)
    req.is_retracted = True
    mark_aborted(req, _finish_abort("Abort in running batch."))  # finished_reason before 0.5.4.post2
    rig.decode_door(req)
    return _not_retired_outcome(rig.observe(req), "decode", "A preempted re-entry")


@case(
    must_preserve=True,
    expect='In non-PD mode _add_request_to_queue only dispatches: the rejected request reaches the waiting '
           'queue and is not retired there.',
)
def null_mode_dispatch_untouched(ctx) -> Outcome:
    """Non-PD mode: ``Scheduler._add_request_to_queue`` stays a pure
    dispatcher; a request carrying an intake rejection goes to the waiting
    queue (the normal scheduling path finishes it) and is not retired there."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    rig = DoorRig(ctx)
    rig.shell.disaggregation_mode = DisaggregationMode.NULL
    req = make_req("null-mode", 9000, room=209)
    reject_at_intake(req, REJECTION)
    type(rig.shell)._add_request_to_queue(rig.shell, req)
    obs = rig.observe(req)
    if obs["waiting_queued"] and not obs["streamed"] and obs["release_aborted_request_calls"] == 0:
        return Outcome(SAFE, "NULL mode queued the request for normal scheduling; nothing retired.", obs)
    return Outcome(UNSAFE, "NULL mode did not simply queue the request; " + handoff_summary(obs) + ".", obs)
