"""Admission doors of PD serving (#38935, incident steps 2 and 5).

``Req.set_finish_with_abort`` records an intake rejection in ``to_finish``
and swaps the prompt for a one-token stub; ``finished()`` reads only
``finished_reason``, so before #38935 every PD admission door let the rejected
request through: prefill created a KV sender and queued it for bootstrap,
decode created a KV receiver and queued it for preallocation.
#38935 retires such a request at ``PrefillBootstrapQueue.add`` and
``DecodePreallocQueue.add`` (``is_unadmitted_reject`` +
``Scheduler.retire_unadmitted_request``): no handoff object, no queue entry,
the original 400 streamed once. Requests that re-enter a door while still
owning resources (metadata buffer, retraction backup, a retraction flag) are
not retired, and the non-PD dispatcher ``_add_request_to_queue`` stays a
pure dispatcher.

How the doors are driven: the real ``add`` of each queue class is called
unbound on an instance created without its constructor (constructors drift
between releases), carrying the attributes the door reads. The door's own
helpers (``create_sender``, ``_create_receiver_and_enqueue``, the prefill
capacity check) are the tree's. Stand-ins: the transport classes returned by
``get_kv_class`` (RecordingKVSender/RecordingKVReceiver), the metadata
allocator, the output streamer, and a scheduler shell whose retire and
dispatch methods are the tree's own. The decode door's KV capacity check is
stubbed to "fits" (in the incident decode's pool was large enough; that
check's inputs drift from release to release and are not under test), and
the DSV4/DSpark rebootstrap test is stubbed to "not that model".

Not applicable: ``prefill_door_retraction_backup_not_retired`` up to 0.5.17,
whose requests cannot hold a host retraction backup (added in 0.5.18);
``decode_door_rebootstrap_not_retired`` up to 0.5.15.post1, whose decode door
has no ``is_rebootstrap`` flag (PD rebootstrap arrives in 0.5.16);
``rejected_session_request_releases_session_and_cache`` up to 0.5.10.post1,
whose streaming sessions keep no in-flight state (the real ``Session`` from
0.5.11 stands in the case, marked in flight as ``create_req`` marks it);
``finished_abort_retired_at_doors`` up to 0.4.6.post3, whose requests carry no
``finished_output`` (nothing records that a finish went out, and no path of
those releases streams a request before its door).
"""

from __future__ import annotations

import inspect
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case, judged
from probes.standins import (
    Ledger,
    aborted_prefetch_releasable,
    construct_with,
    describe_finish,
    has_method,
    has_retraction_backup_slot,
    make_req,
    mark_aborted,
    pin_runtime,
    prefill_bootstrap_queue_attr,
    reject_at_intake,
    set_retraction_backup,
    sg,
)
from probes.standins_memory import CountingTokenToKVPoolAllocator, MetadataBuffersStandIn, patch_cache_helpers
from probes.standins_scheduler import make_scheduler_shell, wrap_beam_coordinator
from probes.standins_transport import KVManagerStandIn, patch_transport

NUM_KV_HEADS = 8
PREFILL_POOL_TOKENS = 4096
REJECTION = "Input length (9000 tokens) exceeds the maximum allowed length (4096 tokens)."


# ---------------------------------------------------------------------------
# rig


def size_prefill_pool(queue, tokens: int) -> None:
    """The bootstrap queue's pool capacity, as its constructor would set it; 0.5.23's
    constructor also derives the prompt limit the door checks (`max_bootstrap_input_len`,
    the release's own rule, here for one KV shard)."""
    queue.max_total_num_tokens = tokens
    limit = getattr(sg("disaggregation.prefill"), "max_bootstrap_input_len", None)
    if limit is not None:
        page_size = getattr(getattr(queue.scheduler, "token_to_kv_pool_allocator", None), "page_size", 1)
        queue.max_input_len = limit(capacity=tokens, page_size=page_size, shard_size=1)


class DoorRig:
    """One scheduler shell with both PD doors wired to recording transports."""

    def __init__(self, ctx) -> None:
        pin_runtime(ctx)
        self.ledger = Ledger()
        patch_transport(ctx, self.ledger)
        decode_mod = sg("disaggregation.decode")
        patch_cache_helpers(ctx, self.ledger, decode_mod, None)
        for name in ("dsv41_dspark_needs_rebootstrap", "dsv4_needs_rebootstrap"):
            ctx.patch_if_present(decode_mod, name, lambda *a, **k: False)
        self.shell = make_scheduler_shell(self.ledger)
        wrap_beam_coordinator(self.shell)
        self.shell._release_aborted_request = self._release_aborted_request
        self.prefill_queue = self._prefill_queue()
        self.decode_queue = self._decode_queue()
        setattr(self.shell, prefill_bootstrap_queue_attr(), self.prefill_queue)
        self.shell.disagg_decode_prealloc_queue = self.decode_queue

    def _release_aborted_request(self, req) -> None:
        # The cache-side release #38935's review asked for; its body is the
        # tree cache's business, the probe records that it happened.
        self.ledger.record("release_aborted_request", rid=req.rid)

    @staticmethod
    def _backend():
        from sglang.srt.disaggregation.utils import TransferBackend

        return getattr(TransferBackend, "MOONCAKE", next(iter(TransferBackend)))

    def _prefill_queue(self):
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        q = object.__new__(PrefillBootstrapQueue)
        q.__dict__.update(
            scheduler=self.shell,
            queue=[],
            transfer_backend=self._backend(),
            kv_manager=KVManagerStandIn(),
            tp_rank=0,
            pp_rank=0,
            pp_size=1,
            bootstrap_port=8998,
            req_to_metadata_buffer_idx_allocator=self.shell.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=MetadataBuffersStandIn(),
        )
        size_prefill_pool(q, PREFILL_POOL_TOKENS)
        return q

    def _decode_queue(self):
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        q = object.__new__(DecodePreallocQueue)
        q.__dict__.update(
            scheduler=self.shell,
            queue=[],
            retracted_queue=[],
            pending_reqs=[],
            transfer_backend=self._backend(),
            kv_manager=KVManagerStandIn(),
            token_to_kv_pool_allocator=CountingTokenToKVPoolAllocator(self.ledger, "decode", 4096, 16),
            max_total_num_tokens=1 << 20,
            req_to_metadata_buffer_idx_allocator=self.shell.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=MetadataBuffersStandIn(),
            tree_cache=self.shell.tree_cache,
            tp_rank=0,
            # up to 0.4.5.post3 the decode door reads the queue's port, not the request's
            bootstrap_port=8998,
        )
        q._check_if_req_exceed_kv_capacity = lambda req: False
        return q

    # doors -----------------------------------------------------------------

    def prefill_door(self, req) -> None:
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

        if "num_kv_heads" in inspect.signature(PrefillBootstrapQueue.add).parameters:
            PrefillBootstrapQueue.add(self.prefill_queue, req, NUM_KV_HEADS)
        else:  # up to 0.4.7: add(self, req), no capacity check
            PrefillBootstrapQueue.add(self.prefill_queue, req)

    def decode_door(self, req, **flags) -> None:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        if (
            "is_retracted" in flags
            and "is_retracted" not in inspect.signature(DecodePreallocQueue.add).parameters
        ):
            raise NotApplicable("this release's DecodePreallocQueue.add takes no is_retracted (the retracted "
                                "re-entry door arrived in 0.4.7.post1)")
        DecodePreallocQueue.add(self.decode_queue, req, **flags)

    # observations ----------------------------------------------------------

    def observe(self, req) -> dict[str, Any]:
        led = self.ledger
        rid = req.rid
        decode_entries = [dr.req for dr in self.decode_queue.queue] + [
            dr.req for dr in self.decode_queue.pending_reqs
        ]
        streams = led.of("stream", rid=rid)
        return {
            "sender_created": led.count("sender_created", room=req.bootstrap_room) > 0,
            "receiver_created": led.count("receiver_created", room=req.bootstrap_room) > 0,
            "prefill_bootstrap_queued": any(r is req for r in self.prefill_queue.queue),
            "decode_prealloc_queued": any(r is req for r in decode_entries),
            "decode_retracted_queued": any(r is req for r in self.decode_queue.retracted_queue),
            "waiting_queued": any(r is req for r in self.shell.waiting_queue),
            "metadata_buffers_taken": led.count("metadata_alloc"),
            "streamed": [s["finish"] for s in streams],
            "finished_reason": describe_finish(req.finished_reason),
            "to_finish": describe_finish(getattr(req, "to_finish", None)),  # no such field up to 0.5.4.post1
            "release_aborted_request_calls": led.count("release_aborted_request", rid=rid),
            "beam_group_retired": led.count("beam_retire_group", rid=rid),
        }


def _retired_cleanly(obs: dict[str, Any]) -> bool:
    """#38935's retirement: no handoff object, no queue, the 400 streamed once."""
    return (
        not obs["sender_created"]
        and not obs["receiver_created"]
        and not obs["prefill_bootstrap_queued"]
        and not obs["decode_prealloc_queued"]
        and obs["metadata_buffers_taken"] == 0
        and len(obs["streamed"]) == 1
        and (obs["streamed"][0] or {}).get("status_code") == 400
        and (obs["finished_reason"] or {}).get("status_code") == 400
    )


def _handoff_summary(obs: dict[str, Any]) -> str:
    made = [k for k in ("sender_created", "receiver_created") if obs[k]]
    queued = [
        k for k in ("prefill_bootstrap_queued", "decode_prealloc_queued", "decode_retracted_queued") if obs[k]
    ]
    return (
        f"handoff objects: {', '.join(made) or 'none'}; queues: {', '.join(queued) or 'none'}; "
        f"streamed {len(obs['streamed'])} time(s)"
    )


def _finish_abort(message: str):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message)


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
    if _retired_cleanly(obs):
        return Outcome(SAFE, "Retired at the prefill door: no sender, not queued, 400 streamed once.", obs)
    return Outcome(UNSAFE, "Admitted at the prefill door; " + _handoff_summary(obs) + ".", obs)


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
    if _retired_cleanly(obs):
        return Outcome(SAFE, "Retired at the decode door: no receiver, not queued, 400 streamed once.", obs)
    return Outcome(UNSAFE, "Admitted at the decode door; " + _handoff_summary(obs) + ".", obs)


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
        if not (_retired_cleanly(obs) and obs["release_aborted_request_calls"] == releases_due)
    ]
    if not failed:
        return Outcome(
            SAFE, "Retired at both doors: no handoff object, not queued, the 400 streamed once in all.", doors
        )
    return Outcome(
        UNSAFE,
        "; ".join(
            f"{side} door: {_handoff_summary(doors[side])}, cache-side release "
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
    if not _retired_cleanly(obs):
        problems.append(_handoff_summary(obs))
    if obs["session_still_in_flight"]:
        problems.append("the streaming session is still in flight, so it refuses every later request")
    if obs["cache_releases"] != 1:
        problems.append(f"cache-side state released {obs['cache_releases']} time(s)")
    obs["violations"] = problems
    return judged(problems, (
        "Retired at the prefill door: session detached, cache-side state released once, 400 streamed "
        "once."), obs)


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
    return Outcome(UNSAFE, f"{what} was not admitted normally; " + _handoff_summary(obs) + ".", obs)


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
    return Outcome(UNSAFE, "NULL mode did not simply queue the request; " + _handoff_summary(obs) + ".", obs)
