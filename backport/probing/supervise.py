"""One way to run a long child process: in its own process group, a tick at least every few
seconds (progress), and the whole group stopped on every exit path.

Ctrl-C or SIGTERM reaches the toolkit as an exception while it waits here; the `finally` then ends
the child and everything it forked (the probe matrix forks one child per tree; pip spawns
builders) within about a second, so the command answers at once and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

TICK_SECONDS = 1.0
GRACE_SECONDS = 1.0


def stop_group(proc: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to the child's process group, SIGKILL after `grace` seconds, then reap the child."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the group may outlive its leader: make sure nobody of it is left
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def supervise(cmd: list[str], *, env: dict[str, str], cwd: str | Path, stdout: Path, stderr: Path,
              tick: Callable[[float], None] | None = None) -> int:
    """Run `cmd` with stdout and stderr into files; `tick(seconds elapsed)` about every second."""
    started = time.monotonic()
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            while True:
                try:
                    return proc.wait(timeout=TICK_SECONDS)
                except subprocess.TimeoutExpired:
                    if tick is not None:
                        tick(time.monotonic() - started)
        finally:
            if proc.poll() is None:
                stop_group(proc)
            else:  # the leader exited: its forked children must not outlive it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


class Heartbeat:
    """A tick that says `message(seconds)` at most every `every` seconds."""

    def __init__(self, say: Callable[[str], None], message: Callable[[float], str], every: float = 10.0):
        self.say, self.message, self.every, self.last = say, message, every, 0.0

    def __call__(self, seconds: float) -> None:
        if seconds - self.last >= self.every:
            self.last = seconds
            self.say(self.message(seconds))
