"""A decode ``MoriKVManager`` built through its real constructor, and a real
``MoriKVReceiver`` on it, for the mori_hold cases (not a probe: no cases here).

The module ``sglang/srt/disaggregation/mori/conn.py`` imports the ``mori`` RDMA
library at module level; ``probes/standins/shims/mori`` stands for it (an I/O engine
without a NIC: built, given its RDMA backend and local registrations; every
transfer call raises). So the tree's own Mori code runs: ``CommonKVManager.__init__``
and ``MoriKVManager.__init__`` in DECODE mode (a real ZMQ PULL socket on
127.0.0.1), the Mori receiver's ``abort``/``poll``/``failure_exception``/``clear``
and the manager's room tracking.

Stand-ins, each for what needs a cluster:

- the runtime context (``pin_runtime``, one rank, serving on localhost);
- the two listener threads (the status listener on the PULL socket and the
  heartbeat checker against prefill's ``/health``): not started, since no
  prefill is connected and neither thread can be stopped on releases before
  0.5.22's ``teardown``; recorded instead;
- the receiver's construction (a bootstrap-server lookup over HTTP): built
  without its constructor, as after a published ``send_metadata``, its socket
  to the prefill rank records what decode sends (``PrefillRankSocket``).
"""

from __future__ import annotations

import threading

from .. import NotApplicable
from ..standins import Ledger, pin_runtime, release_disagg_defaults, sg
from .manager import LOCALHOST, _kv_args, pin_manager_runtime

PREFILL_ADDR = "10.0.0.2:8998"


def mori_module():
    """The tree's Mori backend module (0.5.9 and later)."""
    try:
        return sg("disaggregation.mori.conn")
    except ModuleNotFoundError as exc:
        if "sglang" in str(exc.name or ""):
            raise NotApplicable("no Mori backend in this release (sglang/srt/disaggregation/mori)") from None
        raise


class PrefillRankSocket:
    """Stands for decode's ZMQ socket to one prefill rank: records each message
    decode sends it (the first frame names the kind: ABORT, or Mori's guard)."""

    def __init__(self, ledger: Ledger, rank: int) -> None:
        self.ledger, self.rank = ledger, rank

    def send_multipart(self, frames, *args, **kwargs):
        message = bytes(frames[0]).decode("ascii", "replace")
        self.ledger.record("sent_to_prefill", prefill_rank=self.rank, message=message)


class ConstructedMoriDecodeManager:
    """One decode rank's real ``MoriKVManager`` (a subclass that only leaves the
    listener threads unstarted), built by its constructor; ``mgr`` is it."""

    def __init__(self, ctx, ledger: Ledger) -> None:
        pin_runtime(ctx)
        mori = mori_module()
        common = sg("disaggregation.common.conn")
        self.ledger = ledger
        for module in (common, mori):
            pin_manager_runtime(ctx, module)
            # 0.5.10 - 0.5.15 read the attention groups' ranks from dp_attention's getters
            for group in ("tp", "cp"):
                ctx.patch_if_present(module, f"get_attention_{group}_size", lambda: 1)
                ctx.patch_if_present(module, f"get_attention_{group}_rank", lambda: 0)

        class OfflineMoriDecodeManager(mori.MoriKVManager):
            """The tree's Mori manager with its listener threads left unstarted."""

            def _start_decode_thread(self) -> None:
                ledger.record("listener_not_started", thread="decode status")

            def _start_heartbeat_checker_thread(self) -> None:
                ledger.record("listener_not_started", thread="heartbeat checker")

        DisaggregationMode = sg("disaggregation.utils").DisaggregationMode
        server_args = release_disagg_defaults()  # 0.5.18 and older read these from ServerArgs
        server_args.__dict__.update(host=LOCALHOST, port=30000, dist_init_addr=None, pp_size=1)
        threads_before = threading.active_count()
        self.mgr = OfflineMoriDecodeManager(_kv_args(), DisaggregationMode.DECODE, server_args,
                                            is_mla_backend=True)
        self.threads_started = threading.active_count() - threads_before
        self.module = mori

    def receiver(self, room: int, prefill_ranks: int = 1):
        """The tree's ``MoriKVReceiver`` for `room` after its ``send_metadata``
        reached `prefill_ranks` prefill ranks: the room is open and the transfer
        may be writing into the request's pages."""
        from sglang.srt.disaggregation.base import KVPoll

        ledger = self.ledger
        rcv = object.__new__(self.module.MoriKVReceiver)
        rcv.__dict__.update(
            kv_mgr=self.mgr,
            bootstrap_room=room,
            bootstrap_addr=PREFILL_ADDR,
            bootstrap_infos=[
                {"rank": r, "rank_ip": "10.0.0.2", "rank_port": 18000 + r} for r in range(prefill_ranks)
            ],
            required_dst_info_num=1,
            abort_notified=False,
            init_time=1.0,  # send_metadata returned: prefill may be writing
            conclude_state=None,
            _abort_generation=None,
            _owns_bootstrap_room=True,
            _lifecycle_lock=threading.Lock(),
            require_staging=False,
        )
        rcv._connect_to_bootstrap_server = (
            lambda info: (PrefillRankSocket(ledger, info["rank"]), threading.Lock()))
        self.mgr.update_status(room, KVPoll.Bootstrapping)
        self.mgr.update_status(room, KVPoll.WaitingForInput)
        self.mgr.required_prefill_response_num_table[room] = prefill_ranks
        if hasattr(self.mgr, "room_to_bootstrap_addr"):
            self.mgr.room_to_bootstrap_addr[room] = PREFILL_ADDR
        self.mgr.addr_to_rooms_tracker[PREFILL_ADDR].add(room)
        return rcv

    def close(self) -> None:
        """Close the PULL socket and both ZMQ contexts (the common one owns the socket)."""
        socket = getattr(self.mgr, "server_socket", None)
        contexts = {
            id(c): c for c in (getattr(socket, "context", None), getattr(self.mgr, "_zmq_ctx", None)) if c
        }
        if socket is not None:
            socket.close(linger=0)
        for zmq_ctx in contexts.values():
            zmq_ctx.destroy(linger=0)
