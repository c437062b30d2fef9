"""Decode pages of a failed Mori transfer (this pack's sbp-mori-hold; 0.5.22's standard).

Mori's prefill sends no drain ACK before 0.5.22: when decode aborts a request whose transfer
is in flight, nothing tells decode when the RDMA writes into the request's pages have stopped.
Up to 0.5.21 the Mori decode returns those pages to the allocator at once (on 0.5.19/0.5.20
unless SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE was set; on 0.5.21, after #41023's
capability gate, always), and a late write can land on pages already given to the next request.
0.5.22 gives Mori the drain-ACK capability and holds the pages until the ACK or the
deferred-release timeout. This pack's rule for 0.5.13 - 0.5.21 (sbp-mori-hold): a Mori decode
manager holds such a transfer's pages until the timeout (no ACK can come, so always the full
timeout). On 0.5.9 - 0.5.12.post1 (Mori's first releases, no ACK for any backend) the pack's
sbp-abort-hold holds every failed transfer until each prefill rank's final Success, which Mori's
manager does not track: the same full timeout, released by the next ``pop_transferred``.

How it is driven: a real decode ``MoriKVManager`` built through its constructor and a real
``MoriKVReceiver`` on it (``probes/rigs/mori.py``; ``probes/standins/shims/mori`` stands for the RDMA
library), queued in the tree's ``DecodeTransferQueue`` (``rigs.failed_transfer.TransferRig``: its real
``pop_transferred`` and ``resolve_deferred_releases``, a counting page pool). The decode abort is
the receiver's own ``abort()``. The deferred-release timeout is set to ``TIMEOUT_S`` through its
environment variable, and the passage of that time is a clock stand-in (``DecodeClockStandIn``) in
the queue's module rather than a sleep: the "before the timeout" step cannot slip past the deadline
on a loaded machine, and a tree that reads another clock keeps the pages and is judged unsafe,
never safe.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from .. import Outcome, case, judged
from ..rigs.failed_transfer import TIMEOUT_ENV, TransferRig
from ..rigs.mori import ConstructedMoriDecodeManager

TIMEOUT_S = 0.5


class DecodeClockStandIn:
    """Stands for the ``time`` module as the decode queue's module sees it: the real clock plus
    ``advanced`` seconds (monotonic, time and perf_counter); everything else is the real module."""

    def __init__(self) -> None:
        self.advanced = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.advanced

    def time(self) -> float:
        return time.time() + self.advanced

    def perf_counter(self) -> float:
        return time.perf_counter() + self.advanced

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@contextlib.contextmanager
def _aborted_mori_transfer(ctx, room: int, deferred_env: str | None):
    """A Mori request whose transfer is in flight, aborted by decode, then polled Failed by
    ``pop_transferred``; the manager's sockets are closed after the block."""
    ctx.setenv(TIMEOUT_ENV, str(TIMEOUT_S))
    rig = TransferRig(ctx, deferred_env=deferred_env)
    built = ConstructedMoriDecodeManager(ctx, rig.ledger)
    try:
        rcv = built.receiver(room)
        # the Mori receiver's own poll decides: the room its abort marked Failed
        rig.queue._poll_with_metadata_gate = lambda: [d.kv_receiver.poll() for d in rig.queue.queue]
        req = rig.enqueue(rcv, f"mori-aborted-{room}", room)
        rcv.abort()  # decode aborts the request mid-transfer
        rig.queue.pop_transferred()
        clock = DecodeClockStandIn()
        ctx.patch(sys.modules[type(rig.queue).__module__], "time", clock)  # where the deadline is read
        yield rig, built, req, clock
    finally:
        built.close()


def _details(rig: TransferRig, built: ConstructedMoriDecodeManager) -> dict[str, Any]:
    return {
        "backend": type(built.mgr).__mro__[1].__name__,
        "backend_flag": bool(getattr(built.mgr, "enable_deferred_decode_kv_release", False)),
        "capability": getattr(type(built.mgr), "supports_deferred_decode_kv_release", None),
        "sent_to_prefill": [e["message"] for e in rig.ledger.of("sent_to_prefill")],
        "listeners_not_started": [e["thread"] for e in rig.ledger.of("listener_not_started")],
        "threads_started_by_constructor": built.threads_started,
        "double_releases": rig.ledger.count("pages_double_release"),
    }


@case(
    # below 0.5.13 the pack's sbp-abort-hold holds every failed transfer, Mori's until the timeout
    proves=("sbp-mori-hold|sbp-abort-hold",),
    needs=(">=0.5.9",),
    must_preserve=False,
    expect="With the default environment, a Mori transfer that decode aborts mid-transfer keeps its pages "
           "and "
    "metadata slot while the transfer may still write (until the drain ACK or the deferred-release "
    "timeout), then releases them exactly once.",
)
def aborted_mori_transfer_holds_pages(ctx) -> Outcome:
    with _aborted_mori_transfer(ctx, 701, deferred_env=None) as (rig, built, req, clock):
        return _judge_hold(rig, built, req, clock)


def _judge_hold(
    rig: TransferRig, built: ConstructedMoriDecodeManager, req, clock: DecodeClockStandIn
) -> Outcome:
    steps = [{"step": "pop_transferred(Failed)", **rig.snapshot(req)}]
    rig.release_due()
    steps.append({"step": "release pass, no ACK, before the timeout", **rig.snapshot(req)})
    clock.advanced = TIMEOUT_S + 0.2
    rig.release_due()
    steps.append({"step": f"release pass after the {TIMEOUT_S} s timeout", **rig.snapshot(req)})
    details = {**_details(rig, built), "timeout_s": TIMEOUT_S, "steps": steps}
    problems = []
    early = [s["step"] for s in steps[:2] if s["pages_held"] == 0]
    if early:
        problems.append(f"the pages were returned while the transfer may still write (at: {early[0]})")
    final = steps[-1]
    if not early and (final["pages_held"] or final["release_calls"] != 1 or final["metadata_frees"] != 1):
        problems.append(f"after the timeout the pages were released {final['release_calls']} time(s) and the "
                        f"metadata slot freed {final['metadata_frees']} time(s), not once each")
    if details["double_releases"]:
        problems.append("a page was released twice")
    return judged(
        problems, "Pages and metadata slot held until the timeout, then released exactly once.", details
    )


@case(
    needs=(">=0.5.9",),
    must_preserve=True,
    expect="With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0 (the off switch), a Mori transfer that "
           "decode "
    "aborts releases its pages and metadata slot at once, exactly once, and holds nothing.",
)
def mori_off_switch_releases_at_once(ctx) -> Outcome:
    with _aborted_mori_transfer(ctx, 702, deferred_env="0") as (rig, built, req, _clock):
        return _judge_off_switch(rig, built, req)


def _judge_off_switch(rig: TransferRig, built: ConstructedMoriDecodeManager, req) -> Outcome:
    after_pop = rig.snapshot(req)
    rig.resolve()
    after_resolve = rig.snapshot(req)
    details = {**_details(rig, built), "after_pop_transferred": after_pop, "after_resolve": after_resolve}
    problems = []
    if after_pop["pages_held"] or after_pop["deferred_entries"]:
        problems.append("the pages were held although deferral is switched off")
    if after_resolve["release_calls"] != 1 or after_resolve["metadata_frees"] != 1:
        problems.append(f"the pages were released {after_resolve['release_calls']} time(s), not once")
    if details["double_releases"]:
        problems.append("a page was released twice")
    return judged(problems, "Released at once, exactly once, with deferral switched off.", details)
