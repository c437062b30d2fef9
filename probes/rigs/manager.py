"""A prefill ``CommonKVManager`` built through its real constructor, for the
prefill_drain cases that judge what the constructor sets up (not a probe: no
cases here).

The other prefill_drain rigs build their managers without ``__init__`` and fill
in the drain-ACK registry themselves, so the constructor lines that create it
(the per-endpoint ACK targets, the poisoned rooms; #41402) never ran. Here the
tree's own ``CommonKVManager.__init__`` runs in PREFILL mode: it reads the
runtime context, binds a real ZMQ PULL socket on 127.0.0.1 and creates the
registry the cases then drive through the real methods
(``update_status``, ``register_deferred_ack_target``,
``_maybe_ack_drained_abort``, ``poison_deferred_ack_room``,
``CommonKVSender.clear``).

Stand-ins, each for what needs a cluster:

- ``_sync_bootstrap_port_across_nodes`` (a torch.distributed broadcast across
  prefill nodes): one node keeps its own port;
- ``register_to_bootstrap`` (an HTTP PUT to the bootstrap server): recorded;
- ``get_pp_group()`` (the pipeline-parallel process group):
  ``PipelineGroupStandIn``;
- the runtime context (``pin_runtime``, plus the serving address and the local
  IP, so the socket binds on localhost);
- the pushes to decode (``_send_multipart_locked``): ``DecodePeerWire``, unless a
  case asks for the tree's own sockets (``wire=False``).

The manager class is a subclass of the tree's ``CommonKVManager`` that only
overrides the two cluster calls; ``counts_outstanding=True`` adds the
outstanding-write count a transfer backend's constructor sets up (Mooncake's
``_staging_outstanding``) where ``CommonKVManager.__init__`` does not (before
0.5.22). ``close()`` closes the socket and its ZMQ context; the constructor
starts no thread in PREFILL mode (``threads_started`` reports it).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from .. import NotApplicable
from ..standins import (
    Ledger,
    ParallelStandIn,
    PipelineGroupStandIn,
    pin_runtime,
    release_disagg_defaults,
    sg,
)
from ..standins.transfer_engine import DecodePeerWire

LOCALHOST = "127.0.0.1"


class _NoWrites:
    """The decode wire records writes still in flight with each ACK; here no
    transfer engine exists, the count of outstanding chunks stands for it."""

    def __init__(self) -> None:
        self.mgr = None

    @property
    def in_flight(self) -> int:
        outstanding = getattr(self.mgr, "_staging_outstanding", None) or {}
        return sum(outstanding.values())


def _kv_args():
    """The tree's ``KVArgs`` for one prefill rank of one KV layer (CPU values:
    the constructor only sums lengths and reads ranks)."""
    args = sg("disaggregation.base.conn").KVArgs()
    values: dict[str, Any] = {
        "engine_rank": 0,
        "kv_data_ptrs": [4096],
        "kv_data_lens": [256],
        "kv_item_lens": [64],
        "kv_layer_ids": None,
        "kv_cache_dtype_str": "auto",
        "aux_data_ptrs": [8192],
        "aux_data_lens": [64],
        "aux_item_lens": [8],
        "state_types": [],
        "state_data_ptrs": [],
        "state_data_lens": [],
        "state_item_lens": [],
        "state_layer_ids": [],
        "state_dim_per_tensor": [],
        "state_slice_outer_counts": [],
        "state_conv_shard_groups": [],
        "state_type": "none",
        "is_hybrid_mla_backend": False,
        "ib_device": None,
        "gpu_id": 0,
        "kv_head_num": 1,
        "total_kv_head_num": 1,
        "page_size": 1,
        "system_dp_rank": 0,
        "pp_rank": 0,
        "prefill_start_layer": 0,
        "prefill_end_layer": 1,
        "mla_compression_ratios": None,
        "num_draft_entries": 0,
        "decode_tp_size": 1,
        "prefill_pp_size": 1,
    }
    for name, value in values.items():
        setattr(args, name, value)
    return args


def pin_manager_runtime(ctx, module) -> None:
    """A manager module's runtime getters answered for one rank on this host (where it has them)."""
    parallel = _runtime_parallel()
    serving = SimpleNamespace(host=LOCALHOST, port=30000)
    ctx.patch_if_present(module, "get_parallel", lambda: parallel)
    ctx.patch_if_present(module, "get_serving", lambda: serving)
    ctx.patch_if_present(module, "get_local_ip_auto", lambda *a, **k: LOCALHOST)
    ctx.patch_if_present(module, "get_attention_dp_size", lambda: 1)
    ctx.patch_if_present(module, "get_attention_dp_rank", lambda: 0)
    ctx.patch_if_present(module, "get_pp_group", lambda: PipelineGroupStandIn())


def _runtime_parallel() -> SimpleNamespace:
    """``get_parallel()`` as the manager's constructor reads it: one rank, no
    DP attention, no decode context parallelism, no DSA layer split."""
    parallel = ParallelStandIn()
    return SimpleNamespace(
        **vars(parallel), attn_dcp_size=1, attn_dcp_rank=0, attn_dp_size=1, enable_dp_attention=False,
        enable_dsa_cache_layer_split=False, nnodes=1, pp_group=PipelineGroupStandIn(),  # 0.5.21+ read it here
    )


def registry_class():
    """The tree's ``CommonKVManager``, where it keeps a drain-ACK registry."""
    common = sg("disaggregation.common.conn").CommonKVManager
    if not hasattr(common, "_maybe_ack_drained_abort"):
        raise NotApplicable(
            "the prefill has no drain-ACK registry in this release (no #35049): the constructor sets none up"
        )
    return common


class ConstructedPrefillManager:
    """One prefill rank's real ``CommonKVManager`` (a subclass overriding only
    the two cluster calls), built by its constructor; ``mgr`` is it."""

    def __init__(self, ctx, *, counts_outstanding: bool, wire: bool = True) -> None:
        pin_runtime(ctx)
        common = registry_class()
        module = sg("disaggregation.common.conn")
        self.module = module
        self.ledger = Ledger()
        pin_manager_runtime(ctx, module)
        ledger = self.ledger

        class OfflineBootstrapPrefillManager(common):
            """The tree's manager with its two cluster calls stood in for."""

            def _sync_bootstrap_port_across_nodes(self, local_port: int) -> int:
                ledger.record("bootstrap_port_synced", port=local_port)
                return local_port  # one prefill node: nothing to agree on

            def register_to_bootstrap(self) -> None:
                ledger.record("registered_to_bootstrap", rank_port=self.rank_port)

        OfflineBootstrapPrefillManager.__abstractmethods__ = (
            frozenset()
        )  # the transport methods are never called
        DisaggregationMode = sg("disaggregation.utils").DisaggregationMode
        threads_before = threading.active_count()
        # Releases before the runtime context (0.5.18 and older) read these from ServerArgs:
        # the release's defaults, serving on localhost.
        server_args = release_disagg_defaults()
        server_args.__dict__.update(host=LOCALHOST, port=30000, dist_init_addr=None, pp_size=1)
        self.mgr = OfflineBootstrapPrefillManager(
            _kv_args(), DisaggregationMode.PREFILL, server_args, is_mla_backend=True
        )
        self.threads_started = threading.active_count() - threads_before
        self.constructor_counts_outstanding = hasattr(self.mgr, "_staging_outstanding")
        if counts_outstanding and not self.constructor_counts_outstanding:
            # What a transfer backend's constructor adds (Mooncake's per-room count).
            self.mgr._staging_outstanding = defaultdict(int)
        self.writes = _NoWrites()
        self.writes.mgr = self.mgr
        self.wire = DecodePeerWire(self.ledger, self.writes)
        if (
            wire
        ):  # without it, the pushes go through the tree's own _connect (a case then watches the sockets)
            self.wire.attach(self.mgr)

    # -- the real registry, as the ABORT handler and the worker use it ---------

    def open_room(self, room: int, peers) -> None:
        """A request opens the room (its opening status) and each decode rank's
        transfer info arrives, as the bootstrap thread stores it: the fields the
        prefill reads to reach the rank (0.5.21 fans the drain ACK out from them)."""
        from sglang.srt.disaggregation.base import KVPoll

        self.mgr.update_status(room, KVPoll.Bootstrapping)
        self.mgr.transfer_infos[room] = {
            f"{ip}:{19000 + i}": SimpleNamespace(
                room=room, endpoint=ip, dst_port=port, mooncake_session_id=f"{ip}:{19000 + i}",
                required_dst_info_num=len(peers), is_dummy=False,
            )
            for i, (ip, port) in enumerate(peers)
        }

    def ack_target_args(self, ip: str, port: int) -> tuple:
        """``register_deferred_ack_target``'s arguments after the room: the
        endpoint (0.5.19-0.5.21) or an ``AckTarget`` with the ABORT's generation
        (0.5.22)."""
        target_cls = getattr(self.module, "AckTarget", None)
        if target_cls is not None and "generation" in getattr(target_cls, "_fields", ()):
            return (target_cls(ip, port, 1),)
        return (ip, port)

    def abort_from(self, room: int, ip: str, port: int) -> None:
        """What the ABORT handlers do with a decode rank's ABORT on a deferring
        prefill: mark the room Failed first, register the ACK target, and ACK
        at once if nothing is outstanding."""
        from sglang.srt.disaggregation.base import KVPoll

        self.ledger.record("abort_received", endpoint=f"{ip}:{port}", writes_in_flight=self.writes.in_flight)
        self.mgr.update_status(room, KVPoll.Failed)
        self.mgr.register_deferred_ack_target(room, *self.ack_target_args(ip, port))
        self.mgr._maybe_ack_drained_abort(room)

    def targets_of(self, room: int) -> list[str]:
        """The endpoints whose ACK the room holds (a dict per endpoint from #41402,
        one ``(ip, port)`` before)."""
        held = self.mgr._deferred_ack_targets.get(room)
        if held is None:
            return []
        if isinstance(held, dict):
            return sorted(f"{t[0]}:{t[1]}" for t in held.values())
        return [f"{held[0]}:{held[1]}"]

    def acks_to(self) -> list[str]:
        return [a["endpoint"].replace("tcp://", "") for a in self.ledger.of("drain_ack")]

    def clear_sender(self, room: int, sender_cls=None) -> None:
        """The scheduler clears the room's sender (the tree's real ``clear``)."""
        if sender_cls is None:
            # The common sender as is: its transport methods (poll, failure_exception) are not called.
            sender_cls = type("CommonSenderOfRoom", (self.module.CommonKVSender,), {})
            sender_cls.__abstractmethods__ = frozenset()
        sender = object.__new__(sender_cls)
        sender.__dict__.update(
            kv_mgr=self.mgr, bootstrap_room=room, _owns_bootstrap_room=True, conclude_state=None
        )
        sender.clear()
        self.ledger.record("sender_cleared", room=room)

    def close(self) -> None:
        socket = getattr(self.mgr, "server_socket", None)
        if socket is not None:
            socket.close(linger=0)
        zmq_ctx = getattr(self.mgr, "_zmq_ctx", None)
        if zmq_ctx is not None:
            zmq_ctx.term()


CONSTRUCTED_ROOM = 711  # the room the prefill_drain cases on a constructed manager use


def constructed(ctx, *, counts_outstanding: bool) -> ConstructedPrefillManager:
    return ConstructedPrefillManager(ctx, counts_outstanding=counts_outstanding)


def constructed_details(rig: ConstructedPrefillManager) -> dict[str, Any]:
    """What a case on a constructed manager reports: the constructor's threads, its registration and
    ACKs, and the drain events."""
    return {
        "constructor_started_threads": rig.threads_started,
        "registered_to_bootstrap": rig.ledger.count("registered_to_bootstrap"),
        "acks_to": rig.acks_to(),
        "events": [{k: v for k, v in e.items() if k in ("kind", "endpoint", "writes_in_flight", "room")}
                   for e in rig.ledger.events],
    }
