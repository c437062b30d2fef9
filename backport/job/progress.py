"""Progress of the main job: one log line per step on stderr, durations kept for the receipt, and
no phase silent for more than INTERVAL seconds (README, CLI): `heartbeat` says a long phase is
still running (with what it measures, such as the bytes downloaded so far) whenever nothing else
was printed for that long; every `run` step has one."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("backport.job")
INTERVAL = 10.0  # seconds; tests make it shorter


class _Printed(logging.Filter):
    """Notes when a line last went out through a handler: a phase that prints its own progress
    (the probe matrix, pip's lines, the live tier) gets no extra ones."""

    def __init__(self):
        super().__init__()
        self.at = time.monotonic()

    def filter(self, record: logging.LogRecord) -> bool:
        self.at = time.monotonic()
        return True


def _handlers() -> list[logging.Handler]:
    found: list[logging.Handler] = []
    logger: logging.Logger | None = logging.getLogger("backport.job")
    while logger is not None:  # the handlers a record of this logger reaches
        found += logger.handlers
        logger = logger.parent if logger.propagate else None
    return found


@contextmanager
def heartbeat(
    what: str, detail: Callable[[], str] | None = None, *, every: float | None = None
) -> Iterator[None]:
    """While the block runs, a line `<what> ... N s[, detail]` each time nothing was printed for
    `every` seconds (INTERVAL)."""
    every = INTERVAL if every is None else every
    printed, handlers = _Printed(), _handlers()
    for handler in handlers:
        handler.addFilter(printed)
    stop, started = threading.Event(), time.monotonic()

    def beat() -> None:
        while not stop.wait(max(0.01, printed.at + every - time.monotonic())):
            if time.monotonic() - printed.at < every:
                continue  # something else was printed meanwhile
            try:
                extra = detail() if detail else ""
            except OSError:
                extra = ""
            log.info("      %s ... %.0f s%s", what, time.monotonic() - started, f", {extra}" if extra else "")
            printed.at = time.monotonic()  # also when no handler prints it

    thread = threading.Thread(target=beat, name="backport-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for handler in handlers:
            handler.removeFilter(printed)


def bytes_under(*roots: Path) -> int:
    """The bytes of every file under `roots` (a download in progress, a folder being removed)."""
    total = 0
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    pass
    return total


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


@dataclass
class Progress:
    total: int
    index: int = 0
    steps: list[dict] = field(default_factory=list)
    target: str = ""                   # the spec whose steps these are: named on every line

    @contextmanager
    def step(self, name: str, message: str) -> Iterator[None]:
        self.index += 1
        log.info("[%s %d/%d] %s ...", self.target or "step", self.index, self.total, message)
        started = time.monotonic()
        try:
            with heartbeat(f"{self.target or 'step'} {name}: still running"):
                yield
        finally:
            seconds = round(time.monotonic() - started, 3)
            self.steps.append({"step": name, "seconds": seconds})
        if seconds >= 2:
            log.info("      %s %s: %.1f s", self.target or "step", name, seconds)
