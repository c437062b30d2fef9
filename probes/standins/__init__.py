"""Small controlled collaborators for the probes: the shared part, and where the others live.

Each stand-in replaces one thing a CPU cannot provide (an RDMA transport, a
GPU page pool, a radix cache over device memory, a distributed process group)
and records what the real SGLang code asked of it, and is named for the class
it stands for. Everything else the probes drive is the tree's own code:
``Req``, the queue ``add`` doors, ``finalize_bootstrap``,
``process_batch_result_disagg_prefill``, the scheduler's retire and dispatch
methods, ``DecodeTransferQueue`` and the ``CommonKVManager`` drain-ACK
bookkeeping. The families, one module each:

- here: lookups into the tree under test, the ``Ledger`` every stand-in writes
  to, the parallel state (``get_parallel``, ``get_pp_group``, ``get_disagg``)
  and real ``Req`` objects in the states the scenarios need;
- ``transport``: KV senders, receivers and the KV manager the doors see;
- ``memory``: metadata slots, the token-to-KV pool, the radix cache
  and the module-level cache helpers;
- ``scheduler``: the tree's ``Scheduler`` without its constructor,
  its output streamer, its batch, and inert collaborators;
- ``transfer_engine``: the prefill side under the real transfer
  workers (the RDMA engine, the per-layer engine, the ZMQ pushes to decode);
- ``hicache``: the host-memory (HiCache) tree's load-back and eviction;
- ``addons``: names older releases read from torch/triton that today's lack;
- ``shims/``: stand-in packages put on the path where a real one needs CUDA or is absent.

SGLang modules are imported lazily (inside functions): these modules are
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


def has_method(cls_path: str, name: str) -> bool:
    module, _, cls_name = cls_path.rpartition(".")
    cls = sg_attr(module, cls_name)
    return cls is not None and callable(getattr(cls, name, None))


def prefill_bootstrap_queue_attr() -> str:
    """The name the tree's ``Scheduler`` gives its ``PrefillBootstrapQueue``: ``disagg_prefill_pending_queue``
    up to 0.4.5.post3, ``disagg_prefill_bootstrap_queue`` from 0.4.6. A scheduler shell carries only the
    release's own name, so code that reaches the queue by the other name fails as it would in a server."""
    import pathlib

    source = pathlib.Path(sg("managers.scheduler").__file__).read_text(encoding="utf-8")
    if "self.disagg_prefill_pending_queue = " in source:
        return "disagg_prefill_pending_queue"
    return "disagg_prefill_bootstrap_queue"


def aborted_prefetch_releasable() -> bool:
    """Whether the tree can drop the HiCache storage prefetch of an aborted request. 0.4.9.post3 -
    0.5.1.post3 prefetch (`HiRadixCache.prefetch_from_storage`) but have no way to drop one early
    (`release_aborted_request` from 0.5.2): there a fix cannot release it, and a probe asks it not to.
    Before 0.4.9.post3 there is no HiCache storage layer at all (no `mem_cache.hicache_storage`): no
    prefetch can have started, so there is nothing to drop either."""
    if sg_attr("mem_cache.hicache_storage", "HiCacheStorage") is None:
        return False
    cls = sg_attr("mem_cache.hiradix_cache", "HiRadixCache")
    if cls is None or not callable(getattr(cls, "prefetch_from_storage", None)):
        return True
    return callable(getattr(cls, "release_aborted_request", None))


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
# the ledger every stand-in writes to


# What a drain case's details show (the Mooncake and NIXL rigs; each adds its own worker-death kind).
DRAIN_EVENT_KINDS = ("abort_received", "drain_ack", "write_posted", "writes_settled", "sender_cleared")
DRAIN_EVENT_FIELDS = ("kind", "peer", "endpoint", "writes_in_flight", "mode", "message")


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

    def projected(self, kinds: tuple[str, ...], fields: tuple[str, ...]) -> list[dict[str, Any]]:
        """The events of `kinds`, in order, each reduced to `fields` (what a case's details show)."""
        return [{k: v for k, v in e.items() if k in fields} for e in self.events if e["kind"] in kinds]


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
            # 0.5.23: one rank holds every KV page, with no CP-TP group sharing
            enable_kv_cache_sharding=False,
            enable_cp_tp_group_sharing=False,
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
        "get_attention_cp_rank": lambda: parallel.attn_cp_rank,
        "get_attention_cp_size": lambda: parallel.attn_cp_size,
        # 0.5.23's width of linear attention's group: attention TP here (no CP-TP sharing)
        "linear_attn_tp_size": lambda: parallel.attn_tp_size,
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
    # A served request's sampling parameters are normalized by the tokenizer manager, and it
    # carries the model's vocabulary size: 0.5.5's decode transfer queue runs check_finished on
    # the first output token, which reads both.
    req.sampling_params.normalize(None)
    if getattr(req, "vocab_size", 0) is None:
        req.vocab_size = 32000
    return req


def mark_aborted(req, finish) -> None:
    """Abort a running request: a pending ``to_finish`` from 0.5.4.post2, written into ``finished_reason``
    at once before (no ``to_finish`` field). Up to 0.5.4.post1 a client's abort of a running request is the
    scheduler's ``to_abort`` flag instead, which only ``check_finished`` promotes (the disaggregated prefill
    path never calls it); that pending abort is not modelled here."""
    if hasattr(req, "to_finish"):
        req.to_finish = finish
    else:
        req.finished_reason = finish


def reject_at_intake(req, message: str) -> None:
    """The intake rejection of the incident: ``Req.set_finish_with_abort``. Up to 0.4.6.post5 (no such
    method) the scheduler rejects an over-long prompt inline, as here: ``validate_input_length`` writes
    the 400 into ``finished_reason``, then the prompt becomes the one-token stub and ``max_new_tokens`` 0."""
    if callable(getattr(req, "set_finish_with_abort", None)):
        req.set_finish_with_abort(message)
        return
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.finished_reason = FINISH_ABORT(message, HTTPStatus.BAD_REQUEST, "BadRequestError")
    req.origin_input_ids = [0]
    req.sampling_params.max_new_tokens = 0


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
