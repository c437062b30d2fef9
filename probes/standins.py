"""Small controlled collaborators for the probes.

Each stand-in replaces one thing a CPU cannot provide (an RDMA transport, a
GPU page pool, a radix cache over device memory, a distributed process group)
and records what the real SGLang code asked of it. Everything else the probes
drive is the tree's own code: ``Req``, the queue ``add`` doors,
``finalize_bootstrap``, ``process_batch_result_disagg_prefill``, the
scheduler's retire and dispatch methods, ``DecodeTransferQueue`` and the
``CommonKVManager`` drain-ACK bookkeeping.

SGLang modules are imported lazily (inside functions): this module is
imported by the harness before the tree's modules, and a broken tree must
surface as per-case ``error`` verdicts rather than as an import crash.

Recorded data is plain (ints, strings, bools) so a probe's ``details`` are
deterministic for the same tree.
"""

from __future__ import annotations

import importlib
import inspect
from array import array
from types import SimpleNamespace
from typing import Any

# ---------------------------------------------------------------------------
# lookups into the tree under test


def sg(module: str):
    """Import ``sglang.srt.<module>`` from the tree under test."""
    return importlib.import_module(f"sglang.srt.{module}")


def sg_attr(module: str, name: str, default: Any = None) -> Any:
    try:
        return getattr(sg(module), name, default)
    except ImportError:
        return default


# ---------------------------------------------------------------------------
# the ledger every stand-in writes to


class Ledger:
    """Ordered record of what the real code did to the stand-ins of one case."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def record(self, kind: str, **data: Any) -> None:
        self.events.append({"kind": kind, **data})

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]

    def count(self, kind: str, **match: Any) -> int:
        return len(self.of(kind, **match))

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> Ledger:
        view = Ledger()
        view.events = self.events[mark:]
        return view


def describe_finish(reason: Any) -> dict[str, Any] | None:
    """A finish reason as the client would see it: type and HTTP status."""
    if reason is None:
        return None
    status = getattr(reason, "status_code", None)
    try:
        status = int(status) if status is not None else None
    except (TypeError, ValueError):
        status = str(status)
    return {"type": type(reason).__name__, "status_code": status}


# ---------------------------------------------------------------------------
# parallel state


class ParallelStandIn(SimpleNamespace):
    """Stands for ``get_parallel()``: a single rank of a single-GPU group."""

    def __init__(self) -> None:
        super().__init__(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_tp_rank=0,
            attn_tp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            attn_dp_rank=0,
            dp_rank=0,
            dp_size=1,
            moe_ep_rank=0,
            gpu_id=0,
            dist_init_addr=None,
            attn_tp_group=SimpleNamespace(cpu_group=None),
            tp_group=SimpleNamespace(cpu_group=None),
        )


class PipelineGroupStandIn(SimpleNamespace):
    """Stands for ``get_pp_group()``: the pipeline-parallel group of a single
    stage (no torch.distributed process group behind it)."""

    def __init__(self) -> None:
        super().__init__(rank_in_group=0, world_size=1, is_first_rank=True, is_last_rank=True,
                         cpu_group=None, device_group=None)


def release_disagg_defaults() -> SimpleNamespace:
    """Stands for ``get_disagg()``: this release's own defaults of the
    disaggregation settings (the ``Disagg`` config struct from 0.5.20, the
    ``ServerArgs`` field defaults before), as an unconfigured server has them."""
    import dataclasses

    values: dict[str, Any] = {}
    server_args = sg_attr("server_args", "ServerArgs")
    if server_args is not None and dataclasses.is_dataclass(server_args):
        for f in dataclasses.fields(server_args):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                values[f.name] = f.default_factory()  # type: ignore[misc]
    disagg = sg_attr("arg_groups.fields.disagg", "Disagg")
    if disagg is not None:
        struct = disagg()
        for name in getattr(disagg, "__struct_fields__", ()):
            values[name] = getattr(struct, name)
    return SimpleNamespace(**values)


RUNTIME_MODULES = (
    "managers.schedule_batch",
    "disaggregation.prefill",
    "disaggregation.decode",
    "disaggregation.utils",
    "disaggregation.common.conn",
    "managers.scheduler",
    "mem_cache.common",
)


def pin_runtime(ctx) -> None:
    """Every module that reads the process-wide runtime context sees one rank
    of one (``get_parallel``) and the release's default PD settings
    (``get_disagg``), without publishing a real server configuration.

    ``Req.set_finish_with_abort`` logs on rank 0 only and reads the rank through
    ``get_parallel`` (0.5.16+) or ``get_tensor_model_parallel_rank`` (up to
    0.5.15.post1); so do the retire paths. Each release's own lookup names are
    patched where a module imported them.
    """
    parallel = ParallelStandIn()
    disagg = release_disagg_defaults()
    lookups = {
        "get_parallel": lambda: parallel,
        "get_disagg": lambda: disagg,
        # the distributed-state getters of releases before get_parallel
        "get_tensor_model_parallel_rank": lambda: parallel.tp_rank,
        "get_tensor_model_parallel_world_size": lambda: parallel.tp_size,
        "get_attention_tp_rank": lambda: parallel.attn_tp_rank,
        "get_attention_tp_size": lambda: parallel.attn_tp_size,
    }
    for name in RUNTIME_MODULES:
        try:
            module = sg(name)
        except ImportError:
            continue
        for lookup, value in lookups.items():
            ctx.patch_if_present(module, lookup, value)


# ---------------------------------------------------------------------------
# requests


def make_req(rid: str, num_tokens: int, *, room: int, max_new_tokens: int = 8):
    """A real ``Req`` with a PD bootstrap address, built the way the tokenizer
    manager's request would be."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=rid,
        origin_input_text="probe",
        origin_input_ids=array("q", range(1, num_tokens + 1)),
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
    )
    req.bootstrap_host = "10.0.0.2"
    req.bootstrap_port = 8998
    req.bootstrap_room = room
    return req


def reject_at_intake(req, message: str) -> None:
    """The intake rejection of the incident: ``Req.set_finish_with_abort``."""
    req.set_finish_with_abort(message)


def holds_kv(req) -> bool:
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(type(kv), "holds_kv"):
        return bool(kv.holds_kv)
    return getattr(req, "req_pool_idx", None) is not None


def give_kv_row(req, row: int, num_tokens: int) -> None:
    """Mark ``req`` as owning a req-pool row (what a forward's allocation leaves)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        # 0.5.19+: ownership lives on ReqKvInfo.
        kv.req_pool_idx = row
        kv.kv_allocated_len = num_tokens
        kv.kv_committed_len = num_tokens
        return
    # 0.5.17/0.5.18: the row is on the request, ReqKvInfo is present iff held.
    req.req_pool_idx = row
    info_cls = sg_attr("managers.schedule_batch", "ReqKvInfo")
    if info_cls is not None:
        try:
            req.kv = info_cls(kv_allocated_len=num_tokens, swa_evicted_seqlen=0)
        except TypeError:
            req.kv = info_cls(num_tokens, 0)


def drop_kv_row(req) -> None:
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "req_pool_idx"):
        kv.req_pool_idx = None
        kv.kv_allocated_len = 0
        if hasattr(kv, "swa_evicted_seqlen"):
            kv.swa_evicted_seqlen = 0
        return
    req.req_pool_idx = None
    if hasattr(req, "kv"):
        req.kv = None


def has_retraction_backup_slot(req) -> bool:
    """Host KV retraction backups exist from 0.5.18 (on the request), and on
    ``ReqKvInfo`` from 0.5.19."""
    kv = getattr(req, "kv", None)
    return (kv is not None and hasattr(kv, "retraction_backup")) or hasattr(req, "retraction_backup")


def set_retraction_backup(req, backup: Any) -> None:
    """Give ``req`` a host KV retraction backup (0.5.18 on the request, later on ReqKvInfo)."""
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "retraction_backup"):
        kv.retraction_backup = backup
    else:
        req.retraction_backup = backup


# ---------------------------------------------------------------------------
# transport


class _TransferFailed(Exception):
    """What a failed transport reports through ``failure_exception``."""


def recording_sender_class(ledger: Ledger, *, abort_raises: bool = False):
    """A KV sender class for ``get_kv_class(..., SENDER)``."""

    class RecordingKVSender:
        """Stands for a Mooncake/NIXL sender: records that prefill created a
        handoff object for a request, the pages it announced, and aborts."""

        def __init__(self, mgr=None, bootstrap_addr=None, bootstrap_room=None, **_):
            self.kv_mgr = mgr
            self.bootstrap_room = bootstrap_room
            self.conclude_state = None
            self.num_pages: int | None = None
            ledger.record("sender_created", room=bootstrap_room)

        def init(self, num_kv_indices, aux_index=None, *args, **kwargs):
            self.num_pages = int(num_kv_indices)
            ledger.record(
                "sender_init",
                room=self.bootstrap_room,
                num_pages=int(num_kv_indices),
                metadata_index=None if aux_index is None else int(aux_index),
            )

        def pop_decode_prefix_len(self) -> int:
            return 0

        def poll(self):
            from sglang.srt.disaggregation.base import KVPoll

            return self.conclude_state or KVPoll.WaitingForInput

        def should_send_kv_chunk(self, num_pages, last_chunk) -> bool:
            return num_pages > 0 or last_chunk

        def get_max_transfer_tokens(self):
            return None  # the base sender's default (0.5.21+): no per-send limit

        def send(self, kv_indices, *args, **kwargs):
            ledger.record("sender_send", room=self.bootstrap_room, n=len(kv_indices))

        def abort(self):
            ledger.record("sender_abort", room=self.bootstrap_room)
            if abort_raises:
                raise ConnectionError("probe: transport refused the abort")

        def failure_exception(self):
            raise _TransferFailed("probe: bootstrap with decode failed")

        def clear(self):
            ledger.record("sender_clear", room=self.bootstrap_room)

        def get_transfer_metric(self):
            return None

    return RecordingKVSender


def recording_receiver_class(ledger: Ledger):
    """A KV receiver class for ``get_kv_class(..., RECEIVER)``."""

    class RecordingKVReceiver:
        """Stands for a Mooncake/NIXL receiver: records that decode created a
        handoff object and bootstrapped it."""

        def __init__(self, mgr=None, bootstrap_addr=None, bootstrap_room=None, **_):
            self.kv_mgr = mgr
            self.bootstrap_room = bootstrap_room
            self.abort_notified = False
            self.require_staging = False
            self.conclude_state = None
            ledger.record("receiver_created", room=bootstrap_room)

        def init(self, prefill_dp_rank=None, *args, **kwargs):
            ledger.record("receiver_init", room=self.bootstrap_room)

        def poll(self):
            from sglang.srt.disaggregation.base import KVPoll

            return self.conclude_state or KVPoll.Bootstrapping

        def send_metadata(self, *args, **kwargs):
            ledger.record("receiver_send_metadata", room=self.bootstrap_room)

        def failure_exception(self):
            raise _TransferFailed("probe: transfer failed")

        def abort(self):
            ledger.record("receiver_abort", room=self.bootstrap_room)

        def clear(self):
            ledger.record("receiver_clear", room=self.bootstrap_room)

    return RecordingKVReceiver


class TransportManagerStandIn:
    """Stands for a KV manager as the queue doors see it: no prefill peers known yet."""

    def __init__(self) -> None:
        self.prefill_info_table: dict[str, Any] = {}
        self.kv_args = SimpleNamespace(state_types=[])
        self.enable_deferred_decode_kv_release = False


def patch_transport(ctx, ledger: Ledger, *, abort_raises: bool = False) -> None:
    """Route ``get_kv_class`` of the prefill and decode modules to recording classes."""
    from sglang.srt.disaggregation.utils import KVClassType

    sender_cls = recording_sender_class(ledger, abort_raises=abort_raises)
    receiver_cls = recording_receiver_class(ledger)

    def get_kv_class(backend, class_type):
        if class_type == KVClassType.SENDER:
            return sender_cls
        if class_type == KVClassType.RECEIVER:
            return receiver_cls
        raise ValueError(f"probe transport has no {class_type}")

    for name in ("disaggregation.prefill", "disaggregation.decode"):
        ctx.patch_if_present(sg(name), "get_kv_class", get_kv_class)


# ---------------------------------------------------------------------------
# memory


class RecordingMetadataAllocator:
    """Stands for ``ReqToMetadataIdxAllocator``: metadata buffer slots, with counters."""

    def __init__(self, ledger: Ledger, size: int = 8) -> None:
        self.ledger = ledger
        self.free_slots = list(range(size))
        self.size = size

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self):
        idx = self.free_slots.pop(0)
        self.ledger.record("metadata_alloc", idx=idx)
        return idx

    def free(self, idx, *args, **kwargs) -> None:
        idx = int(idx)
        if idx in self.free_slots:
            self.ledger.record("metadata_double_free", idx=idx)
            return
        self.ledger.record("metadata_free", idx=idx)
        self.free_slots.append(idx)


class MetadataBuffersStandIn:
    """Stands for ``MetadataBuffers``: only the room column the queues reset."""

    def __init__(self, size: int = 8) -> None:
        self.bootstrap_room = [0] * size


class CountingPageAllocator:
    """Stands for a token-to-KV page pool. Pages are owned by request ids; the
    counters tell how many pages were reserved, returned, and returned twice."""

    def __init__(self, ledger: Ledger, name: str, num_pages: int, page_size: int):
        self.ledger = ledger
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages))
        self.owned: dict[str, list[int]] = {}
        self.released_owners: set = set()

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, owner: str, num_tokens: int) -> list[int]:
        n = self.pages_for(num_tokens)
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self.owned.setdefault(owner, []).extend(pages)
        self.ledger.record("pages_reserved", pool=self.name, owner=owner, pages=n)
        return pages

    def release(self, owner: str) -> int:
        pages = self.owned.pop(owner, None)
        if pages is None:
            if owner in self.released_owners:
                self.ledger.record("pages_double_release", pool=self.name, owner=owner)
            return 0
        self.released_owners.add(owner)
        self.free_pages.extend(pages)
        self.ledger.record("pages_released", pool=self.name, owner=owner, pages=len(pages))
        return len(pages)

    def held_by(self, owner: str) -> int:
        return len(self.owned.get(owner, ()))


class RecordingTreeCache:
    """Stands for the radix cache: records prefix inserts and abort bookkeeping."""

    cache_controller = None

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def cache_unfinished_req(self, req, *args, **kwargs):
        self.ledger.record("cache_unfinished", rid=req.rid, via="tree_cache")

    def checkpoint(self, req, *args, **kwargs):
        self.ledger.record("cache_unfinished", rid=req.rid, via="tree_cache.checkpoint")

    def advance_unpublished_req(self, req, *args, **kwargs):
        self.ledger.record("cache_unfinished", rid=req.rid, via="advance_unpublished")

    def finish(self, handle, outcome=None, *args, **kwargs):
        self.ledger.record("tree_finish", outcome=getattr(outcome, "name", str(outcome)))

    def release_aborted_request(self, rid):
        self.ledger.record("tree_release_aborted", rid=rid)

    def supports_mamba(self) -> bool:
        return False

    def inc_lock_ref(self, *args, **kwargs):
        return None

    def dec_lock_ref(self, *args, **kwargs):
        return None

    def unlock(self, *args, **kwargs):
        return None


def patch_cache_helpers(ctx, ledger: Ledger, module, pages: CountingPageAllocator | None):
    """Swap the module-level cache helpers ``module`` calls for recorders.

    ``release_kv_cache`` returns the request's pages to ``pages`` and records
    whether the prefix was inserted into the tree (``is_insert`` up to 0.5.21,
    ``checkpoint`` from 0.5.22; both default to inserting).
    """

    def release_kv_cache(req, tree_cache, *args, **kwargs):
        insert = kwargs.get("is_insert", kwargs.get("checkpoint", args[0] if args else True))
        freed = pages.release(req.rid) if pages is not None else 0
        drop_kv_row(req)
        ledger.record("release_kv_cache", rid=req.rid, insert=bool(insert), pages=freed)

    def maybe_cache_unfinished_req(req, tree_cache, *args, **kwargs):
        ledger.record("cache_unfinished", rid=req.rid, via="maybe_cache_unfinished_req")

    def checkpoint_kv_cache(req, tree_cache, *args, **kwargs):
        ledger.record("cache_unfinished", rid=req.rid, via="checkpoint_kv_cache")

    def discard_kv_cache_backup(req, *args, **kwargs):
        ledger.record("discard_backup", rid=req.rid)

    ctx.patch_if_present(module, "release_kv_cache", release_kv_cache)
    ctx.patch_if_present(module, "maybe_cache_unfinished_req", maybe_cache_unfinished_req)
    ctx.patch_if_present(module, "checkpoint_kv_cache", checkpoint_kv_cache)
    ctx.patch_if_present(module, "discard_kv_cache_backup", discard_kv_cache_backup)


# ---------------------------------------------------------------------------
# scheduler side


class RecordingOutputStreamer:
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


class SpecAlgorithmStandIn:
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
        spec = SpecAlgorithmStandIn()
    defaults: dict[str, Any] = {
        "ledger": ledger,
        "output_streamer": RecordingOutputStreamer(ledger),
        "tree_cache": RecordingTreeCache(ledger),
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
        "req_to_metadata_buffer_idx_allocator": RecordingMetadataAllocator(ledger),
        "waiting_queue": [],
        "processed_tokens_counter": 0,
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
    }
    if callable(getattr(Scheduler, "stream_output", None)):
        # Up to 0.5.12.post1 the scheduler streams itself (no output_streamer).
        defaults["stream_output"] = defaults["output_streamer"].stream_output
    defaults.update(attrs)
    shell.__dict__.update(defaults)
    return shell


class BatchShell:
    """Stands for the ``ScheduleBatch`` of a finished forward: only what the
    result path reads (its requests; no speculative or DP state)."""

    def __init__(self, reqs) -> None:
        self.reqs = list(reqs)
        self.spec_info = None
        self.prefill_stats = None
        self.dp_cooperation_info = None
        self.return_logprob = False


def deliver_prefill_result(shell, reqs, sampled_token: int) -> None:
    """One forward result for ``reqs`` reaches the tree's
    ``process_batch_result_disagg_prefill`` (a real ``GenerationBatchResult``)."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    result = GenerationBatchResult(
        next_token_ids=torch.tensor([sampled_token] * len(reqs), dtype=torch.int64)
    )
    type(shell).process_batch_result_disagg_prefill(shell, BatchShell(reqs), result)


def wrap_beam_coordinator(shell) -> None:
    """Record ``retire_group`` calls of the scheduler's beam coordinator."""
    ledger = shell.ledger

    class BeamCoordinatorStandIn(InertCollaborator):
        def retire_group(self, req, *args, **kwargs):
            ledger.record("beam_retire_group", rid=req.rid)

    shell.beam_coordinator = BeamCoordinatorStandIn("beam_coordinator")


def has_method(cls_path: str, name: str) -> bool:
    module, _, cls_name = cls_path.rpartition(".")
    cls = sg_attr(module, cls_name)
    return cls is not None and callable(getattr(cls, name, None))


def construct_with(cls, **available: Any):
    """Call ``cls(...)`` passing, by name, the parameters its constructor of this
    release asks for (constructors drift between releases)."""
    params = inspect.signature(cls.__init__).parameters
    kwargs = {}
    for pname, p in params.items():
        if pname == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if pname in available:
            kwargs[pname] = available[pname]
        elif p.default is p.empty:
            raise TypeError(f"{cls.__name__}.__init__ needs {pname!r}, the probe has no value for it")
    return cls(**kwargs)


# ---------------------------------------------------------------------------
# prefill-side transfer (prefill_drain)


class WorkerStopped(BaseException):
    """Raised by the stand-in queues when they run dry, so a worker's endless
    loop returns to the probe. A BaseException: the workers' own crash
    handlers catch Exception and must not mistake this for a crash."""


class TransferEngineStandIn:
    """Stands for the RDMA transfer engine under one prefill rank's send calls
    (``send_kvcache``, ``send_aux``, ``maybe_send_extra``): each call posts a
    write toward decode's pages, and the probe's ``plan`` decides what happens
    to it, one entry per call:

    - ``complete``: the write lands, the call returns 0;
    - ``timeout``: the call gives up and returns -1 while the write is still
      running (Mooncake's ``batch_transfer_sync`` on its wall-clock timeout);
    - ``hold``: the write is in flight while ``during`` runs (an ABORT arriving
      mid-transfer), then lands and the call returns 0;
    - ``crash``: the write is posted, then the call raises (a worker bug).

    ``in_flight`` counts posted writes that have not settled; ``settle()``
    lets them land. Every drain ACK is recorded with that count, so a case can
    tell an ACK sent while a write could still hit decode's pages.
    """

    def __init__(self, ledger: Ledger, plan: list[str] | None = None, during=None) -> None:
        self.ledger = ledger
        self.plan = list(plan or [])
        self.during = during
        self.in_flight = 0

    def submit(self, kind: str, room: int) -> int:
        mode = self.plan.pop(0) if self.plan else "complete"
        self.ledger.record("write_posted", what=kind, room=room, mode=mode)
        if mode == "complete":
            return 0
        self.in_flight += 1
        if mode == "timeout":
            return -1
        if mode == "hold":
            if self.during is not None:
                self.during()
            self.in_flight -= 1
            return 0
        if mode == "crash":
            raise RuntimeError("probe: transfer worker bug while a write was posted")
        raise ValueError(f"unknown transfer plan entry {mode!r}")

    def settle(self) -> None:
        self.ledger.record("writes_settled", count=self.in_flight)
        self.in_flight = 0


def abort_frames(room: int, peer: tuple[str, int]) -> list[bytes]:
    """One decode rank's ABORT message for `room`, as the prefill's ABORT handler receives it
    (with the ABORT generation where the release's frames carry one, as 0.5.22's do)."""
    ip, port = peer
    frames = [b"ABORT", str(room).encode(), ip.encode(), str(port).encode()]
    if sg_attr("disaggregation.common.conn", "AbortNotification") is not None:
        frames.append(b"1")
    return frames


class DecodePeerWire:
    """Stands for the prefill rank's ZMQ pushes to decode endpoints
    (``_send_multipart_locked``): records drain ACKs (with the writes still
    in flight at that moment) and status messages."""

    def __init__(self, ledger: Ledger, engine: TransferEngineStandIn) -> None:
        self.ledger, self.engine = ledger, engine

    def send(self, endpoint: str, parts, is_ipv6: bool = False) -> None:
        head = bytes(parts[0]) if parts else b""
        if head == b"ABORT_ACK":
            self.ledger.record(
                "drain_ack",
                endpoint=str(endpoint),
                room=int(bytes(parts[1]).decode("ascii")),
                writes_in_flight=self.engine.in_flight,
            )
        else:
            self.ledger.record("status_to_decode", endpoint=str(endpoint))


class PerLayerEngineStandIn:
    """Stands for the Mooncake transfer engine under the per-layer send path
    (``batch_transfer_sync``, one call per layer when a custom memory pool
    splits a chunk's writes into per-layer futures). Each source layer's write
    follows the probe's ``plan`` (layer index -> mode):

    - ``writing``: the write starts and keeps landing in decode's pages until
      the probe calls ``land()``; then it returns 0;
    - ``fail``: once a ``writing`` sibling has started, the call fails at once
      (returns -1), as a write to a dead peer does.

    A layer's index is its source pointer's position in ``src_ptrs``.
    """

    def __init__(self, ledger: Ledger, src_ptrs: list[int], item_len: int, plan: dict[int, str]) -> None:
        import threading

        self.ledger = ledger
        self.src_ptrs, self.item_len, self.plan = list(src_ptrs), item_len, dict(plan)
        self.sibling_writing = threading.Event()
        self.landed = threading.Event()
        self.writes_running = 0
        self._lock = threading.Lock()

    def _layer(self, src_addr: int) -> int:
        return max(i for i, ptr in enumerate(self.src_ptrs) if src_addr >= ptr)

    def batch_transfer_sync(self, session_id, src_addrs, dst_addrs, lengths) -> int:
        layer = self._layer(int(src_addrs[0]))
        mode = self.plan.get(layer, "writing")
        if mode == "fail":
            self.sibling_writing.wait(10)
            self.ledger.record("layer_write_failed", layer=layer)
            return -1
        with self._lock:
            self.writes_running += 1
        self.ledger.record("layer_write_started", layer=layer)
        self.sibling_writing.set()
        self.landed.wait(10)
        with self._lock:
            self.writes_running -= 1
        self.ledger.record("layer_write_landed", layer=layer)
        return 0

    def land(self) -> None:
        self.landed.set()
