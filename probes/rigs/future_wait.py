"""Proof that a thread waits on a future that has not completed, instead of a timer.

A probe that must show a call does *not* return before some future completes can only wait and
see, and any wait is a guess about scheduling. But when the calling thread enters an untimed
``threading.Condition.wait`` that only pending futures can end (the condition belongs to the
future itself or to a ``concurrent.futures`` waiter installed on it, and every future that can
notify it and has completed already did), the call provably cannot return before one of those
futures completes. ``PendingFutureWait`` watches for exactly that state, through a profile hook
in the calling thread, and sets an event when it is reached; a probe still keeps its timer for
code that waits in any other way (the hook then never fires and the timer decides, as before).
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from typing import Any

_CONDITION_WAIT = threading.Condition.wait.__code__


class RecordingPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool that keeps every future it hands out (the tree submits to it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, fn, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


def _notifies(future: concurrent.futures.Future, condition: Any) -> bool:
    """Can this future's completion end a wait on ``condition``? (its own condition, as
    ``result()`` waits on, or the event of a waiter ``as_completed`` / ``wait`` installed on it)"""
    if condition is future._condition:
        return True
    return any(getattr(getattr(w, "event", None), "_cond", None) is condition for w in future._waiters)


_DONE_STATES = (concurrent.futures._base.CANCELLED, concurrent.futures._base.CANCELLED_AND_NOTIFIED,
                concurrent.futures._base.FINISHED)


def _settled(future: concurrent.futures.Future) -> bool | None:
    """True: completed and its notification delivered; False: pending; None: completing right now.
    The hook runs while the waiting thread holds the wait's condition, so it must not block on a
    future's lock: a worker completing that future holds it while it notifies, and the notification
    needs the wait's condition (a lock-order deadlock, seen in the matrix). The lock is only tried;
    a future whose state is final while its lock is held may still notify this wait, so it proves
    nothing either way (None)."""
    if future._state not in _DONE_STATES:
        return False
    if not future._condition.acquire(blocking=False):
        return None
    future._condition.release()
    return True


class PendingFutureWait:
    """Sets ``reached`` when the thread that called ``watch()`` starts an untimed wait that only a
    pool future still pending can end, once at least one of the pool's futures has completed."""

    def __init__(self, pool: RecordingPool, reached: threading.Event) -> None:
        self.pool, self.reached = pool, reached
        self.pending_at_proof: list[int] = []

    def watch(self) -> None:
        sys.setprofile(self._hook)  # this thread only

    def stop(self) -> None:
        sys.setprofile(None)

    def _hook(self, frame, event: str, _arg: Any) -> None:
        if event != "call" or frame.f_code is not _CONDITION_WAIT or self.reached.is_set():
            return
        if frame.f_locals.get("timeout") is not None:
            return  # a timed wait can end without any future: not a proof
        condition = frame.f_locals.get("self")
        futures = list(self.pool.futures)
        notifiers = [f for f in futures if _notifies(f, condition)]
        settled = [_settled(f) for f in futures]
        if any(s is None for f, s in zip(futures, settled) if f in notifiers):
            return  # a notifier is completing: it may end this wait, so the wait proves nothing
        pending = [i for i, f in enumerate(futures) if f in notifiers and settled[i] is False]
        if pending and any(settled):
            self.pending_at_proof = pending
            self.reached.set()
