"""One decode rank's real ``MooncakeKVManager`` (DECODE mode, 0.4.7 - 0.5.12.post1), built by its
constructor, for the cases of this pack's ``sbp-abort-hold`` and ``sbp-refused-hold`` (not a probe: no
cases here); ``build_manager`` builds either mode (probes/rigs/mooncake_prefill.py: PREFILL).

The tree's own constructor runs (``CommonKVManager.__init__`` binds a real ZMQ PULL socket on
127.0.0.1, which is closed at once), so whatever it sets up for decode is what the cases use; its
decode thread body is captured instead of started and run here over the status messages a case
delivers, as prefill ranks send them (room, status, prefill rank). Stand-ins, each for what needs a
cluster or a NIC: the Mooncake transfer engine (registers nothing), the thread start (the bodies
are kept), the runtime context (one rank on this host: ``pin_runtime``, ``pin_manager_runtime``).
"""

from __future__ import annotations

import inspect
import threading
from types import SimpleNamespace
from typing import Any

from ..standins import construct_with, pin_runtime, release_disagg_defaults, sg
from .manager import LOCALHOST, _kv_args, pin_manager_runtime


class Stopped(Exception):
    """A captured thread body ran out of input (ends its endless loop)."""


class Feed:
    """What a captured thread reads (a socket's messages, a transfer queue's items): queued items,
    then `Stopped`."""

    def __init__(self, *args, **kwargs) -> None:
        self.items: list[Any] = []

    def get(self, *args, **kwargs):
        if self.items:
            return self.items.pop(0)
        raise Stopped()

    def put(self, item: Any) -> None:
        self.items.append(item)


def run_captured(body, *args) -> None:
    """Run a captured thread body until its input runs out."""
    try:
        body(*args)
    except Stopped:
        pass
    except RuntimeError as exc:  # a transfer worker re-raises what its loop meets as a RuntimeError
        if not isinstance(exc.__context__, Stopped):
            raise


def capture_threads(ctx, module) -> tuple[dict[str, Any], list[tuple[Any, tuple]]]:
    """The conn module's threads are kept instead of started: the bodies by name, and its
    ``transfer_worker`` threads as (target, args), one per queue (filled as the constructor starts them)."""
    bodies: dict[str, Any] = {}
    workers: list[tuple[Any, tuple]] = []

    def thread(target=None, args=(), **kwargs):
        if target.__name__ == "transfer_worker":
            workers.append((target, args))
        else:
            bodies[target.__name__] = target
        return SimpleNamespace(start=lambda: None)

    ctx.patch(module, "threading", SimpleNamespace(Thread=thread, Lock=threading.Lock,
                                                   Event=threading.Event))
    return bodies, workers


def build_manager(ctx, mode: str, **patches: Any) -> tuple[Any, dict[str, Any], list[tuple[Any, tuple]]]:
    """The tree's ``MooncakeKVManager`` in ``mode`` ("PREFILL" or "DECODE") built by its constructor, its
    ZMQ socket closed; returns it, the thread bodies it started (captured by name) and its
    ``transfer_worker`` threads (target, args). ``patches`` are set on the conn module first."""
    pin_runtime(ctx)
    module = sg("disaggregation.mooncake.conn")
    common = sg("disaggregation.common.conn")
    for where in (module, common):
        pin_manager_runtime(ctx, where)
        # 0.5.1 - 0.5.2's constructor reads the attention TP group from dp_attention's getters
        ctx.patch_if_present(where, "get_attention_tp_size", lambda: 1)
        ctx.patch_if_present(where, "get_attention_tp_rank", lambda: 0)
    # a prefill rank registers with the bootstrap server over HTTP (renamed at 0.5.10): nothing to reach
    for name in ("_register_to_bootstrap", "register_to_bootstrap"):
        for cls in (common.CommonKVManager, module.MooncakeKVManager):  # its own up to 0.5.2
            ctx.patch_if_present(cls, name, lambda self: None)
    bodies, workers = capture_threads(ctx, module)
    engine = SimpleNamespace(batch_register=lambda *a, **k: 0, register=lambda *a, **k: 0,
                             get_session_id=lambda: f"{LOCALHOST}:19500", session_id=f"{LOCALHOST}:19500")
    ctx.patch_if_present(module, "get_mooncake_transfer_engine", lambda *a, **k: engine)
    ctx.patch_if_present(module, "MooncakeTransferEngine", lambda *a, **k: engine)
    for name, value in patches.items():
        ctx.patch(module, name, value)
    server_args = release_disagg_defaults()
    server_args.__dict__.update(host=LOCALHOST, port=30000, dist_init_addr=None, pp_size=1)
    mgr = construct_with(module.MooncakeKVManager, args=_kv_args(),
                         disaggregation_mode=getattr(sg("disaggregation.utils").DisaggregationMode, mode),
                         server_args=server_args, is_mla_backend=False)
    socket = getattr(mgr, "server_socket", None)
    if socket is not None and hasattr(socket, "close"):
        socket.close(linger=0)
    return mgr, bodies, workers


class MooncakeDecodeSide:
    """The real decode manager, ``mgr``; ``deliver`` runs its decode thread over status messages."""

    def __init__(self, ctx) -> None:
        self.module = sg("disaggregation.mooncake.conn")
        self.mgr, bodies, _ = build_manager(ctx, "DECODE")
        self.inbox = Feed()
        self.mgr.server_socket = SimpleNamespace(recv_multipart=self.inbox.get)
        if "decode_thread" not in bodies:
            raise RuntimeError(f"the decode manager started no decode_thread (threads: {sorted(bodies)})")
        self._decode_thread = bodies["decode_thread"]
        # a status names its prefill rank in a third frame from 0.4.8.post1 (before it one rank
        # writes a decode room)
        self.ranked = "prefill_rank" in inspect.getsource(self._decode_thread)

    def deliver(self, room: int, status, prefill_rank: int) -> None:
        """One prefill rank's status for the room, through the tree's own decode thread."""
        frames = [str(room).encode("ascii"), str(int(status)).encode("ascii")]
        self.deliver_frames(frames + [str(prefill_rank).encode("ascii")] if self.ranked else frames)

    def deliver_frames(self, frames: list[bytes]) -> None:
        """A message as prefill's code sent it, through the tree's own decode thread."""
        self.inbox.put(frames)
        run_captured(self._decode_thread)

    def receiver(self, room: int, prefill_ranks: int):
        """The tree's ``MooncakeKVReceiver`` for a room whose metadata went to ``prefill_ranks`` prefill
        ranks (the fields its ``init`` sets; built without its bootstrap constructor)."""
        from sglang.srt.disaggregation.base import KVPoll

        recv = object.__new__(self.module.MooncakeKVReceiver)
        recv.__dict__.update(kv_mgr=self.mgr, bootstrap_room=room, conclude_state=None, init_time=None)
        if hasattr(self.mgr, "required_prefill_response_num_table"):  # from 0.4.8.post1
            self.mgr.required_prefill_response_num_table[room] = prefill_ranks
        self.mgr.update_status(room, KVPoll.Transferring)
        return recv
