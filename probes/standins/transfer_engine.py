"""The prefill side under the real transfer workers: the RDMA transfer engine whose writes
complete, time out while still running, stay in flight or crash, the per-layer engine, the
ABORT frames a decode rank sends and the ZMQ pushes back to decode.
"""

from __future__ import annotations

from . import Ledger, sg_attr


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

    def connect(self, endpoint: str, is_ipv6: bool = False) -> _PushSocket:
        """Stands for ``_connect`` where a release pushes through the cached
        socket itself (0.5.16 has no ``_send_multipart_locked``)."""
        return _PushSocket(self, endpoint)

    def attach(self, mgr) -> None:
        """Route the manager's pushes to decode through this wire: its locked
        send where the release has one, else its socket cache (``_connect``)."""
        mgr._send_multipart_locked = self.send
        if not hasattr(type(mgr), "_send_multipart_locked"):
            mgr._connect = self.connect


class _PushSocket:
    """One cached PUSH socket to a decode endpoint, as ``_connect`` returns it."""

    def __init__(self, wire: DecodePeerWire, endpoint: str) -> None:
        self.wire, self.endpoint = wire, endpoint

    def send_multipart(self, parts) -> None:
        self.wire.send(self.endpoint, parts)


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

    def transfer_sync(self, session_id, buffer, peer_buffer_address, length) -> int:
        """Up to 0.4.7 the send writes one block per call (no batch API): the same per-layer plan."""
        return self.batch_transfer_sync(session_id, [buffer], [peer_buffer_address], [length])

    def land(self) -> None:
        self.landed.set()
