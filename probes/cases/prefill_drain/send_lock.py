"""Prefill's drain ACK on the socket it shares with the other pushes to one decode endpoint (issue 41).

A prefill rank keeps one ZMQ PUSH socket per decode endpoint (``_connect``'s cache) and pushes on it
from its bootstrap thread (ABORT_ACK) and from every transfer worker (status, aux data, CHUNK_READY).
A ZMQ socket is not thread-safe: two pushes at once on one socket can corrupt it and crash the
prefill. 0.5.17 serialises every push per endpoint (``_send_multipart_locked``, its lock in
``_socket_send_locks``); #35049's drain ACK, which the pack backports to 0.5.13 - 0.5.18, leaves from
the bootstrap thread and from the transfer workers. The probe: probes/cases/prefill_drain/.

How it is driven: the tree's ``CommonKVManager`` built by its real constructor (probes/rigs/manager.py)
with its real ``_connect``, its real drain-ACK registry and ``_send_abort_ack``, and the tree's
Mooncake push methods called on it; the decode endpoint is a real ZMQ PULL socket on 127.0.0.1.
Stand-in: the PUSH sockets ``_connect`` creates are a ``zmq.Socket`` subclass that records, for
each push, whether its endpoint's send lock was held and whether another push on the same socket
was still under way (in the race, a push waits, bounded, for another push on its socket to begin:
two unserialised pushes always meet, however loaded the machine; serialised ones never can).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from ... import NotApplicable, Outcome, case, judged
from ...standins import sg

LOCALHOST = "127.0.0.1"
LOCK_ROOM, RACE_ROOM = 721, 722
# the longest a racing push waits for the other thread's push to begin (the locked case waits it out)
RACE_WAIT_S = 1.5
# The Mooncake prefill's own pushes to a decode endpoint (present from 0.5.13; 0.5.22 renames the status
# push).
RELEASE_PUSHES = ("sync_status_to_decode_endpoint", "send_aux_data_to_endpoint", "_send_chunk_ready")


class PushRecorder:
    """What the watched PUSH sockets saw: one entry per push, and every socket made (closed at the end)."""

    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self.pushes: list[dict[str, Any]] = []
        self.sockets: list[Any] = []
        self._under_way: dict[int, int] = defaultdict(int)
        self._changed = threading.Condition()
        self.racing = False  # set for the two-thread race: pushes then wait for each other

    def socket_class(self):
        import zmq

        recorder = self

        class WatchedPushSocket(zmq.Socket):
            """Stands for the PUSH socket ``_connect`` caches for a decode endpoint: a real socket that
            records each push (a class attribute, so pyzmq sets it as an attribute, not an option)."""

            watched_endpoint = None

            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                recorder.sockets.append(self)

            def connect(self, addr):
                self.watched_endpoint = addr
                return super().connect(addr)

            def send_multipart(self, msg_parts, *args, **kwargs):
                return recorder.push(self, msg_parts, lambda: super(WatchedPushSocket, self).send_multipart(
                    msg_parts, *args, **kwargs))

        return WatchedPushSocket

    def push(self, sock, parts, send):
        locks = getattr(self.mgr, "_socket_send_locks", None) or {}
        lock = locks.get(sock.watched_endpoint)
        with self._changed:
            self._under_way[id(sock)] += 1
            overlapped = self._under_way[id(sock)] > 1
            self._changed.notify_all()
        entry = {"head": bytes(parts[0])[:16].decode("ascii", "replace"), "endpoint": sock.watched_endpoint,
                 "thread": threading.current_thread().name,
                 # single-threaded pushes: held means held by this push's caller
                 "lock_held": bool(lock is not None and lock.locked()), "overlapped": overlapped}
        try:
            if self.racing:
                with self._changed:
                    met = self._changed.wait_for(lambda: self._under_way[id(sock)] > 1, timeout=RACE_WAIT_S)
                entry["overlapped"] = entry["overlapped"] or met
            return send()
        finally:
            with self._changed:
                self._under_way[id(sock)] -= 1
                entry["overlapped"] = entry["overlapped"] or self._under_way[id(sock)] > 0
                self.pushes.append(entry)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


def _release_push(mooncake_cls, name: str, mgr, port: int, room: int) -> str:
    """One of the Mooncake prefill's own pushes, on the constructed manager; 'pushed' or why not."""
    func = getattr(mooncake_cls, name, None)
    if func is None:
        return "absent in this release"
    try:
        if name == "sync_status_to_decode_endpoint":
            func(mgr, LOCALHOST, port, room, 3, 0)
        elif name == "send_aux_data_to_endpoint":
            func(mgr, LOCALHOST, port, room, 0, 0, b"aux")
        else:
            req = SimpleNamespace(endpoint=LOCALHOST, dst_port=port, room=room,
                                  mooncake_session_id="probe-session")
            chunk = SimpleNamespace(index_slice=slice(0, 4), prefill_kv_indices=[0, 1, 2, 3])
            func(mgr, req, 0, chunk, 0)
    except TypeError as exc:  # another signature in this release: not driven, said so
        return f"not driven: {exc}"
    return "pushed"


def _received(pull, expected: int) -> list[list[str]]:
    frames = []
    while len(frames) < expected and pull.poll(2000):
        frames.append([bytes(f)[:16].decode("ascii", "replace") for f in pull.recv_multipart()])
    return frames


@case(
    proves=("pr35049-ack",), needs=("pr35049-ack", ">=0.4.7"),  # disaggregation.common: 0.4.7
    must_preserve=False,
    expect="Prefill's drain ABORT_ACK goes out on the decode endpoint's cached socket holding that "
    "endpoint's send lock, and so does every other push prefill makes on that socket (status, aux data, "
    "CHUNK_READY): an ACK from one thread never overlaps another thread's push on the socket (a zmq socket "
    "is not thread-safe).",
)
def abort_ack_sent_under_endpoint_lock(ctx) -> Outcome:
    """Scenario: a decode rank ABORTs a room with nothing outstanding; the prefill ACKs it at once through
    the real registry (``register_deferred_ack_target``, ``_maybe_ack_drained_abort``, ``_send_abort_ack``),
    then the Mooncake prefill's own pushes reach the same endpoint; last, a second room's ACK (one thread)
    and an aux push (another thread) start together on the same socket.

    Upstream behaviour (0.5.17+): every push takes ``_socket_send_locks[endpoint]``. Proves: the pack's
    pr35049-ack variants on 0.5.13 - 0.5.16, whose releases have no send lock: the ACK and the pushes it
    shares the socket with take the endpoint's lock (a lock the other pushes skip would exclude nothing)."""
    import zmq

    from ...rigs.manager import ConstructedPrefillManager, registry_class

    if not hasattr(registry_class(), "_send_abort_ack"):
        raise NotApplicable("the prefill sends no drain ABORT_ACK in this release")
    mooncake_cls = sg("disaggregation.mooncake.conn").MooncakeKVManager
    rig = ConstructedPrefillManager(ctx, counts_outstanding=True, wire=False)
    decode_ctx = zmq.Context()
    pull = decode_ctx.socket(zmq.PULL)
    recorder = PushRecorder(rig.mgr)
    try:
        port = pull.bind_to_random_port(f"tcp://{LOCALHOST}")
        ctx.patch(zmq.Context, "_socket_class", recorder.socket_class())
        rig.open_room(LOCK_ROOM, [(LOCALHOST, port)])
        rig.abort_from(LOCK_ROOM, LOCALHOST, port)
        release = {name: _release_push(mooncake_cls, name, rig.mgr, port, LOCK_ROOM)
                   for name in RELEASE_PUSHES}
        sequential = list(recorder.pushes)
        rig.open_room(RACE_ROOM, [(LOCALHOST, port)])
        start = threading.Barrier(2)
        recorder.racing = True

        def ack() -> None:
            start.wait(5)
            rig.abort_from(RACE_ROOM, LOCALHOST, port)

        def aux() -> None:
            start.wait(5)
            _release_push(mooncake_cls, "send_aux_data_to_endpoint", rig.mgr, port, RACE_ROOM)

        threads = [threading.Thread(target=ack, name="bootstrap"),
                   threading.Thread(target=aux, name="transfer")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        raced = recorder.pushes[len(sequential):]
        received = _received(pull, len(recorder.pushes))
    finally:
        recorder.close()
        pull.close(linger=0)
        decode_ctx.term()
        rig.close()
    acks = [p for p in sequential if p["head"] == "ABORT_ACK"]
    details: dict[str, Any] = {
        "sequential_pushes": sequential, "release_pushes": release, "raced_pushes": raced,
        "frames_received": received, "send_lock_table": hasattr(rig.mgr, "_socket_send_locks"),
    }
    problems = []
    if not acks:
        problems.append("no drain ABORT_ACK was pushed")
    problems += [f"{p['head']} pushed without the endpoint's send lock"
                 for p in sequential if not p["lock_held"]]
    if any(p["overlapped"] for p in raced):
        problems.append("the ACK and another thread's push were on the socket at the same time")
    if len(received) != len(recorder.pushes):
        problems.append(f"decode received {len(received)} of {len(recorder.pushes)} pushes")
    return judged(problems, "Every push, the drain ACK included, held the endpoint's send lock; the racing "
                  "ACK and aux push went out one after the other, and decode received each.", details)
