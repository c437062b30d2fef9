"""One prefill rank's real ``MooncakeKVManager`` (PREFILL mode, 0.4.7 - 0.5.12.post1), built by its
constructor, for the cases of this pack's ``sbp-refused-hold`` (not a probe: no cases here).

The constructor runs as in probes/rigs/mooncake_decode.py (``build_manager``); in PREFILL mode its
bootstrap thread and transfer workers are captured instead of started and run here over what a
case hands them: decode's pre-allocation messages (``register``), and each worker's queue, which is
a ``Feed`` the case drains (``run_workers``). Prefill's pushes to decode go through the tree's own
``sync_status_to_decode_endpoint`` to a recording socket (``wire``: the frames as sent). Stand-ins,
each for what needs a cluster or a NIC: the transfer engine, the bootstrap server's HTTP
registration, the thread start, the ZMQ PUSH sockets (recorded).
"""

from __future__ import annotations

from types import SimpleNamespace

from ..standins import sg
from .mooncake_decode import Feed, build_manager, run_captured

DECODE_IP, DECODE_PORT, DECODE_SESSION = "127.0.0.1", 17100, "127.0.0.1:19000"


class MooncakePrefillSide:
    """The real prefill manager, ``mgr``; ``wire`` holds what it pushed to decode."""

    def __init__(self, ctx) -> None:
        self.mgr, bodies, self.workers = build_manager(ctx, "PREFILL", FastQueue=Feed)
        if "bootstrap_thread" not in bodies or not self.workers:
            raise RuntimeError(f"the prefill manager started no bootstrap thread or workers "
                               f"({sorted(bodies)})")
        self._bootstrap_thread = bodies["bootstrap_thread"]
        self.inbox = Feed()
        self.mgr.server_socket = SimpleNamespace(recv_multipart=self.inbox.get)
        self.wire: list[list[bytes]] = []
        self.mgr._connect = lambda endpoint, is_ipv6=False: SimpleNamespace(
            send_multipart=lambda frames: self.wire.append([bytes(f) for f in frames]))

    def register(self, room: int, pages: int) -> None:
        """Decode's pre-allocation message for ``room`` (one decode rank, ``pages`` pages) through the
        bootstrap thread, in the release's frame order: ``TransferInfo.from_zmq`` reads the frames in its
        fields' order (0.5.3 adds the state indices; the fields after the rank count are not sent)."""
        import dataclasses

        import numpy as np

        value = {
            "room": str(room).encode(), "endpoint": DECODE_IP.encode(), "dst_port": str(DECODE_PORT).encode(),
            "mooncake_session_id": DECODE_SESSION.encode(),
            "dst_kv_indices": np.arange(pages, dtype=np.int32).tobytes(), "dst_aux_index": b"0",
            "dst_state_indices": b"", "required_dst_info_num": b"1",
        }
        fields = [f.name for f in dataclasses.fields(sg("disaggregation.mooncake.conn").TransferInfo)]
        sent = fields[:fields.index("required_dst_info_num") + 1]
        self.inbox.put([value[name] for name in sent])
        run_captured(self._bootstrap_thread)

    def run_workers(self) -> None:
        for target, args in self.workers:
            run_captured(target, *args)

    def keeps(self, room: int) -> list[str]:
        """What prefill still keeps for ``room``."""
        return [name for name in ("transfer_infos", "request_status") if room in getattr(self.mgr, name, {})]
