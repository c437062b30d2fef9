"""Aborted final results: retired once, a delayed result ignored, a raising sender.abort() skips no cleanup.
The probe: probes/cases/prefill_retire/."""

from __future__ import annotations

from ... import NotApplicable, Outcome, case, judged
from ...rigs.retire import RetireRig, handed_on, retire_verdict, retired_once
from ...standins import (
    aborted_prefetch_releasable,
    describe_finish,
    has_method,
    mark_aborted,
    reject_at_intake,
)


@case(
    proves=("pr36988",),
    must_preserve=False,
    expect="An aborted request's final prefill result is retired: not cached, no KV chunk sent, sender "
           "aborted, metadata buffer freed, its HiCache storage state released once, release_kv_cache "
           "without insert once, abort streamed once.",
)
def final_aborted_result_retired(ctx) -> Outcome:
    """#36988 final result: an aborted request (here the incident's intake
    rejection, ``set_finish_with_abort``) whose final prefill result arrives is
    not cached or sent; sender aborted, metadata freed, KV released once with
    no insert, abort streamed once."""
    rig = RetireRig(ctx)
    # HiCache storage on: the request's storage-side state (a prefetch started for it) is the cache's
    # until told the request is gone (`release_aborted_request`; `finish(..., ABORT)` from 0.5.20).
    rig.shell.enable_hicache_storage = True
    req = rig.prefilled_req("aborted-final", 64, room=301)
    if has_method("managers.scheduler.Scheduler", "clear_pending_chunk_send"):
        # Releases that track sent-but-unconcluded chunks (0.5.18+) must drop it.
        rig.shell.disagg_prefill_pending_chunk_rids.add(req.rid)
    reject_at_intake(req, "Input length exceeds the maximum allowed length.")
    rig.deliver_result([req])
    obs = rig.observe(req)
    obs["hicache_storage_releases"] = rig.ledger.count(
        "tree_release_aborted", rid=req.rid
    ) + rig.ledger.count("tree_finish", outcome="ABORT")
    problems = retired_once(obs)
    if not obs["sender_aborted"] and hasattr(rig.sender_cls, "abort"):  # no sender abort() before 0.4.9.post5
        problems.append("sender not aborted")
    # Where the tree cannot drop an aborted prefetch (0.4.9.post3 - 0.5.1.post3) there is nothing to release.
    releases_due = 1 if aborted_prefetch_releasable() else 0
    obs["hicache_storage_releases_due"] = releases_due
    if obs["hicache_storage_releases"] != releases_due:
        problems.append(
            f"HiCache storage state released {obs['hicache_storage_releases']} time(s), not {releases_due}"
        )
    return retire_verdict(
        problems,
        "Retired once: no cache, no send, metadata freed, HiCache storage state released, KV released "
        "without insert, abort streamed once.",
        obs,
    )


@case(
    proves=("pr36988",), needs=(">=0.5.13",),
    must_preserve=False,
    expect='A result arriving after the request was retired by bootstrap-failure cleanup has no effect.',
)
def delayed_result_after_retirement_ignored(ctx) -> Outcome:
    """#36988 delayed result: after the request was retired by bootstrap-failure
    cleanup (``handle_bootstrap_failure``), a late result for it sends nothing,
    caches nothing, releases nothing twice and streams nothing again."""
    if not has_method("managers.scheduler.Scheduler", "handle_bootstrap_failure"):
        raise NotApplicable(
            "no handle_bootstrap_failure (no optimistic prefill, before 0.5.13): bootstrap failure is "
            "handled in pop_bootstrapped before the request reaches a forward, so no result can follow it"
        )
    rig = RetireRig(ctx)
    req = rig.prefilled_req("delayed", 64, room=302)
    type(rig.shell).handle_bootstrap_failure(rig.shell, req)
    mark = rig.ledger.mark()
    rig.deliver_result([req])
    obs = rig.observe(req, since=mark)
    obs["retired_by_bootstrap_failure"] = describe_finish(req.finished_reason)
    problems = handed_on(obs)
    if obs["release_kv_cache_calls"] or obs["metadata_frees"] or obs["metadata_double_frees"]:
        problems.append("resources released again")
    if obs["streamed"]:
        problems.append("streamed again")
    if obs["output_ids"]:
        problems.append("sampled token appended")
    obs["violations"] = problems
    return judged(problems, "The delayed result had no effect on the retired request.",
                  obs, unsafe_prefix="The delayed result acted on a retired request: ")


@case(
    proves=("pr36988",), needs=(">=0.4.9.post5",),
    must_preserve=False,
    expect="When the sender's abort() raises, the request is still retired once with all local cleanup.",
)
def sender_abort_failure_does_not_skip_cleanup(ctx) -> Outcome:
    """#36988: ``disagg_kv_sender.abort()`` is best effort; when it raises, the
    metadata buffer, the KV and the terminal stream are still handled."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rig = RetireRig(ctx, abort_raises=True)
    if not hasattr(rig.sender_cls, "abort"):
        raise NotApplicable(
            "no KV sender of this release has abort() (MooncakeKVSender.abort from 0.4.9.post5)"
        )
    req = rig.prefilled_req("abort-raises", 64, room=303)
    mark_aborted(req, FINISH_ABORT("Multimodal encoder failed."))
    rig.deliver_result([req])
    obs = rig.observe(req)
    problems = retired_once(obs)
    if not obs["sender_aborted"]:
        problems.append("sender abort never attempted")
    return retire_verdict(problems, "The raising sender.abort() did not skip cleanup: retired once.", obs)

