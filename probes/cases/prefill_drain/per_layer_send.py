"""The Mooncake per-layer wait (#35049's groundwork): ``send_kvcache`` writes each layer on a thread
pool (from 0.4.6 for every chunk; with the custom memory pool once later releases batch the other
writes) and must not report a failed layer before the others finished. The probe:
probes/cases/prefill_drain/.
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case
from ...rigs.mooncake import DEFERRED_ENV, deferral_flag, kv_indices
from ...standins import Ledger, pin_runtime, sg

LAYER_PTRS = (1 << 20, 2 << 20)  # two layers of prefill KV (source pointers)
DECODE_LAYER_PTRS = [3 << 20, 4 << 20]  # the same two layers on decode


@case(
    # the per-layer writes run on a thread pool from 0.4.6 (0.4.5.x writes the layers one after another);
    # send_kvcache takes the pool as an argument from 0.4.7 (before: the manager's own self.executor)
    # below 0.5.13 this pack's sbp-abort-hold carries the same wait (no pr35049-inflight there), below
    # 0.4.10 its prefill half alone, sbp-layer-drain
    proves=("pr35049-inflight|sbp-abort-hold|sbp-layer-drain",),
    needs=(">=0.4.6",),
    must_preserve=False,
    expect="When one per-layer write of a Mooncake chunk (custom memory pool) fails while another layer's "
           "write is "
    "still landing in decode's pages, send_kvcache reports the failure only after every per-layer write "
    "finished.",
)
def per_layer_send_reports_failure_after_every_write(ctx) -> Outcome:
    """#35049's groundwork (``_await_transfer_futures``): the transfer worker's failure branch decrements the
    room's in-flight count and may send the drain ACK as soon as ``send_kvcache`` returns, so returning at the
    first failed per-layer future lets decode free pages a sibling layer's write still lands on. Drives the
    tree's real ``send_kvcache`` (its per-layer futures on a real thread pool) over a stand-in engine.

    0.4.6 - 0.4.6.post3 give up on the failed layer by raising (their failure branch shuts down an undefined
    ``executor``: NameError) while the sibling write still lands: the transfer thread dies with it, which ends
    the send as early as the return of 0.4.6.post4 and later does, and is judged the same."""
    from ...rigs.future_wait import PendingFutureWait, RecordingPool
    from ...standins.transfer_engine import PerLayerEngineStandIn

    pin_runtime(ctx)
    ctx.setenv(DEFERRED_ENV, "true")
    module = sg("disaggregation.mooncake.conn")
    cls = module.MooncakeKVManager
    pool_is_argument = "executor" in inspect.signature(cls.send_kvcache).parameters
    if not pool_is_argument and "executor" not in inspect.getsource(cls.send_kvcache):
        raise NotApplicable(
            "send_kvcache writes a chunk's layers one after another, synchronously (no per-layer "
            "futures before 0.4.6): no layer's write is still running when a failed one returns"
        )
    # 0.5.19+ check the unified-memory layout first; this rank does not use unified memory.
    ctx.patch_if_present(module, "get_memory", lambda: SimpleNamespace(enable_unified_memory=False))
    ledger = Ledger()
    engine = PerLayerEngineStandIn(ledger, list(LAYER_PTRS), 64, {0: "fail", 1: "writing"})
    mgr = object.__new__(cls)
    mgr.__dict__.update(
        kv_args=SimpleNamespace(
            kv_data_ptrs=list(LAYER_PTRS),
            kv_item_lens=[64, 64],
            kv_layer_ids=None,
            mla_compression_ratios=None,
            prefill_start_layer=0,
            prefill_end_layer=len(LAYER_PTRS),
            num_draft_entries=0,
            page_size=1,
        ),
        is_mla_backend=True,
        is_hybrid_mla_backend=False,
        attn_tp_size=1,
        pp_rank=0,
        pp_size=1,
        enable_custom_mem_pool=True,  # the per-layer futures path
        custom_mem_pool_type=None,
        engine=engine,
    )
    mgr.enable_deferred_decode_kv_release = deferral_flag(cls)
    outcome: dict[str, Any] = {}

    returned, settled = threading.Event(), threading.Event()

    def send() -> None:
        args = ("10.0.1.1:19000", kv_indices(4), list(DECODE_LAYER_PTRS), kv_indices(4))
        wait_proof.watch()
        try:
            outcome["ret"] = mgr.send_kvcache(*args, pool) if pool_is_argument else mgr.send_kvcache(*args)
        except Exception as exc:  # noqa: BLE001 - reported; judged below only when the failed layer raised it
            outcome["raised"] = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            wait_proof.stop()
            ledger.record("send_returned", writes_running=engine.writes_running)
            returned.set()
            settled.set()

    with RecordingPool(max_workers=len(LAYER_PTRS)) as pool:
        mgr.executor = pool  # up to 0.4.6.post5 the manager's own pool (its constructor makes it)
        wait_proof = PendingFutureWait(pool, settled)
        caller = threading.Thread(target=send, daemon=True)
        caller.start()
        started = engine.sibling_writing.wait(10)
        # Settled by the return (an early one comes within milliseconds of the failure) or by the proof
        # that the send waits, untimed, on the still-writing layer's future; 2 s for any other wait.
        settled.wait(2.0)
        returned_while_writing = returned.is_set()
        waited = (
            "returned"
            if returned_while_writing
            else "an untimed wait only the writing layer's future can end"
            if wait_proof.pending_at_proof
            else "2 s without a return"
        )
        engine.land()
        caller.join(10)
    # A raise is the tree's own failure handling only when it ended the send after the planned failure and
    # while the sibling write ran; any other raise (a stand-in the tree does not fit) is a rig error.
    failed_then_raised = returned_while_writing and ledger.count("layer_write_failed") == 1
    if ("raised" in outcome and not failed_then_raised) or not started or caller.is_alive():
        raise RuntimeError(f"the per-layer send did not run as planned: {outcome or 'no return'}")
    details = {
        "deferred_release": bool(mgr.enable_deferred_decode_kv_release),
        "returned": outcome.get("ret"),
        "returned_while_a_write_ran": returned_while_writing,
        "decided_by": waited,
        "events": [{k: v for k, v in e.items() if k != "session"} for e in ledger.events],
    }
    if "raised" in outcome:
        details["raised"] = outcome["raised"]
        return Outcome(
            UNSAFE,
            f"send_kvcache gave up on the failed layer by raising {outcome['raised']} while "
            "another layer's write was still landing in decode's pages.",
            details,
        )
    if returned_while_writing:
        return Outcome(UNSAFE, "send_kvcache reported the failed layer while another layer's write was still "
                       "landing in decode's pages.", details)
    if not outcome.get("ret"):
        return Outcome(UNSAFE, "send_kvcache lost the failed layer's status (returned 0).", details)
    return Outcome(
        SAFE,
        f"send_kvcache reported the failure ({outcome['ret']}) only after every per-layer write finished.",
        details,
    )
