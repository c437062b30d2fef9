"""The live tier's reaper: kills every process a `Processes` started once its owner is gone.

Run as a script (standard library only) in a session of its own, so that a signal to the CLI's
process group does not reach it. It reads process-group ids, one a line, on stdin; the write end
is held only by the CLI. When stdin closes (the CLI returned, raised, or was SIGKILLed: the
kernel closes its pipe either way) it kills, SIGTERM then SIGKILL, every process that is

- in one of those groups (a server and the scheduler children `launch_server` forks), or
- carries `MARKER=<token>` (argv[1]) in its environment: every descendant inherits it, so this
  also finds a child that made its own group, or a server whose group id never arrived because
  the CLI died between starting it and writing the id,

and exits once none is left (bounded). SIGTERM to the reaper itself does the same.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

MARKER = "SGLANG_BACKPORT_LIVE_REAPER"
TERM_GRACE_SECONDS = 2.0
KILL_SECONDS = 10.0


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of its stat): tells a reused pid from the original."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def targets(groups: dict[int, str | None], token: bytes) -> list[int]:
    """Live (non-zombie) processes of `groups` or carrying the marker; never this process."""
    # a group whose leader's pid now belongs to another process is not ours any more
    ours = {g for g, started in groups.items() if start_time(g) in (None, started)}
    needle = f"{MARKER}=".encode() + token + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            if int(fields[2]) in ours or needle in b"\0" + (entry / "environ").read_bytes() + b"\0":
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def sweep(groups: dict[int, str | None], token: bytes) -> None:
    signal_all(targets(groups, token), signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_SECONDS
    while time.monotonic() < deadline and targets(groups, token):
        time.sleep(0.1)
    deadline = time.monotonic() + KILL_SECONDS
    while time.monotonic() < deadline:
        left = targets(groups, token)
        if not left:
            return
        signal_all(left, signal.SIGKILL)
        time.sleep(0.05)


def main() -> int:
    token = sys.argv[1].encode()
    groups: dict[int, str | None] = {}

    def on_term(signum, frame):
        sweep(groups, token)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    for line in sys.stdin:  # returns at EOF: the owner closed the pipe or is gone
        if line.strip().isdigit():
            groups[int(line)] = start_time(int(line))
    sweep(groups, token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
