"""One way to take signals for a while: a handler set on entry and the old ones put back on exit."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def handling(signals: Iterable[int], handler: Callable | int) -> Iterator[None]:
    """`handler` for each of `signals` inside the block, the previous handlers after it. Only the
    main thread may set handlers: elsewhere the block runs with the handlers left alone."""
    saved = {}
    for sig in signals:
        try:
            saved[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            break
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
