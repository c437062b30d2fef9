"""Retiring aborted disaggregated prefill results (#36988, incident steps 3-4).

Before #36988, ``process_batch_result_disagg_prefill`` dropped aborted middle
chunks but did not check the final result of an aborted request: it appended
the sampled token, cached the prefix as unfinished
(``maybe_cache_unfinished_req``), queued the request for transfer and sent the
last KV chunk. After #36988 an aborted request is retired once its last
in-flight result is safe to consume (``_retire_aborted_prefill_result``): the
sender is aborted (an exception there must not skip local cleanup), the
metadata buffer is freed, ``release_kv_cache(..., is_insert=False)`` runs once
(``checkpoint=False`` from 0.5.22), and the abort is streamed once; a delayed
result for a request already retired elsewhere is ignored.

How it is driven: the tree's real ``process_batch_result_disagg_prefill``
(and, through it, ``_retire_aborted_prefill_result`` where present, and
``handle_bootstrap_failure``) runs on a scheduler shell, with a real
``GenerationBatchResult`` and real ``Req`` objects. Stand-ins: the KV sender
(RecordingKVSender), the metadata allocator, the page pool
(CountingTokenToKVPoolAllocator, fed back by the ``release_kv_cache`` recorder), the
radix cache (RecordingRadixCache plus recorders for the module's
``maybe_cache_unfinished_req``/``checkpoint_kv_cache``), ``send_kv_chunk``
(which would gather GPU page indices), the output streamer, and a grammar
object that rejects the sampled token. ``grammar_rejected_result_sends_no_kv``
is not applicable where the final-result path never asks a grammar;
``pending_bootstrap_middle_chunk_requeued`` before 0.5.13 (no optimistic
prefill); ``sender_abort_failure_does_not_skip_cleanup`` before 0.4.9.post5,
where no KV sender has ``abort()`` (nor has the stand-in there).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case, judged, tree_version
from probes.standins import (
    Ledger,
    aborted_prefetch_releasable,
    describe_finish,
    give_kv_row,
    has_method,
    make_req,
    mark_aborted,
    pin_runtime,
    prefill_bootstrap_queue_attr,
    reject_at_intake,
    sg,
)
from probes.standins_memory import CountingTokenToKVPoolAllocator, patch_cache_helpers
from probes.standins_scheduler import deliver_prefill_result, make_scheduler_shell
from probes.standins_transport import recording_sender_class

PAGE_SIZE = 16
SAMPLED_TOKEN = 7


class RetireRig:
    """A prefill scheduler shell that receives forward results."""

    def __init__(self, ctx, *, abort_raises: bool = False) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        pin_runtime(ctx)
        self.ledger = Ledger()
        self.pages = CountingTokenToKVPoolAllocator(self.ledger, "prefill", 256, PAGE_SIZE)
        patch_cache_helpers(ctx, self.ledger, sg("disaggregation.prefill"), self.pages)
        self.sender_cls = recording_sender_class(self.ledger, abort_raises=abort_raises)
        self.shell = make_scheduler_shell(
            self.ledger,
            token_to_kv_pool_allocator=self.pages,
            disaggregation_mode=DisaggregationMode.PREFILL,
        )
        # Up to 0.4.7 the scheduler keeps no metadata allocator of its own: the bootstrap queue's is the
        # one its inflight queue frees through (the queue under the release's own name).
        queue = SimpleNamespace(
            req_to_metadata_buffer_idx_allocator=self.shell.req_to_metadata_buffer_idx_allocator
        )
        setattr(self.shell, prefill_bootstrap_queue_attr(), queue)
        self._next_row = 0

    def prefilled_req(self, rid: str, num_tokens: int, room: int):
        """A request that went through bootstrap and a forward: it owns a
        sender, a metadata buffer and a KV row with its prompt's pages."""
        req = make_req(rid, num_tokens, room=room)
        if getattr(req, "fill_ids", []) is None:  # a new Req's is None up to 0.4.7.post1, [] after
            req.fill_ids = []
        req.disagg_kv_sender = self.sender_cls(bootstrap_room=room)
        req.metadata_buffer_index = self.shell.req_to_metadata_buffer_idx_allocator.alloc()
        req.pending_bootstrap = False
        req.start_send_idx = 0
        self.pages.reserve(rid, num_tokens)
        give_kv_row(req, self._next_row, num_tokens)
        self._next_row += 1
        return req

    def deliver_result(self, reqs: list[Any]) -> None:
        deliver_prefill_result(self.shell, reqs, SAMPLED_TOKEN)

    def observe(self, req, since: int = 0) -> dict[str, Any]:
        led = self.ledger.since(since)
        rid = req.rid
        releases = led.of("release_kv_cache", rid=rid)
        return {
            "cache_unfinished_calls": led.count("cache_unfinished", rid=rid),
            "send_kv_chunk_calls": led.count("send_kv_chunk", rid=rid),
            "last_chunk_sent": led.count("send_kv_chunk", rid=rid, last_chunk=True) > 0,
            "queued_for_transfer": any(r is req for r in self.shell.disagg_prefill_inflight_queue),
            "sender_aborted": led.count("sender_abort", room=req.bootstrap_room),
            "metadata_frees": led.count("metadata_free"),
            "metadata_double_frees": led.count("metadata_double_free"),
            "metadata_buffer_index": req.metadata_buffer_index,
            "release_kv_cache_calls": len(releases),
            "release_inserted_prefix": [r["insert"] for r in releases],
            "pages_returned": sum(r["pages"] for r in releases),
            "pages_still_held": self.pages.held_by(rid),
            "streamed": [s["finish"] for s in led.of("stream", rid=rid)],
            "output_ids": list(req.output_ids),
            "finished_reason": describe_finish(req.finished_reason),
            "pending_chunk_rid_left": rid in self.shell.disagg_prefill_pending_chunk_rids,
        }


def _handed_on(obs: dict[str, Any]) -> list[str]:
    """How an aborted result was still handed on: cached, sent, or queued for transfer."""
    problems = []
    if obs["cache_unfinished_calls"]:
        problems.append("prefix cached as unfinished")
    if obs["send_kv_chunk_calls"]:
        problems.append("KV chunk sent")
    if obs["queued_for_transfer"]:
        problems.append("queued for transfer")
    return problems


def _retired_once(obs: dict[str, Any]) -> list[str]:
    """What #36988's retirement requires of an aborted final result; returns
    the violated items (empty when safe)."""
    problems = _handed_on(obs)
    if obs["metadata_frees"] != 1 or obs["metadata_buffer_index"] != -1:
        problems.append("metadata buffer not freed once")
    if obs["release_kv_cache_calls"] != 1 or any(obs["release_inserted_prefix"]):
        problems.append("KV not released exactly once without insert")
    if len(obs["streamed"]) != 1 or (obs["streamed"][0] or {}).get("type") != "FINISH_ABORT":
        problems.append("abort not streamed exactly once")
    if obs["output_ids"]:
        problems.append("sampled token appended")
    if obs["pending_chunk_rid_left"]:
        problems.append("pending chunk-send entry left")
    return problems


def _verdict(problems: list[str], safe_text: str, obs: dict[str, Any]) -> Outcome:
    obs["violations"] = problems
    return judged(problems, safe_text, obs, unsafe_prefix="Not retired cleanly: ")


# ---------------------------------------------------------------------------


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
    problems = _retired_once(obs)
    if not obs["sender_aborted"] and hasattr(rig.sender_cls, "abort"):  # no sender abort() before 0.4.9.post5
        problems.append("sender not aborted")
    # Where the tree cannot drop an aborted prefetch (0.4.9.post3 - 0.5.1.post3) there is nothing to release.
    releases_due = 1 if aborted_prefetch_releasable() else 0
    obs["hicache_storage_releases_due"] = releases_due
    if obs["hicache_storage_releases"] != releases_due:
        problems.append(
            f"HiCache storage state released {obs['hicache_storage_releases']} time(s), not {releases_due}"
        )
    return _verdict(
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
    problems = _handed_on(obs)
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
    problems = _retired_once(obs)
    if not obs["sender_aborted"]:
        problems.append("sender abort never attempted")
    return _verdict(problems, "The raising sender.abort() did not skip cleanup: retired once.", obs)


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
    problems = _retired_once(final)
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
    problems = _retired_once(obs)
    if obs["requeued"]:
        problems.append("requeued as an optimistic retry")
    return _verdict(problems, "The last in-flight middle result retired the request once.", obs)


class _RejectingGrammar:
    """Stands for a constrained-decoding grammar object that rejects the
    sampled token (``accept_token`` raises ``ValueError``, as the grammar
    backends do); records that it was asked."""

    def __init__(self) -> None:
        self.finished = False
        self.accept_calls = 0

    def accept_token(self, token: int) -> None:
        self.accept_calls += 1
        raise ValueError(f"token {token} is not allowed by the grammar")


@case(
    proves=("pr36988",),
    needs=(">=0.4.9.post5",),
    must_preserve=False,
    expect="A final prefill result whose sampled token the grammar rejects is retired before any KV chunk is "
           "sent: not cached, not queued, sender aborted, metadata buffer freed, KV released once without "
           "insert, the abort streamed once.",
)
def grammar_rejected_result_sends_no_kv(ctx) -> Outcome:
    """#36988 as 0.5.20 orders it: the grammar check runs before the final
    result is cached, queued or sends its last chunk, and a request whose
    token it rejects (``prepare_abort``, HTTP 500) is retired with no KV
    chunk sent. Before, the last chunk went out and the rejection came after."""
    rig = RetireRig(ctx)
    req = rig.prefilled_req("grammar-rejected", 64, room=306)
    grammar = _RejectingGrammar()
    req.grammar = grammar
    try:
        rig.deliver_result([req])
    except ValueError as exc:
        if not grammar.accept_calls or "not allowed by the grammar" not in str(exc):
            raise
        raise NotApplicable(
            "the prefill result path does not handle a grammar's rejection of the sampled "
            "token in this release (accept_token's ValueError escapes it; handled from 0.4.9.post5)"
        ) from None
    if not grammar.accept_calls:
        raise NotApplicable(
            "process_batch_result_disagg_prefill does not check the sampled token against a grammar in this "
            "release"
        )
    obs = rig.observe(req)
    # The sampled token is appended before the check in 0.5.20 as well.
    problems = [p for p in _retired_once(obs) if p != "sampled token appended"]
    if not obs["sender_aborted"]:
        problems.append("sender not aborted")
    return _verdict(
        problems,
        "The grammar rejection retired the request before any KV chunk: not cached, not queued, released "
        "once, abort streamed once.",
        obs,
    )


@case(
    must_preserve=True,
    expect='A valid finished request is cached, queued for transfer and sends its last KV chunk; nothing is '
           'released or streamed.',
)
def valid_finished_request_sends_kv(ctx) -> Outcome:
    """Must-preserve: a valid finished prefill keeps its token, is cached,
    queued for transfer and sends its last KV chunk; nothing is released or
    streamed yet."""
    rig = RetireRig(ctx)
    req = rig.prefilled_req("valid", 64, room=305)
    rig.deliver_result([req])
    obs = rig.observe(req)
    ok = (
        obs["cache_unfinished_calls"] == 1
        and obs["queued_for_transfer"]
        and rig.ledger.count("send_kv_chunk", rid=req.rid, last_chunk=True) == 1
        and rig.ledger.of("send_kv_chunk", rid=req.rid)[0]["tokens"] == 64
        and obs["release_kv_cache_calls"] == 0
        and not obs["streamed"]
        and obs["output_ids"] == [SAMPLED_TOKEN]
        and not obs["sender_aborted"]
    )
    if ok:
        return Outcome(SAFE, "The valid request was cached, queued and sent its 64-token last chunk.", obs)
    return Outcome(UNSAFE, "The valid request did not take the normal transfer path.", obs)


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
    from types import SimpleNamespace

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
