"""One NIXL prefill rank for the prefill_drain cases (not a probe: no cases here).

The tree's real ``NixlKVManager.transfer_worker`` (its handle barrier and its
failure branch), the real ABORT handler (``_handle_abort_notification``) and the
real ``CommonKVManager`` drain-ACK registry and ``NixlKVSender.clear`` run on a
manager built without its constructor (the constructor creates a NIXL agent and
registers GPU memory). The ``nixl`` package is not imported anywhere: the
module imports without it and only the constructor needs it.

Stand-ins: the NIXL agent (``NixlAgentStandIn``: one handle per posted write,
its state from the probe's plan), the posting calls above it (``send_kvcache``,
``send_aux``, which build NIXL descriptors from GPU pointers), and the ZMQ pushes
to decode (``DecodePeerWire``, shared with the Mooncake rig).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from .. import NotApplicable
from ..standins import (
    DRAIN_EVENT_FIELDS,
    DRAIN_EVENT_KINDS,
    Ledger,
    construct_with,
    pin_runtime,
    sg,
    sg_attr,
)
from ..standins.transfer_engine import DecodePeerWire, WorkerStopped, abort_frames
from .mooncake import constructor_socket_state

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
ROOM = 801
# Two decode ranks of one room (decode TP 2 against prefill TP 1), as in #41402.
DECODE_PEERS = (("10.0.2.1", 17200), ("10.0.2.2", 17201))
UNREADABLE = "NIXL agent could not read the transfer state"  # what the stand-in's unreadable handle raises
ERR_MESSAGES = ("encountered ERR", "left a handle running", UNREADABLE)


class NixlAgentStandIn:
    """Stands for the NIXL agent of one prefill rank: every posted write gets a
    handle whose state (``check_xfer_state``) follows the probe's plan, one
    entry per posted write:

    - ``done``: the write landed (``DONE``);
    - ``err``: the write failed and stopped (``ERR``);
    - ``running``: the write is still landing in decode's pages (``PROC``) until
      the probe calls ``settle()`` -- a sibling of a failed handle;
    - ``hold``: the write is in flight (``PROC``) while ``during`` runs (an ABORT
      arriving mid-transfer) at the worker's first look at the handle, then lands
      (``DONE``);
    - ``unreadable``: the write is still landing, and reading its state raises
      (the agent lost the handle's state, e.g. a backend error) until ``settle()``.

    ``in_flight`` counts ``running`` and ``unreadable`` handles not yet settled, so
    every drain ACK can be recorded with the writes that could still hit decode's pages.
    """

    def __init__(self, ledger: Ledger, plan: list[str] | None = None, during=None) -> None:
        self.ledger = ledger
        self.plan = list(plan or [])
        self.during = during
        self.states: dict[int, str] = {}

    @property
    def in_flight(self) -> int:
        return sum(1 for s in self.states.values() if s in ("PROC", "UNREADABLE"))

    def post(self, kind: str) -> int:
        mode = self.plan.pop(0) if self.plan else "done"
        handle = len(self.states) + 1
        self.states[handle] = {"done": "DONE", "err": "ERR", "running": "PROC", "hold": "HOLD",
                               "unreadable": "UNREADABLE"}[mode]
        self.ledger.record("write_posted", what=kind, room=ROOM, mode=mode)
        return handle

    def check_xfer_state(self, handle) -> str:
        if self.states[handle] == "UNREADABLE":
            raise RuntimeError(f"{UNREADABLE} of handle {handle}")
        if self.states[handle] == "HOLD":
            self.states[handle] = "PROC"  # counted in flight while `during` runs
            if self.during is not None:
                self.during()
            self.states[handle] = "DONE"
            return "PROC"
        return self.states[handle]

    def check_remote_metadata(self, *args, **kwargs) -> bool:
        return True  # the decode peers' metadata is still loaded

    def release_xfer_handle(self, *args, **kwargs) -> None:
        pass

    def settle(self) -> None:
        self.ledger.record("writes_settled", count=self.in_flight)
        for handle, state in self.states.items():
            if state in ("PROC", "UNREADABLE"):
                self.states[handle] = "DONE"


class PausedAtMetadataRead(dict):
    """The manager's ``transfer_infos`` (a plain dict) with one interleaving point:
    the first time the worker reads a room's entry (``get``, ``in``, ``[]``),
    ``during`` runs first, as the scheduler and bootstrap threads would while the
    worker thread is between its status check and its metadata read."""

    def __init__(self, infos: dict, room: int, during) -> None:
        super().__init__(infos)
        self.room, self.during, self.fired = room, during, False

    def _pause(self, key) -> None:
        if key == self.room and not self.fired:
            self.fired = True
            self.during()

    def get(self, key, default=None):
        self._pause(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._pause(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._pause(key)
        return super().__getitem__(key)


def nixl_module():
    module = sg("disaggregation.nixl.conn")
    if not hasattr(module.NixlKVManager, "_maybe_ack_drained_abort"):
        raise NotApplicable(
            "NIXL's prefill has no drain-ACK accounting in this release (no #35049): there is no ACK to "
            "withhold"
        )
    return module


def deferral_flag(cls) -> bool:
    """``CommonKVManager.__init__``'s expression: the env flag, and the class
    capability where the release gates on one (#37454)."""
    envs = sg_attr("environ", "envs")
    flag = bool(getattr(envs, DEFERRED_ENV).get()) if hasattr(envs, DEFERRED_ENV) else False
    if hasattr(sg("disaggregation.common.conn").CommonKVManager, "supports_deferred_decode_kv_release"):
        flag = flag and bool(getattr(cls, "supports_deferred_decode_kv_release", False))
    return flag


class NixlPrefillRig:
    """One NIXL prefill rank (TP 1, MLA layout) with room ``ROOM`` bootstrapped
    by both decode peers."""

    def __init__(self, ctx, *, plan=None) -> None:
        pin_runtime(ctx)
        ctx.setenv(DEFERRED_ENV, "true")
        self.module = nixl_module()
        cls = self.module.NixlKVManager
        # 0.5.22 waits a bounded time for a failed batch's siblings; the sibling
        # here outlives any wait, so do not spend the real 5 s on it.
        ctx.patch_if_present(self.module, "NIXL_ERR_SETTLE_TIMEOUT_S", 0.05)
        from sglang.srt.disaggregation.base import KVPoll

        self.KVPoll = KVPoll
        self.ledger = Ledger()
        self.agent = NixlAgentStandIn(self.ledger, plan)
        self.wire = DecodePeerWire(self.ledger, self.agent)
        mgr = object.__new__(cls)
        mgr.__dict__.update(
            request_status={},
            failure_records={},
            failure_lock=threading.Lock(),
            exceptions={},
            transfer_infos={},
            req_to_decode_prefix_len={},
            decode_kv_args_table={},
            transfer_statuses=defaultdict(lambda: None),
            _staging_outstanding=defaultdict(int),
            _deferred_ack_targets={},
            _deferred_ack_fanout_snapshots={},
            _deferred_ack_poisoned_rooms=set(),  # what the constructor sets, where it does
            _peer_reload_lock=threading.Lock(),
            _staging_ctx=None,
            _staging_handler=None,
            _dcp_pack_buffers=None,
            enable_staging=False,
            enable_trace=False,
            is_mla_backend=True,
            is_hybrid_mla_backend=False,
            attn_tp_rank=0,
            attn_tp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            pp_rank=0,
            pp_size=1,
            transfer_source_rank=0,
            local_ip="10.0.0.2",
            rank_port=18100,
            _kv_replica_factor=1,
            state_layout_rejections={},
            kv_args=SimpleNamespace(kv_data_ptrs=[4096], page_size=1, engine_rank=0, state_types=[]),
            agent=self.agent,
            **constructor_socket_state(),
        )
        if not hasattr(sg("disaggregation.common.conn").CommonKVManager, "poison_deferred_ack_room"):
            del mgr.__dict__["_deferred_ack_poisoned_rooms"]
        mgr.enable_deferred_decode_kv_release = deferral_flag(cls)
        agent = self.agent
        # The descriptor-building calls that post one write each to the agent.
        mgr.send_kvcache = lambda *a, **k: agent.post("kv")
        mgr.send_kvcache_slice = lambda *a, **k: agent.post("kv")
        mgr.send_aux = lambda *a, **k: agent.post("aux")
        mgr.maybe_send_extra = lambda *a, **k: [agent.post("state")]
        self.wire.attach(mgr)
        self.mgr = mgr
        self.abort_reason = None  # what the ABORT handler records: not a failure of the worker
        self._open_room()

    def _open_room(self) -> None:
        mgr = self.mgr
        mgr.update_status(ROOM, self.KVPoll.Bootstrapping)
        import numpy as np

        transfer_info = self.module.TransferInfo
        infos = {}
        for i, (ip, port) in enumerate(DECODE_PEERS):
            agent_name = f"decode-agent-{i}"
            mgr.decode_kv_args_table[agent_name] = SimpleNamespace(
                decode_tp_size=2,
                decode_tp_rank=i,
                requires_dcp_relayout=False,
                kv_xfer_segments=None,
                dst_homogeneous_mem_kind="VRAM",
                dst_kv_ptrs=[8192],
                dst_aux_ptrs=[16384],
                dst_state_data_ptrs=[],
                dst_state_item_lens=[],
                dst_state_dim_per_tensor=[],
                dst_state_layer_ids=[],
                gpu_id=i,
                staging_base_ptr=0,
                staging_total_size=0,
            )
            infos[agent_name] = construct_with(
                transfer_info,
                room=ROOM,
                endpoint=ip,
                dst_port=port,
                agent_name=agent_name,
                dst_kv_indices=np.arange(8, dtype=np.int32),
                dst_aux_index=i,
                required_dst_info_num=len(DECODE_PEERS),
                dst_state_indices=[],
                decode_prefix_len=0,
            )
        mgr.transfer_infos[ROOM] = infos
        mgr.update_status(ROOM, self.KVPoll.WaitingForInput)

    def chunk(self, chunk_id: int, *, last: bool):
        import numpy as np

        chunk_cls = sg("disaggregation.common.utils").TransferKVChunk
        start = 4 * chunk_id
        # 0.5.23 dropped the chunk's (unread) chunk_id field; earlier releases carry it.
        fields = {f.name for f in dataclasses.fields(chunk_cls)}
        numbered = {"chunk_id": chunk_id} if "chunk_id" in fields else {}
        # 0.5.16's chunk has no num_kv_tokens (0.5.17 added it).
        if "num_kv_tokens" in fields:
            numbered["num_kv_tokens"] = 4
        return chunk_cls(
            room=ROOM,
            prefill_kv_indices=np.arange(start, start + 4, dtype=np.int32),
            index_slice=slice(start, start + 4),
            is_last_chunk=last,
            prefill_aux_index=0 if last else None,
            state_indices=None,
            **numbered,
        )

    def run_worker(self, chunks, tolerate: tuple[type, ...] = ()) -> str:
        """The real transfer worker over ``chunks`` until its queue runs dry.
        ``tolerate``: exception types the scenario expects the worker to catch."""
        items = list(chunks)

        def get():
            if items:
                return items.pop(0)
            raise WorkerStopped()

        recorded_before = self.mgr.failure_records.get(ROOM)
        try:
            self.mgr.transfer_worker(SimpleNamespace(get=get, put=items.append))
        except WorkerStopped:
            pass
        failure = self.mgr.exceptions.get(ROOM)
        recorded = self.mgr.failure_records.get(ROOM)
        if failure is None and recorded not in (recorded_before, self.abort_reason):
            # 0.5.23 keeps only the worker's reason, in the failure records the ABORT handler also writes
            failure = recorded
        if failure is not None:
            self.ledger.record("worker_failure", message=str(failure)[:160])
            if not any(m in str(failure) for m in ERR_MESSAGES) and not isinstance(failure, tolerate):
                # The worker's catch-all caught something the plan did not ask
                # for: the rig is wrong for this tree, and a verdict built on it
                # would claim more than ran.
                raise RuntimeError(f"NIXL transfer worker failed unplanned: {failure!r}")
        return "drained"

    def abort_from(self, peer: int) -> None:
        """One decode rank's ABORT for the room reaches this prefill rank."""
        frames = abort_frames(ROOM, DECODE_PEERS[peer])
        self.ledger.record("abort_received", peer=peer, writes_in_flight=self.agent.in_flight)
        self.mgr._handle_abort_notification(frames)
        self.abort_reason = self.mgr.failure_records.get(ROOM)

    def clear_sender(self) -> None:
        """The scheduler clears the room's sender (the real ``NixlKVSender.clear``)."""
        sender = object.__new__(self.module.NixlKVSender)
        sender.__dict__.update(
            kv_mgr=self.mgr, bootstrap_room=ROOM, _owns_bootstrap_room=True, conclude_state=None
        )
        sender.clear()
        self.ledger.record("sender_cleared")

    def summary(self) -> dict[str, Any]:
        acks = self.ledger.of("drain_ack")
        per_peer = {f"{ip}:{port}": 0 for ip, port in DECODE_PEERS}
        for ack in acks:
            key = ack["endpoint"].replace("tcp://", "")
            per_peer[key] = per_peer.get(key, 0) + 1
        return {
            "deferred_release": bool(self.mgr.enable_deferred_decode_kv_release),
            "acks_per_peer": per_peer,
            "acks_while_writes_in_flight": sum(1 for a in acks if a["writes_in_flight"]),
            "writes_posted": [e["mode"] for e in self.ledger.of("write_posted")],
            "room_poisoned": ROOM in getattr(self.mgr, "_deferred_ack_poisoned_rooms", ()),
            "events": self.ledger.projected((*DRAIN_EVENT_KINDS, "worker_failure"), DRAIN_EVENT_FIELDS),
        }
