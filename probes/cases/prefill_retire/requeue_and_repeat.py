"""A pending-bootstrap middle chunk is requeued; a second retirement is inert.
The probe: probes/cases/prefill_retire/."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case, judged, tree_version
from ...rigs.retire import RetireRig
from ...standins import (
    has_method,
    reject_at_intake,
    sg,
)


@case(
    needs=(">=0.5.13",),
    must_preserve=True,
    expect="A valid request whose optimistic bootstrap is still pending, whose middle-chunk result comes "
           "back with no later chunk launched, is released and requeued for a retry: no KV chunk sent, "
           "nothing retired or streamed.",
)
def pending_bootstrap_middle_chunk_requeued(ctx) -> Outcome:
    """Must-preserve (optimistic prefill, 0.5.13+): #36988 moves the abort check ahead of the optimistic
    retry on the middle-chunk path; a request that is not aborted still takes the retry
    (``optimistic_release_and_requeue``)."""
    if not has_method("managers.scheduler.Scheduler", "optimistic_release_and_requeue"):
        raise NotApplicable(
            "no optimistic prefill in this release (before 0.5.13): no bootstrap can be pending"
        )

    rig = RetireRig(ctx)
    rig.shell.disagg_prefill_bootstrap_queue = SimpleNamespace(queue=[])  # where an exhausted retry goes
    rig.shell.server_args.optimistic_prefill_retries = 0  # 0.5.13 - 0.5.15.post1 read the limit here
    req = rig.prefilled_req("pending-bootstrap", 64, room=308)
    req.pending_bootstrap = True  # bootstrap with decode not finished yet
    setattr(req, "inflight_middle_chunks" if hasattr(req, "inflight_middle_chunks") else "is_chunked", 1)
    rig.shell.chunked_req = None  # the retry starts over, so no later chunk was launched
    rig.deliver_result([req])
    obs = rig.observe(req)
    obs["requeued"] = any(r is req for r in rig.shell.waiting_queue) or any(
        r is req for r in rig.shell.disagg_prefill_bootstrap_queue.queue
    )
    obs["pending_bootstrap"] = bool(req.pending_bootstrap)
    ok = (
        obs["requeued"]
        and obs["pending_bootstrap"]
        and not obs["send_kv_chunk_calls"]
        and not obs["streamed"]
        and not obs["sender_aborted"]
        and obs["finished_reason"] is None
    )
    if ok:
        return Outcome(
            SAFE,
            "The pending-bootstrap request was released and requeued for its retry; nothing retired.",
            obs,
        )
    return Outcome(UNSAFE, "The pending-bootstrap middle result did not take the optimistic retry.", obs)


@case(
    proves=("pr36988",),
    needs=(">=0.5.4,<0.5.9",),
    must_preserve=False,
    expect="Where the release's own KV release leaves req.req_pool_idx set (0.5.4 - 0.5.8.post1), retiring "
           "the same "
    "aborted request twice releases it once: the second call finds nothing owned, returns False and "
    "releases, frees and raises nothing.",
)
def second_retirement_is_inert(ctx) -> Outcome:
    """The retirement helper's "already retired" test, called twice on the real module. These
    releases' own release (``cache_finished_req``; ``release_kv_cache`` from 0.5.5.post1) frees the
    request's row and pages but leaves ``req.req_pool_idx`` set (0.5.9 clears it in the pool), so the
    stand-ins here release pages without touching the request's indices, as the real code does."""
    from packaging.specifiers import SpecifierSet


    if tree_version() not in SpecifierSet(">=0.5.4,<0.5.9"):
        raise NotApplicable("the release's own KV release clears req_pool_idx (0.5.3.post3 and older in "
                            "Req, 0.5.9 and later in the pool): the helper's test reads it sound")
    prefill = sg("disaggregation.prefill")
    retire = getattr(prefill.SchedulerDisaggregationPrefillMixin, "_retire_aborted_prefill_result", None)
    if retire is None:
        return judged(["no _retire_aborted_prefill_result (#36988 absent): nothing retires the request"],
                      "", {"helper": False})
    rig = RetireRig(ctx)
    ledger, pages = rig.ledger, rig.pages

    def release_keeping_indices(req, tree_cache, *args, **kwargs):
        insert = kwargs.get("is_insert", args[0] if args else True)
        ledger.record("release_kv_cache", rid=req.rid, insert=bool(insert), pages=pages.release(req.rid))

    class TreeKeepingIndices(type(rig.shell.tree_cache)):
        def cache_finished_req(self, req, is_insert=True, *args, **kwargs):
            release_keeping_indices(req, self, is_insert=is_insert)

    ctx.patch_if_present(prefill, "release_kv_cache", release_keeping_indices)
    rig.shell.tree_cache = TreeKeepingIndices(ledger)
    req = rig.prefilled_req("retired-twice", 64, room=311)
    reject_at_intake(req, "Input length exceeds the maximum allowed length.")
    first = retire(rig.shell, req)
    try:
        second, raised = retire(rig.shell, req), None
    except Exception as exc:  # noqa: BLE001 - the latent bug is an exception from the second release
        second, raised = None, f"{type(exc).__name__}: {exc}"
    obs: dict[str, Any] = {
        "first_call": first,
        "second_call": second,
        "second_call_raised": raised,
        "release_kv_cache_calls": ledger.count("release_kv_cache", rid=req.rid),
        "pages_double_released": ledger.count("pages_double_release"),
        "metadata_frees": ledger.count("metadata_free"),
        "metadata_double_frees": ledger.count("metadata_double_free"),
    }
    problems = []
    if first is not True:
        problems.append("the first call did not retire the request")
    if raised:
        problems.append(f"the second call raised {raised}")
    elif second is not False:
        problems.append("the second call retired the request again")
    if obs["release_kv_cache_calls"] != 1 or obs["pages_double_released"]:
        problems.append(f"KV released {obs['release_kv_cache_calls']} time(s), not once")
    if obs["metadata_frees"] != 1 or obs["metadata_double_frees"]:
        problems.append("metadata buffer not freed exactly once")
    return judged(problems, "Retired once; the second call found nothing owned and did nothing.", obs)
