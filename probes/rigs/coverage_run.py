"""Running handoffs on the sides of probes/rigs/coverage.py: the runtime pinned with the all-reduce
stand-in, the ranks polled together, one request through both sides (``one_handoff``), and what a
case reads of the result (refused, or committed)."""

from __future__ import annotations

import threading
from typing import Any

from .. import SAFE, UNSAFE, NotApplicable, Outcome
from ..standins import Ledger, pin_runtime, sg
from ..standins.memory import patch_cache_helpers
from .coverage import (
    CHECK_ENV,
    COVERAGE_SLOT,
    DecodeSide,
    MinAllReduce,
    PrefillSide,
    metadata_buffers,
)


def coverage_rig(ctx, ranks: int = 1) -> MinAllReduce:
    """Pin the runtime, the check's default environment and the all-reduce stand-in."""
    pin_runtime(ctx)
    ctx.setenv(CHECK_ENV, None)  # the default
    collective = MinAllReduce(ranks)
    ctx.patch(sg("disaggregation.utils"), "dist", collective)
    return collective


def release_from_every_rank(ctx, ledger: Ledger, sides) -> None:
    """The decode module's ``release_kv_cache`` frees a request's pages on whichever rank's pool
    holds them (each side has its own pool), and records the call."""
    pools = [s.pages for s in sides]

    def release_kv_cache(req, tree_cache, *args, **kwargs):
        for pool in pools:
            if pool.held_by(req.rid):
                pool.release(req.rid)
        ledger.record("release_kv_cache", rid=req.rid)

    ctx.patch_if_present(sg("disaggregation.decode"), "release_kv_cache", release_kv_cache)


def run_ranks(sides, collective) -> list[list]:
    """Each decode rank's ``pop_transferred``, concurrently (they meet in the all-reduce)."""
    results: list[Any] = [None] * len(sides)

    def run(i):
        try:
            results[i] = sides[i].pop(collective)
        except BaseException as e:  # noqa: BLE001 - reported, and the barrier released
            results[i] = e
            collective.barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sides))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def require_coverage_slot() -> None:
    if not hasattr(metadata_buffers(), "cached_tokens"):
        raise NotApplicable(
            "this release's MetadataBuffers has no cached_tokens buffer (added in 0.5.3): the "
            "transferred-coverage check's spare slot, which carries the coverage, does not exist"
        )


def one_handoff(ctx, *, decode_tokens: int, prefill_tokens: int, rid: str, room: int, output_ids=(),
                rebootstrap: bool = False, spec: bool = False, erase_coverage: bool = False,
                before_commit=None, check_env: str | None = None, **prefill_kw) -> dict[str, Any]:
    """Decode reserves ``decode_tokens``; prefill hands over a ``prefill_tokens``
    sequence; decode's transfer queue polls it. ``check_env``: the value of the
    check's environment variable (None: unset, the default every case runs with)."""
    require_coverage_slot()
    collective = coverage_rig(ctx)
    ctx.setenv(CHECK_ENV, check_env)
    ledger = Ledger()
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), None)
    decode = DecodeSide(ctx, ledger, spec=spec)
    patch_cache_helpers(ctx, ledger, sg("disaggregation.decode"), decode.pages)
    prefill = PrefillSide(ctx, ledger)
    decode_req = decode.expect(rid, room, decode_tokens, output_ids=output_ids, rebootstrap=rebootstrap)
    if before_commit is not None:
        before_commit(decode_req.req)
    preq = prefill.handoff(f"p-{rid}", prefill_tokens, room, spec=spec, **prefill_kw)
    if erase_coverage:  # an unpatched prefill never writes the slot
        prefill.buffers.cached_tokens[preq.metadata_buffer_index, COVERAGE_SLOT] = 0
    decode.land(prefill, preq, decode_req)
    committed = decode.pop(collective)
    obs = decode.outcome(decode_req, committed)
    obs["prefill_last_chunk_tokens"] = int(preq.start_send_idx)
    return obs


def refused(obs: dict[str, Any]) -> bool:
    finish = obs["finish"] or {}
    return (
        not obs["committed"]
        and finish.get("type") == "FINISH_ABORT"
        and int(finish.get("status_code") or 0) >= 500
        and len(obs["streamed"]) == 1
        and obs["pages_held"] == 0
        and obs["release_calls"] == 1
        and not obs["double_releases"]
    )


def refusal_outcome(obs: dict[str, Any], what: str, must_say: str) -> Outcome:
    if refused(obs) and must_say in (obs["refusal_message"] or ""):
        return Outcome(
            SAFE, f"{what} refused: 500, pages released once, counter {obs['refusal_counter']}.", obs
        )
    if obs["committed"]:
        return Outcome(
            UNSAFE,
            f"{what} committed: decode would attend over {obs['reserved_tokens']} reserved "
            f"tokens with {obs['prefill_last_chunk_tokens']} written.",
            obs,
        )
    return Outcome(UNSAFE, f"{what} not refused cleanly (status, release or message).", obs)


def commit_outcome(obs: dict[str, Any], what: str) -> Outcome:
    if obs["committed"] and obs["finish"] is None and obs["pages_held"] > 0 and not obs["release_calls"]:
        return Outcome(SAFE, f"{what} committed: coverage {obs['recorded_coverage']} for "
                             f"{obs['reserved_tokens']} reserved.", obs)
    return Outcome(UNSAFE, f"{what} was not committed.", obs)
