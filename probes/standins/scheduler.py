"""The tree's ``Scheduler`` without its constructor (GPUs, ZMQ sockets, a model), with the few
collaborators its PD paths read: the output streamer (what reaches the client), the batch of a
finished forward, the speculative algorithm, and inert helpers.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

from . import Ledger, ParallelStandIn, construct_with, describe_finish
from .memory import RecordingRadixCache, RecordingReqToMetadataIdxAllocator


class RecordingSchedulerOutputStreamer:
    """Stands for the scheduler's output streamer: what reaches the client."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs):
        for req in reqs:
            self.ledger.record("stream", rid=req.rid, finish=describe_finish(req.finished_reason))


class InertCollaborator:
    """Stands for a helper whose work is outside the scenario (logprob copies,
    metrics, tracing, beam groups): accepts any call, remembers its name,
    returns None. Flags are given explicitly so none reads as truthy."""

    def __init__(self, role: str, **flags: Any) -> None:
        self.__dict__["role"] = role
        self.__dict__["calls"] = []
        self.__dict__.update(flags)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            self.calls.append(name)

        return call


class SpeculativeAlgorithmStandIn:
    """No speculative decoding."""

    def __getattr__(self, name: str):
        if name.startswith("is_"):
            return lambda: name == "is_none"
        raise AttributeError(name)


class SchedulerShellBase:
    """The scheduler methods a probe must not run for real (GPU, RDMA, prefix
    prefetch): they record instead. Everything else of the tree's ``Scheduler``
    (its PD mixins, the retire and dispatch methods) is inherited unchanged."""

    def send_kv_chunk(self, req, last_chunk: bool = False, end_idx=None, *args, **kwargs):
        # The real sender hands over [start_send_idx, len(origin_input_ids)) on
        # the last chunk; after set_finish_with_abort that is the 1-token stub.
        # Up to 0.4.6.post4 the last chunk is the call that carries the sampled token (`token_id=`).
        last_chunk = last_chunk or kwargs.get("token_id") is not None
        start = int(getattr(req, "start_send_idx", 0) or 0)
        if last_chunk:
            tokens = len(req.origin_input_ids) - start
        else:
            tokens = (int(end_idx) if end_idx is not None else start) - start
        self.ledger.record("send_kv_chunk", rid=req.rid, last_chunk=bool(last_chunk), tokens=tokens)

    def _prefetch_kvcache(self, req, *args, **kwargs):
        self.ledger.record("prefetch_kvcache", rid=req.rid)

    def _set_or_validate_priority(self, req) -> bool:
        return True

    def _abort_on_queued_limit(self, req) -> bool:
        return False

    def maybe_send_health_check_signal(self, *args, **kwargs):
        return None


_SHELL_CLASSES: dict[int, type] = {}


def make_scheduler_shell(ledger: Ledger, **attrs: Any):
    """A ``Scheduler`` of the tree, without its constructor (which needs GPUs,
    ZMQ sockets and a model): the real methods on a small set of attributes."""
    from sglang.srt.managers.scheduler import Scheduler

    cls = _SHELL_CLASSES.get(id(Scheduler))
    if cls is None:
        cls = type("SchedulerShell", (SchedulerShellBase, Scheduler), {})
        _SHELL_CLASSES[id(Scheduler)] = cls
    shell = object.__new__(cls)
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        spec = SpeculativeAlgorithm.NONE
    except Exception:  # noqa: BLE001 - any drift: fall back to the stand-in
        spec = SpeculativeAlgorithmStandIn()
    defaults: dict[str, Any] = {
        "ledger": ledger,
        "output_streamer": RecordingSchedulerOutputStreamer(ledger),
        "tree_cache": RecordingRadixCache(ledger),
        "metrics_reporter": InertCollaborator("metrics_reporter", enable_metrics=False),
        "metrics_collector": InertCollaborator("metrics_collector"),
        "batch_result_processor": InertCollaborator("batch_result_processor"),
        "beam_coordinator": InertCollaborator("beam_coordinator"),
        "enable_metrics": False,
        "enable_hicache_storage": False,
        "enable_overlap": False,
        "enable_priority_scheduling": False,
        "chunked_req": None,
        "spec_algorithm": spec,
        "disagg_prefill_inflight_queue": [],
        "disagg_prefill_pending_chunk_rids": set(),
        "req_to_metadata_buffer_idx_allocator": RecordingReqToMetadataIdxAllocator(ledger),
        "waiting_queue": [],
        "processed_tokens_counter": 0,
        "tp_rank": 0,  # one rank; up to 0.4.7 the decode pop names it in its failure message
        "model_config": SimpleNamespace(num_key_value_heads=8),
        "ps": ParallelStandIn(),
        "server_args": SimpleNamespace(
            disaggregation_transfer_backend="mooncake",
            optimistic_prefill_attempts=0,
            disaggregation_ib_device=None,
        ),
        "enable_hisparse": False,
        "enable_decode_hicache": False,
        # Up to 0.5.12.post1 the scheduler reports stats itself (the metrics mixin).
        "is_stats_logging_rank": False,
        "current_scheduler_metrics_enabled": False,
        "temp_prefill_info": None,  # 0.5.7 logs a prefill batch's stats after its result; none gathered
    }
    if callable(getattr(Scheduler, "stream_output", None)):
        # Up to 0.5.12.post1 the scheduler streams itself (no output_streamer).
        defaults["stream_output"] = defaults["output_streamer"].stream_output
    defaults.update(attrs)
    if isinstance(defaults["tree_cache"], RecordingRadixCache):
        defaults["tree_cache"].pages = defaults.get("token_to_kv_pool_allocator")
    shell.__dict__.update(defaults)
    return shell


class ScheduleBatchShell:
    """Stands for the ``ScheduleBatch`` of a finished forward: only what the
    result path reads (its requests; no speculative or DP state)."""

    def __init__(self, reqs) -> None:
        self.reqs = list(reqs)
        self.spec_info = None
        self.prefill_stats = None
        self.dp_cooperation_info = None
        self.return_logprob = False
        self.next_batch_sampling_info = None  # up to 0.5.1: no grammar mask to carry to the next batch


def deliver_prefill_result(shell, reqs, sampled_token: int) -> None:
    """One forward result for ``reqs`` reaches the tree's
    ``process_batch_result_disagg_prefill`` (a real ``GenerationBatchResult``)."""
    import torch

    next_token_ids = torch.tensor([sampled_token] * len(reqs), dtype=torch.int64)
    try:
        from sglang.srt.managers.utils import GenerationBatchResult
    except ImportError:  # up to 0.5.1: the scheduler's own dataclass, every field required
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.scheduler import GenerationBatchResult

        # the tree's own (empty) logits output: 0.4.8 reads its hidden_states unguarded; no
        # logprob or hidden state is asked for, so nothing else of it is read
        logits_output = LogitsProcessorOutput(next_token_logits=None)
        result = construct_with(
            GenerationBatchResult,
            next_token_ids=next_token_ids,
            logits_output=logits_output,
            pp_hidden_states_proxy_tensors=None,
            extend_input_len_per_req=None,
            extend_logprob_start_len_per_req=None,
            bid=0,
            can_run_cuda_graph=False,
        )
    else:
        result = GenerationBatchResult(next_token_ids=next_token_ids)
    type(shell).process_batch_result_disagg_prefill(shell, ScheduleBatchShell(reqs), result)


def wrap_beam_coordinator(shell) -> None:
    """Record ``retire_group`` calls of the scheduler's beam coordinator."""
    ledger = shell.ledger

    class BeamCoordinatorStandIn(InertCollaborator):
        def retire_group(self, req, *args, **kwargs):
            ledger.record("beam_retire_group", rid=req.rid)

    shell.beam_coordinator = BeamCoordinatorStandIn("beam_coordinator")


def flush_cache(shell) -> bool:
    """The tree's own ``Scheduler.flush_cache`` on a shell (the flush probes), without emptying the
    device cache where the release takes that flag."""
    from sglang.srt.managers.scheduler import Scheduler

    if "empty_cache" in inspect.signature(Scheduler.flush_cache).parameters:
        return bool(Scheduler.flush_cache(shell, empty_cache=False))
    return bool(Scheduler.flush_cache(shell))
