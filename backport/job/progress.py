"""Progress of the main job: one log line per step on stderr, durations kept for the receipt."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger("backport.job")


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
            yield
        finally:
            seconds = round(time.monotonic() - started, 3)
            self.steps.append({"step": name, "seconds": seconds})
        if seconds >= 2:
            log.info("      %s %s: %.1f s", self.target or "step", name, seconds)
