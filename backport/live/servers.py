"""Processes of the live tier: start on free loopback ports, wait until ready, stop by process group.

Every server runs in its own session (its own process group), so stopping it reaches the
scheduler and detokenizer children `launch_server` forks. `launch_server` ignores SIGTERM for
more than five seconds: stopping sends SIGTERM to the group, waits briefly, then SIGKILL.
`Processes` is the one owner of everything started: a `with` block stops all of it on every exit
path (return, exception, SIGINT, SIGTERM), with both signals held off while it stops, so a second
Ctrl-C cannot cut the clean-up short. What no `finally` survives (SIGKILL of the CLI, the OOM
killer) is covered by a reaper (supervisor.py) started with the first server: it holds the
groups and kills them all when the CLI's pipe to it closes.

Waiting for a server reads its log too: a port taken between `free_port()` and the server's bind
("address already in use") raises PortInUse within a second, so the caller can retry elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from backport.errors import Finding, Interrupted
from backport.live import supervisor
from backport.signals import handling

log = logging.getLogger("backport.live")
LOOPBACK = "127.0.0.1"
TERM_GRACE_SECONDS = 3.0
GROUP_EXIT_SECONDS = 5.0
REAPER_EXIT_SECONDS = 15.0
POLL_SECONDS = 1.0
PROGRESS_SECONDS = 10.0
PORT_ATTEMPTS = 3              # starts of one server, each on fresh ports, before a taken port is an error
# uvicorn and aiohttp: "[Errno 98] error while attempting to bind on address ('127.0.0.1', 5): address
# already in use"; smg: "Failed to bind the HTTP listener on 127.0.0.1:5: Address already in use (os error
# 98)"
BIND_FAILED = re.compile(r"address already in use|errno 98|os error 98", re.IGNORECASE)
ANSI = re.compile(r"\x1b\[[0-9;]*m")   # smg colours its log


# 0.5.13 and later derive a gRPC port as --port + 10000 and refuse to start when it passes 65535
HIGHEST_SERVER_PORT = 65535 - 10000


def free_port() -> int:
    """A port free on loopback now, at most HIGHEST_SERVER_PORT (the kernel picks it, so a busy port is
    never chosen; picks above the bound are held while the next is drawn, so each draw is new)."""
    held: list[socket.socket] = []
    try:
        for _ in range(256):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
            if port <= HIGHEST_SERVER_PORT:
                return port
        raise OSError(f"no free loopback port at or below {HIGHEST_SERVER_PORT} in 256 draws")
    finally:
        for sock in held:
            sock.close()


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(empty log)"


class ServerDidNotStart(Finding):
    """A server exited or was not ready in time: one line naming it, then its log's tail."""


class PortInUse(ServerDidNotStart):
    """A server could not bind `port`, one of the ports it was started with."""

    def __init__(self, message: str, server: Server, port: int):
        super().__init__(message)
        self.server, self.port = server, port


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    log: Path
    url: str
    ports: tuple[int, ...] = ()   # the loopback ports it was told to bind

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class Processes:
    """Owns the servers of one deployment; use as a context manager."""

    workdir: Path
    servers: list[Server] = field(default_factory=list)
    _reaper: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _token: str = field(default_factory=lambda: secrets.token_hex(8), init=False, repr=False)

    def start(self, name: str, argv: list[str], *, url: str, env: dict[str, str] | None,
              ports: tuple[int, ...] = ()) -> Server:
        self._ensure_reaper()
        log_path = self.workdir / f"{name}.log"
        # the reaper's mark: every descendant inherits it, wherever it moves its group
        child_env = {**(os.environ if env is None else env), supervisor.MARKER: self._token}
        with open(log_path, "wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=child_env, cwd=self.workdir, start_new_session=True)
        server = Server(name, process, log_path, url, tuple(ports))
        self.servers.append(server)
        self._register(process.pid)
        return server

    def stop(self, server: Server) -> None:
        """Stop one server (its whole group) and forget it, e.g. to start it again on other ports."""
        with signals_held():
            stop_groups([server])
        if server in self.servers:
            self.servers.remove(server)

    def stop_all(self) -> None:
        with signals_held():
            stop_groups(self.servers)
            self._close_reaper()

    def __enter__(self) -> Processes:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def _ensure_reaper(self) -> None:
        if self._reaper is not None and self._reaper.poll() is None:
            return
        # its own session: a signal to the CLI's group leaves it to clean up after the CLI;
        # -I: only the standard library, whatever PYTHONPATH says
        self._reaper = subprocess.Popen([sys.executable, "-I", supervisor.__file__, self._token],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        for server in self.servers:  # a reaper started again (the first one was killed) learns them all
            self._register(server.process.pid)

    def _register(self, pgid: int) -> None:
        reaper = self._reaper
        if reaper is None or reaper.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            reaper.stdin.write(f"{pgid}\n".encode())
            reaper.stdin.flush()

    def _close_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        with contextlib.suppress(OSError):
            if reaper.stdin is not None:  # stdin=PIPE: always set
                reaper.stdin.close()  # EOF: it sweeps what is left (nothing, normally) and exits
        try:
            reaper.wait(timeout=REAPER_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()


def stop_groups(servers: list[Server]) -> None:
    """SIGTERM to each server's group, a short grace, SIGKILL to the groups, and a bounded wait
    until no member of any group is left (a killed child still holding a port would outlive it)."""
    for server in servers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_SECONDS
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for server in servers:
        # the group, even when the leader has exited: its children may still hold ports
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=10)
    deadline = time.monotonic() + GROUP_EXIT_SECONDS
    while time.monotonic() < deadline and group_members({s.process.pid for s in servers}):
        time.sleep(0.05)


def group_members(pgids: set[int]) -> list[int]:
    """Processes (zombies excepted) whose process group is one of `pgids`, read from /proc (by the
    reaper's own table reader; this process is never in a server's group)."""
    return [pid for pid, (_, group, _) in supervisor.processes().items() if group in pgids]


def signals_held():
    """SIGINT and SIGTERM ignored inside (only in the main thread, where handlers can be set)."""
    return handling((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN)


def sigterm_raises() -> contextlib.AbstractContextManager[None]:
    """SIGTERM raises Interrupted in the main thread, so `with Processes(...)` stops its servers
    and the CLI names the signal (exit 143, not Ctrl-C's 130)."""

    def handler(signum, frame):
        raise Interrupted(signum)

    return handling((signal.SIGTERM,), handler)


def wait_ready(servers: list[Server], path: str, timeout: float,
               ready: Callable[[requests.Response], bool] = lambda r: r.status_code == 200) -> float:
    """Poll `path` on each server until all answer ready; the seconds it took. A server that exits,
    or is not ready within `timeout`, raises ServerDidNotStart with its log's tail; one whose log
    says it could not bind raises PortInUse. A progress line every PROGRESS_SECONDS."""
    started = time.monotonic()
    next_progress = started + PROGRESS_SECONDS
    pending = list(servers)
    while pending:
        for server in list(pending):
            failed = bind_failure(server)
            if failed is not None:
                raise PortInUse(f"{server.name} server could not bind port {failed[0]} on {LOOPBACK} "
                                f"(address already in use): {failed[1]}", server, failed[0])
            if not server.alive():
                raise ServerDidNotStart(f"{server.name} server exited with code {server.process.returncode} "
                                        f"before it was ready; {server.log} ends:\n{log_tail(server.log)}")
            try:
                if ready(requests.get(server.url + path, timeout=5)):
                    pending.remove(server)
            except requests.RequestException:
                pass
        now = time.monotonic()
        if pending and now - started > timeout:
            server = pending[0]
            raise ServerDidNotStart(f"{server.name} server not ready after {timeout:.0f} s; {server.log} "
                                    f"ends:\n{log_tail(server.log)}")
        if pending and now >= next_progress:
            next_progress = now + PROGRESS_SECONDS
            last = "; ".join(f"{s.name}: {ANSI.sub('', log_tail(s.log, 1))[:100]}" for s in pending)
            log.info("live: %s starting, %.0f s, waiting for %s (%s)", "/".join(s.name for s in servers),
                     now - started, path, last)
        if pending:
            time.sleep(POLL_SECONDS)
    return time.monotonic() - started


@dataclass(frozen=True)
class Launch:
    """One server to start: its argv for the ports chosen (`port_names` in order; the first is the
    one its URL uses), and its environment."""

    name: str
    argv: Callable[[dict[str, int]], list[str]]
    port_names: tuple[str, ...]
    env: dict[str, str] | None


def serve(processes: Processes, launches: list[Launch], path: str, timeout: float,
          ready: Callable[[requests.Response], bool] = lambda r: r.status_code == 200) -> dict[str, Server]:
    """Start each on free loopback ports and wait until all are ready (`wait_ready`). A server whose
    port was taken in between is stopped and started again on fresh ports; after PORT_ATTEMPTS
    starts in all, PortInUse names the server and the port."""
    specs = {launch.name: launch for launch in launches}
    servers = {launch.name: _launch(processes, launch) for launch in launches}
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            wait_ready(list(servers.values()), path, timeout, ready)
            return servers
        except PortInUse as exc:
            if attempt == PORT_ATTEMPTS:
                raise PortInUse(f"{exc} (gave up after {PORT_ATTEMPTS} starts, each on fresh ports)",
                                exc.server, exc.port) from None
            log.warning("live: %s; starting %s again on other ports", exc, exc.server.name)
            processes.stop(exc.server)
            servers[exc.server.name] = _launch(processes, specs[exc.server.name])
    raise AssertionError("unreachable")


def _launch(processes: Processes, launch: Launch) -> Server:
    ports = {name: free_port() for name in launch.port_names}
    return processes.start(launch.name, launch.argv(ports), url=f"http://{LOOPBACK}:{ports[launch.port_names[0]]}",
                           env=launch.env, ports=tuple(ports.values()))


def bind_failure(server: Server) -> tuple[int, str] | None:
    """(port, line) when the server's log says a bind failed on one of its ports; None otherwise,
    and always for a server started without `ports`. A line naming only other ports (a transfer
    engine's own, tried and skipped) is not this server failing to start."""
    if not server.ports:
        return None
    try:
        text = server.log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if not BIND_FAILED.search(line):
            continue
        named = [p for p in server.ports if re.search(rf"(?<!\d){p}(?!\d)", line)]
        if named:
            return named[0], line.strip()[:200]
    return None


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
