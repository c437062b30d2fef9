"""One Mooncake prefill rank for the prefill_drain cases (not a probe: no cases here).

The tree's real ``MooncakeKVManager`` transfer worker, ABORT handling (the handler, or the
bootstrap thread's loop body on releases that handle ABORT there) and ``CommonKVManager``
drain-ACK bookkeeping, on a manager built without its constructor (the constructor registers
RDMA memory with the Mooncake transfer engine). Stand-ins: the transfer engine
(``TransferEngineStandIn``: its writes complete, fail, time out while still running, stay in
flight or crash the worker, as the case plans) and the ZMQ pushes to decode (``DecodePeerWire``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from .. import NotApplicable
from ..standins import DRAIN_EVENT_FIELDS, DRAIN_EVENT_KINDS, Ledger, pin_runtime, sg, sg_attr
from ..standins.transfer_engine import DecodePeerWire, TransferEngineStandIn, WorkerStopped, abort_frames


def kv_indices(count: int):
    """Page indices as the transfer worker gets them (numpy int32), imported inside the probe
    environment only: the toolkit reads the case registry without numpy."""
    import numpy as np

    return np.arange(count, dtype=np.int32)

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
ROOM = 701
# Two decode ranks of one room: (ip, port) each receives status and ABORT_ACK.
DECODE_PEERS = (("10.0.1.1", 17100), ("10.0.1.2", 17101))


def mooncake_module():
    module = sg("disaggregation.mooncake.conn")
    cls = module.MooncakeKVManager
    if not hasattr(cls, "_maybe_ack_drained_abort"):
        raise NotApplicable(
            "the prefill has no drain-ACK accounting in this release (no #35049): its ABORT handler "
            "answers at once with an ABORT_ACK that decode does not wait for"
        )
    return module, cls


def deferral_flag(cls) -> bool:
    """``CommonKVManager.__init__``'s expression: the env flag, and the class
    capability where the release has one."""
    envs = sg_attr("environ", "envs")
    flag = bool(getattr(envs, DEFERRED_ENV).get()) if hasattr(envs, DEFERRED_ENV) else False
    if hasattr(cls, "supports_deferred_decode_kv_release"):
        flag = flag and bool(cls.supports_deferred_decode_kv_release)
    return flag


def constructor_socket_state() -> dict[str, Any]:
    """The push-socket state ``CommonKVManager.__init__`` sets up from 0.5.14 (0.5.13 caches in
    ``_connect`` itself): the socket cache, its lock, and the per-endpoint send locks (0.5.17's table;
    the pack's pr35049-ack adds it on 0.5.13 - 0.5.16). Set on every release, as the constructor of a
    tree that pushes under the lock has it: a manager without the table loses every push it locks."""
    return {
        "_socket_cache": {},
        "_monitor_cache": {},
        "_socket_lock": threading.Lock(),
        "_socket_send_locks": {},
    }


class PrefillRig:
    """One prefill rank (Mooncake, TP 1) with room ``ROOM`` bootstrapped by
    both decode peers, a chunk ready to send, and the stand-in engine."""

    def __init__(self, ctx, *, deferred: bool = True, plan=None) -> None:
        pin_runtime(ctx)
        ctx.setenv(DEFERRED_ENV, "true" if deferred else "false")
        self.module, cls = mooncake_module()
        from sglang.srt.disaggregation.base import KVPoll

        self.KVPoll = KVPoll
        self.ledger = Ledger()
        self.engine = TransferEngineStandIn(self.ledger, plan)
        self.planned = list(plan or [])
        self.wire = DecodePeerWire(self.ledger, self.engine)
        self.pending_frames: list[list[bytes]] = []
        mgr = object.__new__(cls)
        common = sg("disaggregation.common.conn").CommonKVManager
        state: dict[str, Any] = {
            "request_status": {},
            "failure_records": {},
            "failure_lock": threading.Lock(),
            "transfer_infos": {},
            "req_to_decode_prefix_len": {},
            "decode_kv_args_table": {},
            "session_lock": threading.Lock(),
            "failed_sessions": set(),
            "session_failures": defaultdict(int),
            "_staging_outstanding": defaultdict(int),
            "_deferred_ack_targets": {},
            "_deferred_ack_fanout_snapshots": {},
            "_worker_threads": [],
            "state_layout_rejections": {},  # 0.5.22: no decode peer's state layout was rejected
            "_stopped": False,
            "enable_trace": False,
            "enable_staging": False,
            "is_mla_backend": True,
            "is_hybrid_mla_backend": False,
            "attn_tp_rank": 0,
            "attn_tp_size": 1,
            "attn_cp_rank": 0,
            "attn_cp_size": 1,
            "pp_rank": 0,
            "pp_size": 1,
            "bootstrap_port": 8998,
            "local_ip": "10.0.0.1",
            "rank_port": 18000,
            "deferred_bootstrap": None,
            "_kv_replica_factor": 1,
            "kv_args": SimpleNamespace(kv_data_ptrs=[4096], engine_rank=0, state_types=[]),
            "server_socket": SimpleNamespace(recv_multipart=self._next_frames),
            **constructor_socket_state(),
        }
        if hasattr(common, "poison_deferred_ack_room"):
            state["_deferred_ack_poisoned_rooms"] = set()  # what its constructor sets
        mgr.__dict__.update(state)
        mgr.enable_deferred_decode_kv_release = deferral_flag(cls)
        engine = self.engine
        # The transfer engine below the worker, and the wire to decode.
        mgr.send_kvcache = lambda *a, **k: engine.submit("kv", ROOM)
        mgr.send_kvcache_slice = lambda *a, **k: engine.submit("kv", ROOM)
        mgr.maybe_send_extra = lambda *a, **k: engine.submit("state", ROOM)
        mgr.send_aux = lambda *a, **k: engine.submit("aux", ROOM)
        self.wire.attach(mgr)
        mgr._make_worker_recv = lambda sock: self._next_frames
        mgr._get_dsa_cache_transfer_skip_flags = lambda info: (False, False)
        self.mgr = mgr
        self._open_room()

    # -- setup ---------------------------------------------------------------

    def _open_room(self) -> None:
        mgr = self.mgr
        mgr.update_status(ROOM, self.KVPoll.Bootstrapping)
        infos = {}
        for i, (ip, port) in enumerate(DECODE_PEERS):
            session = f"{ip}:{19000 + i}"
            mgr.decode_kv_args_table[session] = SimpleNamespace(
                requires_dcp_relayout=False,
                dst_kv_ptrs=[8192],
                dst_kv_layer_ids=None,
                dst_kv_item_len=64,
                dst_attn_tp_size=2,
                dst_tp_rank=i,
                dst_aux_ptrs=[16384],
                staging_base_ptr=0,
                staging_total_size=0,
            )
            # What decode registered for the room (TransferInfo's fields the worker reads).
            infos[session] = SimpleNamespace(
                room=ROOM,
                endpoint=ip,
                dst_port=port,
                mooncake_session_id=session,
                dst_kv_indices=kv_indices(4),
                dst_device_kv_indices=None,
                dst_aux_index=i,
                dst_state_indices=[],
                required_dst_info_num=len(DECODE_PEERS),
                is_dummy=False,
                decode_prefix_len=0,
            )
        mgr.transfer_infos[ROOM] = infos
        mgr.update_status(ROOM, self.KVPoll.WaitingForInput)

    def chunk(self):
        chunk_cls = sg("disaggregation.common.utils").TransferKVChunk
        return chunk_cls(
            room=ROOM,
            prefill_kv_indices=kv_indices(4),
            index_slice=slice(0, 4),
            is_last_chunk=True,
            prefill_aux_index=0,
            state_indices=None,
        )

    # -- the real code paths ---------------------------------------------------

    def run_worker(self, chunks) -> str:
        """The real transfer worker over ``chunks`` until its queue runs dry;
        returns how it ended ("drained" or "died")."""
        items = list(chunks)

        def get():
            if items:
                return items.pop(0)
            raise WorkerStopped()

        try:
            self.mgr.transfer_worker(SimpleNamespace(get=get), executor=None)
        except WorkerStopped:
            return "drained"
        except RuntimeError as exc:  # the worker's own crash path re-raises
            self.ledger.record("worker_died", message=str(exc)[:160])
            if "crash" not in self.planned:
                # Not the crash the case asked for: the rig is wrong for this
                # tree, and a verdict built on it would claim more than ran.
                raise RuntimeError(f"transfer worker died unplanned: {exc}") from exc
            return "died"
        return "returned"

    def abort_from(self, peer: int) -> None:
        """One decode rank's ABORT for the room reaches this prefill rank."""
        frames = abort_frames(ROOM, DECODE_PEERS[peer])
        self.ledger.record("abort_received", peer=peer, writes_in_flight=self.engine.in_flight)
        if hasattr(self.mgr, "_handle_abort_notification"):
            self.mgr._handle_abort_notification(frames)
            return
        # Older releases handle ABORT inside the bootstrap thread's loop: run
        # that loop body here, in this thread, over this one message.
        deliver_to_bootstrap_thread(self, frames)

    def _next_frames(self, *args, **kwargs):
        if self.pending_frames:
            return self.pending_frames.pop(0)
        raise WorkerStopped()

    def clear_sender(self) -> None:
        """The scheduler clears the room's sender (real ``CommonKVSender.clear``)."""
        sender = object.__new__(self.module.MooncakeKVSender)
        sender.__dict__.update(
            kv_mgr=self.mgr, bootstrap_room=ROOM, _owns_bootstrap_room=True, conclude_state=None
        )
        sender.clear()
        self.ledger.record("sender_cleared")

    # -- what decode saw -------------------------------------------------------

    def acks(self) -> list[dict[str, Any]]:
        return self.ledger.of("drain_ack")

    def summary(self) -> dict[str, Any]:
        per_peer = {f"{ip}:{port}": 0 for ip, port in DECODE_PEERS}
        for ack in self.acks():
            key = ack["endpoint"].replace("tcp://", "")
            per_peer[key] = per_peer.get(key, 0) + 1
        return {
            "acks_per_peer": per_peer,
            "acks_while_writes_in_flight": sum(1 for a in self.acks() if a["writes_in_flight"]),
            "writes_posted": [e["mode"] for e in self.ledger.of("write_posted")],
            "events": self.ledger.projected((*DRAIN_EVENT_KINDS, "worker_died"), DRAIN_EVENT_FIELDS),
        }


class swapped:
    def __init__(self, obj, name, value) -> None:
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self):
        self.old = getattr(self.obj, self.name)
        setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.old)


def deliver_to_bootstrap_thread(rig: PrefillRig, frames: list[bytes]) -> None:
    """One message reaches the prefill's bootstrap thread: its real loop body, run in this thread."""
    captured = []
    threading_standin = SimpleNamespace(
        Thread=lambda target=None, **kw: captured.append(target) or SimpleNamespace(start=lambda: None),
        Lock=threading.Lock,
    )
    with swapped(rig.module, "threading", threading_standin):
        rig.mgr.start_prefill_thread()
    rig.pending_frames = [frames]
    try:
        captured[0]()
    except WorkerStopped:
        pass
