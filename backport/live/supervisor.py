"""The live tier's reaper: kills every process a `Processes` started once its owner is gone.

Run as a script (standard library only) in a session of its own, so that a signal to the CLI's
process group does not reach it. It reads process-group ids, one a line, on stdin; the write end
is held only by the CLI. When stdin closes (the CLI returned, raised, or was SIGKILLed: the
kernel closes its pipe either way) it kills, SIGTERM then SIGKILL, every process that is

- in one of those groups (a server and the scheduler children `launch_server` forks),
- carries `MARKER=<token>` (argv[1]) in its environment: a server whose group id never arrived
  because the CLI died between starting it and writing the id, or a descendant that made a group
  of its own (SGLang's `setproctitle` overwrites what /proc shows of a scheduler's environment,
  so the mark alone does not find every descendant), or
- a descendant of one of those, seen while the CLI lived (the tree is read once a second: a
  descendant that both moved to its own group and renamed itself is still known by its parent),

and exits once none is left (bounded). SIGTERM to the reaper itself does the same.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

MARKER = "SGLANG_BACKPORT_LIVE_REAPER"
TERM_GRACE_SECONDS = 2.0
KILL_SECONDS = 10.0
SCAN_SECONDS = 1.0


def processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent, group, start time) of every live (non-zombie) process but this one."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[2]), fields[19])
    return table


def marked(pid: int, needle: bytes) -> bool:
    try:
        return needle in b"\0" + Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
    except OSError:
        return False


class Reaper:
    def __init__(self, token: bytes):
        self.needle = b"\0" + f"{MARKER}=".encode() + token + b"\0"
        self.groups: dict[int, str | None] = {}   # group id -> its leader's start time, when seen
        self.known: dict[int, str] = {}   # pid -> start time: a reused pid is another process

    def add_group(self, pgid: int, table: dict[int, tuple[int, int, str]]) -> None:
        self.groups[pgid] = table[pgid][2] if pgid in table else None

    def targets(self) -> list[int]:
        """Every live process of the run (see the module's list); learns the tree as it goes."""
        table = processes()
        # a group whose leader's pid now names another process is not ours any more
        groups = {g for g, started in self.groups.items() if g not in table or table[g][2] == started}
        ours = {pid for pid, (_, group, started) in table.items()
                if group in groups or self.known.get(pid) == started or marked(pid, self.needle)}
        grew = True
        while grew:  # descendants of ours, however deep
            children = {pid for pid, (parent, _, _) in table.items() if parent in ours} - ours
            ours |= children
            grew = bool(children)
        self.known.update({pid: table[pid][2] for pid in ours})
        return sorted(ours)

    def sweep(self) -> None:
        signal_all(self.targets(), signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_SECONDS
        while time.monotonic() < deadline and self.targets():
            time.sleep(0.1)
        deadline = time.monotonic() + KILL_SECONDS
        while time.monotonic() < deadline:
            left = self.targets()
            if not left:
                return
            signal_all(left, signal.SIGKILL)
            time.sleep(0.05)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def main() -> int:
    reaper = Reaper(sys.argv[1].encode())

    def on_term(signum, frame):
        reaper.sweep()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pending = b""
    while True:
        if select.select([0], [], [], SCAN_SECONDS)[0]:
            chunk = os.read(0, 4096)
            if not chunk:  # EOF: the owner closed the pipe or is gone
                break
            *lines, pending = (pending + chunk).split(b"\n")
            table = processes()
            for line in lines:
                if line.strip().isdigit():
                    reaper.add_group(int(line), table)
        reaper.targets()  # learn the tree while the owner lives
    reaper.sweep()
    return 0


if __name__ == "__main__":
    sys.exit(main())
