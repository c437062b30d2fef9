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

    @contextmanager
    def step(self, name: str, message: str) -> Iterator[None]:
        self.index += 1
        log.info("[%d/%d] %s ...", self.index, self.total, message)
        started = time.monotonic()
        try:
            yield
        finally:
            seconds = round(time.monotonic() - started, 3)
            self.steps.append({"step": name, "seconds": seconds})
        if seconds >= 2:
            log.info("      %s: %.1f s", name, seconds)
