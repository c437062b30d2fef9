"""Releases whose decode has no waiting timeout (0.4.5.post1 - 0.4.9): the prefill twin of a request
decode's door refused (this pack's ``sbp-twin-timeout``; issue 41).

When #38935's decode door refuses a request prefill admitted (a prompt that fits prefill's pool and
not decode's), no decode rank ever registers for the room. Below 0.4.8.post1 prefill's bootstrap
timeout never ran for a room still in Bootstrapping (none up to 0.4.6.post5; from 0.4.7 it counted
from ``init()``, which follows the registration), and up to 0.4.6.post4 a failed poll in the
bootstrap queue raised and stopped prefill. And where prefill does give such a room up (0.4.8.post1
on), a decode rank whose pre-allocation registers after that waits for a transfer that never comes:
these releases' decode has no waiting timeout.

Driven: the tree's real prefill ``MooncakeKVManager`` (constructor, bootstrap thread, transfer
workers; probes/rigs/refused_room.py), its real ``MooncakeKVSender`` for the twin, the real
``PrefillBootstrapQueue.pop_bootstrapped`` before and after the bootstrap timeout (1 s here), then a
decode registration for the room, as decode's pre-allocation sends it, through the real bootstrap
thread. Stand-ins: the transfer engine, the sockets (prefill's pushes to decode are recorded), the
scheduler shell that records what it streams, the TP all-reduce of the polls (one rank).
"""

from __future__ import annotations

import inspect
import time

from ... import Outcome, case, judged
from ...rigs.door import DoorRig
from ...rigs.failed_transfer import own_polls
from ...rigs.refused_room import DECODE_IP, DECODE_PORT, MooncakeSide, registration
from ...standins import make_req

ROOM = 4244
TIMEOUT_S = 1  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT is read as an integer


def _twin_sender(module, mgr):
    """The tree's own sender for the twin's room, built as the prefill door builds it."""
    params = inspect.signature(module.MooncakeKVSender.__init__).parameters
    extra = {name: value for name, value in (("dest_tp_ranks", [0]), ("pp_rank", 0)) if name in params}
    return module.MooncakeKVSender(mgr, "10.0.0.2:8998", ROOM, **extra)


@case(
    proves=("sbp-twin-timeout",),
    needs=(">=0.4.5.post1,<0.4.9.post1",),
    must_preserve=False,
    expect="A request prefill admitted while decode's door refused its twin leaves prefill's bootstrap queue "
           "at the bootstrap timeout (its client answered once with an error, prefill still serving), and "
           "a decode rank that registers for the room after that is told it is refused.",
)
def decode_refused_twin_released_at_bootstrap_timeout(ctx) -> Outcome:
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    ctx.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", str(TIMEOUT_S))
    wire: list = []
    prefill = MooncakeSide(ctx, "PREFILL", wire)
    doors = DoorRig(ctx)
    queue = doors.prefill_queue
    queue.kv_manager = prefill.mgr
    queue.gloo_group = None
    own_polls(ctx, "prefill")
    req = make_req("twin", 64, room=ROOM)
    req.disagg_kv_sender = _twin_sender(prefill.module, prefill.mgr)
    queue.queue.append(req)  # admitted at prefill's door; decode's door refused its twin

    def pop(step: str, *, may_fail: bool) -> dict:
        raised = None
        try:
            PrefillBootstrapQueue.pop_bootstrapped(queue)
        except Exception as exc:  # a failed poll stops prefill on the pristine 0.4.5.x - 0.4.6.post4
            if not may_fail:
                raise
            raised = f"{type(exc).__name__}: {exc}"
        streams = doors.ledger.of("stream", rid=req.rid)
        return {"step": step, "queued": any(r is req for r in queue.queue), "raised": raised,
                "streamed": [s["finish"] for s in streams]}

    steps = [pop("before the timeout", may_fail=False)]
    time.sleep(TIMEOUT_S + 0.2)
    steps.append(pop("after the timeout", may_fail=True))
    # decode's pre-allocation registers for the room late, through the real bootstrap thread
    prefill.socket_in.put(registration(ROOM))
    prefill.run("bootstrap_thread")
    prefill.run("transfer_thread")
    told = [m for m in wire if m["endpoint"] == f"tcp://{DECODE_IP}:{DECODE_PORT}"
            and m["frames"][0].decode() == str(ROOM)]
    details = {"timeout_seconds": TIMEOUT_S, "steps": steps,
               "late_registration_told": [m["frames"][1].decode() for m in told],
               "metadata_buffers_taken": doors.ledger.count("metadata_alloc")}
    before, after = steps
    problems = []
    if not before["queued"] or before["streamed"]:
        problems.append("the twin left the bootstrap queue before the timeout")
    if after["raised"]:
        problems.append(f"the failed poll stopped prefill ({after['raised']})")
    elif after["queued"]:
        problems.append("the twin is still in prefill's bootstrap queue after the bootstrap timeout")
    elif len(after["streamed"]) != 1 or not (after["streamed"][0] or {}).get("status_code"):
        problems.append(f"the twin's client was answered {len(after['streamed'])} time(s), "
                        "expected one error")
    refused = str(getattr(prefill.module, "ROOM_REFUSED", "-1"))
    if details["late_registration_told"] != [refused]:
        problems.append("a decode rank registering after prefill gave the room up is told "
                        f"{details['late_registration_told'] or 'nothing'}: it would wait for a transfer "
                        "that never comes (no decode waiting timeout here)")
    if details["metadata_buffers_taken"]:
        problems.append(f"{details['metadata_buffers_taken']} metadata buffer(s) taken for the twin")
    return judged(problems, "Released at the bootstrap timeout with one error answer; a late decode "
                            "registration is told the room is refused.",
                  details, unsafe_prefix="Prefill's twin of a decode-refused request: ")
