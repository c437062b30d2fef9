"""The proof that a call waits on a pending future (probes/rigs/future_wait.py), on the standard library's own
waits: it must fire for an untimed wait only a pending future can end, and never for a call that
returns, a timed wait, or a wait begun before anything completed."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from probes.rigs.future_wait import PendingFutureWait, RecordingPool


def _drive(waiter) -> tuple[bool, bool, list[int]]:
    """Layer 0 fails at once, layer 1 writes until released; ``waiter(futures)`` runs in a watched
    thread. Returns (proof reached, the call had returned when the proof or 2 s came, pending at proof)."""
    release = threading.Event()
    reached, returned = threading.Event(), threading.Event()

    def fail() -> int:
        return -1

    def write() -> int:
        release.wait(10)
        return 0

    with RecordingPool(max_workers=2) as pool:
        proof = PendingFutureWait(pool, reached)

        def call() -> None:
            proof.watch()
            try:
                waiter([pool.submit(write), pool.submit(fail)])
            finally:
                proof.stop()
                returned.set()
                reached.set()

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        reached.wait(2.0)
        was_returned = returned.is_set()
        release.set()
        caller.join(10)
    return bool(proof.pending_at_proof), was_returned, proof.pending_at_proof


def _every(futures) -> None:
    for future in concurrent.futures.as_completed(futures):
        future.result()


def _first_failure(futures) -> None:
    for future in concurrent.futures.as_completed(futures):
        if future.result() != 0:
            return


def _result_of_each(futures) -> None:
    futures[1].result()  # the failed layer first, as the tree reads it
    futures[0].result()


def _polls(futures) -> None:
    while not all(f.done() for f in futures):
        concurrent.futures.wait(futures, timeout=0.05)


@pytest.mark.parametrize("waiter", [_every, _result_of_each], ids=["as_completed", "result"])
def test_an_untimed_wait_on_the_writing_future_is_proven(waiter):
    proven, returned, pending = _drive(waiter)
    assert proven and not returned
    assert pending == [0]  # the writing layer's future, never the failed one


def test_a_call_that_returns_at_the_failure_is_never_proven_waiting():
    proven, returned, _ = _drive(_first_failure)
    assert returned and not proven


def test_a_timed_wait_is_no_proof_and_the_timer_decides():
    proven, returned, _ = _drive(_polls)
    assert not proven and not returned
