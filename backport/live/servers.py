"""Processes of the live tier: start on free loopback ports, wait until ready, stop by process group.

Every server runs in its own session (its own process group), so stopping it reaches the
scheduler and detokenizer children `launch_server` forks. `launch_server` ignores SIGTERM for
more than five seconds: stopping sends SIGTERM to the group, waits briefly, then SIGKILL.
`Processes` is the one owner of everything started: a `with` block stops all of it on every exit
path (return, exception, SIGINT, SIGTERM), with both signals held off while it stops, so a second
Ctrl-C cannot cut the clean-up short.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from backport.errors import Finding
from backport.signals import handling

LOOPBACK = "127.0.0.1"
TERM_GRACE_SECONDS = 3.0
GROUP_EXIT_SECONDS = 5.0
POLL_SECONDS = 1.0


def free_port() -> int:
    """A port free on loopback now (the kernel picks it; a busy port is never chosen)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


class ServerDidNotStart(Finding):
    """A server exited or was not ready in time: one line naming it, then its log's tail."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so that `finally` blocks run and the CLI exits as for Ctrl-C."""


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    log: Path
    url: str

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Processes:
    """Owns the servers of one deployment; use as a context manager."""

    workdir: Path
    servers: list[Server] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, url: str, env: dict[str, str]) -> Server:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, cwd=self.workdir, start_new_session=True)
        server = Server(name, process, log, url)
        self.servers.append(server)
        return server

    def stop_all(self) -> None:
        with signals_held():
            for server in self.servers:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(server.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + TERM_GRACE_SECONDS
            for server in self.servers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            for server in self.servers:
                # the group, even when the leader has exited: its children may still hold ports
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(server.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.process.wait(timeout=10)
            # a killed child of a server is reparented and dies on its own time: wait (bounded)
            # until no process of any group is left, so no port is still held on return
            deadline = time.monotonic() + GROUP_EXIT_SECONDS
            while time.monotonic() < deadline and group_members({s.process.pid for s in self.servers}):
                time.sleep(0.05)

    def __enter__(self) -> Processes:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def group_members(pgids: set[int]) -> list[int]:
    """Processes (zombies excepted) whose process group is one of `pgids`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in pgids and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def signals_held():
    """SIGINT and SIGTERM ignored inside (only in the main thread, where handlers can be set)."""
    return handling((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN)


def sigterm_raises():
    """SIGTERM raises Terminated in the main thread, so `with Processes(...)` stops its servers."""

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    return handling((signal.SIGTERM,), handler)


def wait_ready(servers: list[Server], path: str, timeout: float,
               ready: Callable[[requests.Response], bool] = lambda r: r.status_code == 200) -> float:
    """Poll `path` on each server until all answer ready; the seconds it took. A server that exits,
    or is not ready within `timeout`, raises ServerDidNotStart with its log's tail."""
    started = time.monotonic()
    pending = list(servers)
    while pending:
        for server in list(pending):
            if not server.alive():
                raise ServerDidNotStart(f"{server.name} server exited with code {server.process.returncode} "
                                        f"before it was ready; {server.log} ends:\n{log_tail(server.log)}")
            try:
                if ready(requests.get(server.url + path, timeout=5)):
                    pending.remove(server)
            except requests.RequestException:
                pass
        if pending and time.monotonic() - started > timeout:
            server = pending[0]
            raise ServerDidNotStart(f"{server.name} server not ready after {timeout:.0f} s; {server.log} "
                                    f"ends:\n{log_tail(server.log)}")
        if pending:
            time.sleep(POLL_SECONDS)
    return time.monotonic() - started


def listening_pids(pids: set[int]) -> set[int]:
    """Which of `pids` still hold a listening TCP socket (read from /proc; empty where it cannot be read)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        found.add(pid)
                        break
    return found
