"""Prefill-side drain ACKs (#35049, #40645, #41402 and 0.5.22's failed-send
rule; issue 13).

Decode holds a failed request's pages until every prefill rank ACKs that its
writes into them drained. The ACK comes from the prefill: the Mooncake
transfer worker counts a room's chunks in flight (``_staging_outstanding``)
and ``CommonKVManager._maybe_ack_drained_abort`` sends the ACK once the count
is zero to every decode endpoint that sent an ABORT. A send that fails on the
transfer engine's wall-clock timeout leaves the batch still writing while the
worker decrements the count, so an ACK sent then lets decode free pages a
write can still land on. 0.5.22 withholds the ACK for such a room for good
(``poison_deferred_ack_room``, ``_poison_unsettled_send``); decode falls back
to its release timeout.

How it is driven: the tree's real ``MooncakeKVManager.transfer_worker`` (its
failure branches, the outstanding count, the drain ACK), the real ABORT
handler (the bootstrap thread's loop body, run in the probe's thread; the
``_handle_abort_notification`` method from 0.5.22), the real
``CommonKVManager`` ACK registry and the real ``CommonKVSender.clear``, on a
manager built without its network constructor. Stand-ins: the transfer
engine under ``send_kvcache``/``send_aux`` (``TransferEngineStandIn``: writes
complete, time out while still running, are held in flight, or crash the
worker), the ZMQ pushes to decode (``DecodePeerWire``), the server socket the
ABORTs arrive on, the DSA/CP layout decision (no skipping). Two decode
ranks share the room (decode TP 2 against prefill TP 1), each with its own
endpoint, as in #41402.

These cases run with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``
on (the default from 0.5.21 and in the patched trees; an opt-in on 0.5.19 and
0.5.20) except ``without_capability_keeps_immediate_ack``, which turns it off
as a backend without the capability has it. On 0.5.17/0.5.18 the prefill has
no drain-ACK accounting (no #35049): those cases are ``not-applicable``.

Not driven here: NIXL's worker (needs a NIXL agent stand-in for its handle
states) and Ascend's own ``send_kvcache``; both reach the drain ACK through
the same ``CommonKVManager`` registry, and Ascend through this very worker.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from probes import SAFE, UNSAFE, NotApplicable, Outcome, case
from probes.standins import (
    DecodePeerWire,
    Ledger,
    TransferEngineStandIn,
    WorkerStopped,
    pin_runtime,
    sg,
    sg_attr,
)


def _kv_indices(count: int):
    """Page indices as the transfer worker gets them (numpy int32), imported inside the probe
    environment only: the toolkit reads the case registry without numpy."""
    import numpy as np

    return np.arange(count, dtype=np.int32)

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
ROOM = 701
# Two decode ranks of one room: (ip, port) each receives status and ABORT_ACK.
DECODE_PEERS = (("10.0.1.1", 17100), ("10.0.1.2", 17101))


def _mooncake():
    module = sg("disaggregation.mooncake.conn")
    cls = module.MooncakeKVManager
    if not hasattr(cls, "_maybe_ack_drained_abort"):
        raise NotApplicable(
            "the prefill has no drain-ACK accounting in this release (no #35049): its ABORT handler "
            "answers at once with an ABORT_ACK that decode does not wait for"
        )
    return module, cls


def _flag(cls) -> bool:
    """``CommonKVManager.__init__``'s expression: the env flag, and the class
    capability where the release has one."""
    envs = sg_attr("environ", "envs")
    flag = bool(getattr(envs, DEFERRED_ENV).get()) if hasattr(envs, DEFERRED_ENV) else False
    if hasattr(cls, "supports_deferred_decode_kv_release"):
        flag = flag and bool(cls.supports_deferred_decode_kv_release)
    return flag


class PrefillRig:
    """One prefill rank (Mooncake, TP 1) with room ``ROOM`` bootstrapped by
    both decode peers, a chunk ready to send, and the stand-in engine."""

    def __init__(self, ctx, *, deferred: bool = True, plan=None) -> None:
        pin_runtime(ctx)
        ctx.setenv(DEFERRED_ENV, "true" if deferred else "false")
        self.module, cls = _mooncake()
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
        }
        if hasattr(common, "poison_deferred_ack_room"):
            state["_deferred_ack_poisoned_rooms"] = set()  # what its constructor sets
        mgr.__dict__.update(state)
        mgr.enable_deferred_decode_kv_release = _flag(cls)
        engine = self.engine
        # The transfer engine below the worker, and the wire to decode.
        mgr.send_kvcache = lambda *a, **k: engine.submit("kv", ROOM)
        mgr.send_kvcache_slice = lambda *a, **k: engine.submit("kv", ROOM)
        mgr.maybe_send_extra = lambda *a, **k: engine.submit("state", ROOM)
        mgr.send_aux = lambda *a, **k: engine.submit("aux", ROOM)
        mgr._send_multipart_locked = self.wire.send
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
                dst_kv_indices=_kv_indices(4),
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
            prefill_kv_indices=_kv_indices(4),
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
        ip, port = DECODE_PEERS[peer]
        frames = [b"ABORT", str(ROOM).encode(), ip.encode(), str(port).encode()]
        if sg_attr("disaggregation.common.conn", "AbortNotification") is not None:
            frames.append(b"1")  # the ABORT generation (0.5.22 frames)
        self.ledger.record("abort_received", peer=peer, writes_in_flight=self.engine.in_flight)
        if hasattr(self.mgr, "_handle_abort_notification"):
            self.mgr._handle_abort_notification(frames)
            return
        # Older releases handle ABORT inside the bootstrap thread's loop: run
        # that loop body here, in this thread, over this one message.
        captured = []
        threading_standin = SimpleNamespace(
            Thread=lambda target=None, **kw: captured.append(target) or SimpleNamespace(start=lambda: None),
            Lock=threading.Lock,
        )
        with _swapped(self.module, "threading", threading_standin):
            self.mgr.start_prefill_thread()
        self.pending_frames = [frames]
        try:
            captured[0]()
        except WorkerStopped:
            pass

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
            "events": [
                {k: v for k, v in e.items() if k in ("kind", "peer", "endpoint", "writes_in_flight", "mode", "message")}
                for e in self.ledger.events
                if e["kind"] in ("abort_received", "drain_ack", "write_posted", "writes_settled", "worker_died", "sender_cleared")
            ],
        }


class _swapped:
    def __init__(self, obj, name, value) -> None:
        self.obj, self.name, self.value = obj, name, value

    def __enter__(self):
        self.old = getattr(self.obj, self.name)
        setattr(self.obj, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.old)


def _verdict_no_ack_in_flight(rig: PrefillRig, safe_text: str, what: str) -> Outcome:
    details = rig.summary()
    early = details["acks_while_writes_in_flight"]
    # Duplicate ACKs are reported, not judged: decode counts ACKs per prefill
    # rank in a set, so a second one cannot release anything earlier.
    if early == 0:
        return Outcome(SAFE, safe_text, details)
    return Outcome(UNSAFE, f"{early} drain ACK(s) sent while a write {what} was still in flight.", details)


# ---------------------------------------------------------------------------


@case(
    must_preserve=False,
    expect="After a send that timed out with its write still running, no drain ACK leaves (during the transfer, "
    "after the failure, after clear(), or for a late ABORT) while the write is still running.",
)
def failed_send_withholds_ack_while_writes_in_flight(ctx) -> Outcome:
    rig = PrefillRig(ctx, plan=["timeout"])
    # Decode rank 0 aborts while the transfer is running (its own timeout).
    original_submit = rig.engine.submit

    def submit_with_abort(kind, room):
        ret = original_submit(kind, room)
        if kind == "kv" and not rig.ledger.count("abort_received"):
            rig.abort_from(0)
        return ret

    rig.engine.submit = submit_with_abort
    ended = rig.run_worker([rig.chunk()])
    # Decode saw Failed and (since #41404) sends ABORT on every failure.
    rig.abort_from(1)
    rig.clear_sender()
    rig.abort_from(0)  # a late duplicate after clear()
    rig.engine.settle()
    outcome = _verdict_no_ack_in_flight(
        rig,
        "No drain ACK left while the timed-out write was in flight (the room's ACK is withheld; decode "
        "releases on its timeout).",
        "of the failed send",
    )
    outcome.details["worker"] = ended
    return outcome


@case(
    must_preserve=False,
    expect="When ABORTs from both decode peers arrive while a write is in flight and the write then completes, "
    "each peer gets its drain ACK, after the write landed.",
)
def abort_during_transfer_acks_each_peer_once_after_drain(ctx) -> Outcome:
    rig = PrefillRig(ctx, plan=["hold"])
    rig.engine.during = lambda: (rig.abort_from(0), rig.abort_from(1))
    ended = rig.run_worker([rig.chunk()])
    rig.clear_sender()
    outcome = _verdict_no_ack_in_flight(rig, "", "")
    counts = outcome.details["acks_per_peer"]
    outcome.details["worker"] = ended
    if outcome.verdict == SAFE and all(n >= 1 for n in counts.values()):
        return Outcome(SAFE, f"Each decode peer got its drain ACK after the write landed ({counts}).", outcome.details)
    if outcome.verdict == SAFE:
        return Outcome(UNSAFE, f"A decode peer that asked got no drain ACK: {counts}.", outcome.details)
    return outcome


@case(
    must_preserve=False,
    expect="ABORTs that arrive before the chunk is sent are ACKed to each decode peer and nothing is written "
    "after the ACK.",
)
def abort_before_transfer_acks_each_peer_once(ctx) -> Outcome:
    rig = PrefillRig(ctx)
    rig.abort_from(0)
    rig.abort_from(1)
    mark = rig.ledger.mark()
    ended = rig.run_worker([rig.chunk()])
    rig.clear_sender()
    details = rig.summary()
    details["worker"] = ended
    written_after = rig.ledger.since(mark).count("write_posted")
    counts = details["acks_per_peer"]
    details["writes_after_abort"] = written_after
    if written_after == 0 and all(n >= 1 for n in counts.values()):
        return Outcome(SAFE, f"The chunk was skipped and each decode peer got its ACK ({counts}).", details)
    return Outcome(UNSAFE, f"Writes after the ABORT: {written_after}; ACKs per peer: {counts}.", details)


@case(
    must_preserve=False,
    expect="ABORTs for a room whose transfer already succeeded are ACKed to each decode peer, with nothing in flight.",
)
def abort_after_transfer_acks_each_peer_once(ctx) -> Outcome:
    rig = PrefillRig(ctx)
    ended = rig.run_worker([rig.chunk()])
    status = rig.mgr.request_status.get(ROOM)
    rig.abort_from(0)
    rig.abort_from(1)
    outcome = _verdict_no_ack_in_flight(rig, "", "")
    counts = outcome.details["acks_per_peer"]
    outcome.details.update(worker=ended, status_after_transfer=getattr(status, "name", str(status)))
    if outcome.verdict == SAFE and all(n >= 1 for n in counts.values()):
        return Outcome(SAFE, f"Each decode peer got its ACK for the concluded room ({counts}).", outcome.details)
    if outcome.verdict == SAFE:
        return Outcome(UNSAFE, f"A decode peer that asked got no ACK for the concluded room: {counts}.", outcome.details)
    return outcome


@case(
    must_preserve=False,
    expect="When the transfer worker dies with a write posted, no drain ACK leaves for the room while it runs "
    "(ABORTs, clear()).",
)
def worker_crash_withholds_ack(ctx) -> Outcome:
    rig = PrefillRig(ctx, plan=["crash"])
    ended = rig.run_worker([rig.chunk()])
    if ended != "died" or "crash" not in rig.summary()["writes_posted"]:
        raise RuntimeError(f"the worker did not die on the planned crash (it {ended})")
    rig.abort_from(0)
    rig.clear_sender()
    rig.abort_from(1)
    rig.engine.settle()
    outcome = _verdict_no_ack_in_flight(
        rig, "No drain ACK left for the dead worker's room while its write was in flight.", "of the dead worker"
    )
    outcome.details["worker"] = ended
    return outcome


@case(
    must_preserve=True,
    expect="A transfer whose writes all complete reaches Success, tells each decode peer once, and sends no ACK.",
)
def successful_transfer_untouched(ctx) -> Outcome:
    rig = PrefillRig(ctx)
    ended = rig.run_worker([rig.chunk()])
    status = rig.mgr.request_status.get(ROOM)
    details = rig.summary()
    poisoned = ROOM in getattr(rig.mgr, "_deferred_ack_poisoned_rooms", ())
    details.update(
        worker=ended,
        status=getattr(status, "name", str(status)),
        status_messages=rig.ledger.count("status_to_decode"),
        room_poisoned=poisoned,
    )
    ok = (
        status == rig.KVPoll.Success
        and details["status_messages"] == len(DECODE_PEERS)
        and not rig.acks()
        and not poisoned
    )
    if ok:
        return Outcome(SAFE, "Success, one status message per decode peer, no ACK, room not poisoned.", details)
    return Outcome(UNSAFE, "The successful transfer did not conclude as before.", details)


@case(
    must_preserve=True,
    expect="Without the drain-ACK capability (deferred release off) an ABORT after a failed send is answered at "
    "once, as before: decode releases immediately and waits for nothing.",
)
def without_capability_keeps_immediate_ack(ctx) -> Outcome:
    rig = PrefillRig(ctx, deferred=False, plan=["timeout"])
    ended = rig.run_worker([rig.chunk()])
    rig.abort_from(0)
    details = rig.summary()
    details.update(worker=ended, deferred_release=bool(rig.mgr.enable_deferred_decode_kv_release))
    acks = details["acks_per_peer"]
    first = f"{DECODE_PEERS[0][0]}:{DECODE_PEERS[0][1]}"
    if not details["deferred_release"] and acks.get(first) == 1:
        return Outcome(SAFE, "The ABORT was answered at once with one legacy ABORT_ACK.", details)
    return Outcome(UNSAFE, f"The legacy ABORT answer changed: ACKs per peer {acks}.", details)
