"""The Mooncake managers of 0.4.5.post1 - 0.4.9 on both sides of a refused room, for the refused_room
cases on releases without a decode waiting timeout (not a probe: no cases here).

``MooncakeSide``: one rank's real ``MooncakeKVManager`` built by its constructor in prefill or decode
mode, its thread bodies captured and run on demand; ``refuse_at_prefill``: the real prefill door
refuses a request while decode's registration arrives before or after, and what prefill sent decode is
recorded; ``status_frames``: a status as the tree's own ``sync_status_to_decode_endpoint`` sends it;
``decode_rig``/``decode_receiver``: the tree's decode transfer queue and a registered receiver.
Stand-ins: the transfer engine, the ZMQ sockets, the bootstrap server's HTTP registration, the page
pool and the metadata allocator (probes/rigs/failed_transfer.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from .. import NotApplicable
from ..standins import make_req, reject_at_intake, sg
from .door import REJECTION, DoorRig
from .failed_transfer import TransferRig
from .mooncake_decode import Feed, capture_threads, run_captured

REFUSED_ROOM = 4242
VALID_ROOM = 4243
DECODE_IP = "10.0.1.1"
DECODE_PORT = 17100
DECODE_SESSION = "10.0.1.1:19000"
PROMPT_PAGES = 4


def decode_waiting_timeout(module) -> bool:
    """Decode's receiver or manager (or a class they inherit from) reads a waiting timeout: the
    path, besides a status from prefill, that fails a room and releases its pages."""
    import inspect

    classes = [*module.MooncakeKVReceiver.__mro__, *module.MooncakeKVManager.__mro__]
    return any("waiting_timeout" in inspect.getsource(cls)
               for cls in classes if cls.__module__.startswith("sglang."))


class MooncakeSide:
    """One Mooncake rank (TP 1) built by the tree's own constructor; its thread bodies are
    captured instead of started, and run here on demand."""

    def __init__(self, ctx, mode: str, wire: list) -> None:
        module = sg("disaggregation.mooncake.conn")
        if decode_waiting_timeout(module):
            raise NotApplicable(
                "decode has a waiting timeout (SGLANG_DISAGGREGATION_WAITING_TIMEOUT): it fails a room no "
                "status reaches and releases its reservation, as 0.5.22 does"
            )
        if not hasattr(module.MooncakeKVManager, "start_prefill_thread"):
            raise NotApplicable("the Mooncake manager layouts of 0.4.5.post1 - 0.4.9 are not in this tree")
        # From 0.4.7 prefill's transfers run on transfer_worker methods, one per queue.
        self.sharded = hasattr(module.MooncakeKVManager, "transfer_worker")
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.socket_in = Feed()
        self.threads, self.workers = capture_threads(ctx, module)
        ctx.patch(module, "MooncakeTransferEngine", lambda **kw: SimpleNamespace(
            register=lambda *a: None, get_session_id=lambda: "10.0.0.1:19500"))
        ctx.patch(module, "get_free_port", lambda: 18000)
        for name in ("get_local_ip_by_remote", "get_local_ip_auto"):  # 0.4.8 renames it
            if hasattr(module, name):
                ctx.patch(module, name, lambda: "10.0.0.1")
        if self.sharded:
            ctx.patch(module, "FastQueue", Feed)  # each worker's queue, fed by the case
        ctx.patch(
            module,
            "requests",
            SimpleNamespace(put=lambda *a, **k: SimpleNamespace(status_code=200, text=""),
                            Session=SimpleNamespace),
        )
        # 0.4.6.post5's sender pool is cpu_count // 4 threads: 0 on this 2-core host
        ctx.patch(os, "cpu_count", lambda: 4)
        zmq_socket = SimpleNamespace(bind=lambda *a: None, recv_multipart=self.socket_in.get)
        ctx.patch(
            module,
            "zmq",
            SimpleNamespace(Context=lambda: SimpleNamespace(socket=lambda kind: zmq_socket), PULL=0, PUSH=1),
        )
        args = SimpleNamespace(kv_data_ptrs=[4096], kv_data_lens=[4096], aux_data_ptrs=[8192],
                               aux_data_lens=[64], gpu_id=0, ib_device=None, engine_rank=0)
        server_args = SimpleNamespace(disaggregation_bootstrap_port=8998, dist_init_addr=None, tp_size=1,
                                      dp_size=1, enable_dp_attention=False)
        self.mgr = module.MooncakeKVManager(args, getattr(DisaggregationMode, mode), server_args)
        self.module = module
        if mode == "PREFILL" and not self.sharded:
            self.mgr.transfer_queue = Feed()
        # Prefill's pushes to decode: recorded on the wire decode reads.
        self.mgr._connect = lambda endpoint: SimpleNamespace(
            send_multipart=lambda frames: wire.append(
                {"endpoint": endpoint, "frames": [bytes(f) for f in frames]}
            )
        )

    def run(self, name: str) -> None:
        if name == "transfer_thread" and self.sharded:
            for target, args in self.workers:
                run_captured(target, *args)
        else:
            run_captured(self.threads[name])


class _EmptyRows:
    """Any buffer, any row: None (what get_buf is run over to count its fields)."""

    def __getattr__(self, name: str) -> dict:
        import collections

        return collections.defaultdict(lambda: None)


class FirstTokenBuffers:
    """Stands for decode's metadata buffers: a transferred room's first output token, read
    through ``get_buf`` (its first field; the logprob fields only for logprob requests), or up
    to 0.4.6.post4 as row ``idx`` of the buffer list's first tensor."""

    def get_buf(self, idx: int):
        import torch

        # As many fields as the tree's own get_buf returns (0.4.8 adds the hidden states
        # second): it is run over rows that hold nothing, then the first is the token.
        rows = _EmptyRows()
        real = getattr(sg("disaggregation.utils"), "MetadataBuffers", None)
        width = len(real.get_buf(rows, idx)) if hasattr(real, "get_buf") else 5
        return (torch.tensor([7]),) + (None,) * (width - 1)

    def __getitem__(self, field: int):
        import torch

        return torch.full((16, 1), 7)


def registration(room: int) -> list[bytes]:
    """Decode's pre-allocation message for `room` (MooncakeKVReceiver.init's frames), in the
    release's own layout: ``TransferInfo.from_zmq`` reads the frames in its fields' order
    (0.4.5.x also sends decode's buffer pointers; 0.4.6.post4 adds the rank count)."""
    import dataclasses
    import struct

    import numpy as np

    value = {
        "room": str(room).encode(),
        "endpoint": DECODE_IP.encode(),
        "dst_port": str(DECODE_PORT).encode(),
        "mooncake_session_id": DECODE_SESSION.encode(),
        "dst_kv_ptrs": struct.pack("Q", 8192),
        "dst_kv_indices": np.arange(PROMPT_PAGES, dtype=np.int64).tobytes(),
        "dst_aux_ptrs": struct.pack("Q", 16384),
        "dst_aux_index": b"0",
        "required_dst_info_num": b"1",
    }
    fields = [f.name for f in dataclasses.fields(sg("disaggregation.mooncake.conn").TransferInfo)]
    return [value[name] for name in fields if name != "is_dummy"]  # is_dummy is derived, not sent


def refuse_at_prefill(ctx, *, register_first: bool) -> dict[str, Any]:
    """Prefill's door refuses the room's request; decode's registration arrives before or after."""
    wire: list = []
    prefill = MooncakeSide(ctx, "PREFILL", wire)
    kept = getattr(prefill.module, "REFUSED_ROOMS_KEPT", None)
    if register_first and kept is not None:
        # A registration already stored is reported even when the memory of refused rooms
        # (kept only for late registrations) is full: keep none, so the room is forgotten at
        # once. Restored below: the other order needs the memory.
        prefill.module.REFUSED_ROOMS_KEPT = 0
    doors = DoorRig(ctx)
    doors.prefill_queue.kv_manager = prefill.mgr
    req = make_req("refused", 9000, room=REFUSED_ROOM)
    reject_at_intake(req, REJECTION)
    steps = ["register", "refuse"] if register_first else ["refuse", "register"]
    try:
        for step in steps:
            if step == "register":
                prefill.socket_in.put(registration(REFUSED_ROOM))
                prefill.run("bootstrap_thread")
            else:
                doors.prefill_door(req)
            prefill.run("transfer_thread")
    finally:
        if kept is not None:
            prefill.module.REFUSED_ROOMS_KEPT = kept
    return {
        "order": " then ".join(steps),
        "sender_created": getattr(req, "disagg_kv_sender", None) is not None,
        "reports": [
            {"endpoint": m["endpoint"], "room": m["frames"][0].decode(), "status": m["frames"][1].decode()}
            for m in wire
        ],
        "prefill_keeps_registration": REFUSED_ROOM in prefill.mgr.transfer_infos,
        "wire": wire,
        "prefill": prefill,
    }


def status_frames(prefill: MooncakeSide, room: int, status: int) -> list[bytes]:
    """What the tree's own ``sync_status_to_decode_endpoint`` sends decode for `room`: up to
    0.4.6.post5 it reads the status prefill recorded, from 0.4.7 it takes it, and from
    0.4.8.post1 a third frame names the prefill rank."""
    import inspect

    prefill.mgr.update_status(room, status)
    params = inspect.signature(prefill.mgr.sync_status_to_decode_endpoint).parameters
    extra = {"status": status} if "status" in params else {}
    if "prefill_rank" in params:
        extra["prefill_rank"] = 0
    sent: list = []
    prefill.mgr._connect = lambda endpoint: SimpleNamespace(
        send_multipart=lambda frames: sent.append([bytes(f) for f in frames]))
    prefill.mgr.sync_status_to_decode_endpoint(DECODE_IP, DECODE_PORT, room, **extra)
    [frames] = sent
    return frames


def decode_rig(ctx) -> TransferRig:
    """The tree's decode transfer queue, reading its receivers' own polls."""
    rig = TransferRig(ctx)
    rig.queue.metadata_buffers = FirstTokenBuffers()
    rig.poll_receivers(ctx)
    return rig


def decode_receiver(decode: MooncakeSide, room: int):
    """The tree's ``MooncakeKVReceiver`` for `room`, bootstrapped and registered with prefill."""
    from sglang.srt.disaggregation.base import KVPoll

    recv = object.__new__(decode.module.MooncakeKVReceiver)
    # conclude_state and init_time: 0.4.7's poll reads them (no conclusion yet)
    recv.__dict__.update(kv_mgr=decode.mgr, bootstrap_room=room, conclude_state=None, init_time=None)
    # from 0.4.8.post1 the receiver records how many prefill ranks answer the room (one here)
    if hasattr(decode.mgr, "required_prefill_response_num_table"):
        decode.mgr.required_prefill_response_num_table[room] = 1
    decode.mgr.update_status(room, KVPoll.WaitingForInput)
    return recv
