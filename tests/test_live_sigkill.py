"""SIGKILL of `sglang-backport live` (as the OOM killer does) on a real 0.5.22 PD deployment.

Nothing of the deployment (servers, their scheduler children, the router) may be left 15 s
later, neither a process nor a listening socket: once while the servers load, once while the
scenarios run. One full deployment start in all (the first kill comes before either server is
ready). The second also records every listener of the deployment: each port the tier chose is
bound to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backport.live import supervisor
from tests.conftest import REPO
from tests.test_live import serving  # noqa: F401 - the session's serving environment and model

pytestmark = [pytest.mark.live, pytest.mark.probe_env]
BOUND_SECONDS = 15.0


def _marked(token: bytes) -> list[int]:
    """Live processes carrying the reaper's mark `token`: every process the deployment started."""
    needle = f"{supervisor.MARKER}=".encode() + token + b"\0"
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and \
                    needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _token(cli: int) -> bytes | None:
    """The mark the CLI's Processes gives its servers, read from a child of the CLI."""
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != cli:
                continue
            for item in (entry / "environ").read_bytes().split(b"\0"):
                if item.startswith(f"{supervisor.MARKER}=".encode()):
                    return item.split(b"=", 1)[1]
        except (OSError, IndexError, ValueError):
            continue
    return None


def _listeners(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes hold, read in their own namespace."""
    found = set()
    for pid in pids:
        inodes = set()
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):  # an fd closed while the folder is read
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
        for table in ("tcp", "tcp6"):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:
                        address, port = cols[1].split(":")
                        found.add((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    if len(hex_address) == 8:
        return ".".join(str(b) for b in reversed(bytes.fromhex(hex_address)))
    return "::" if set(hex_address) == {"0"} else hex_address


def _listening_anywhere(ports: set[int]) -> set[int]:
    """Which of `ports` any process of this network namespace still listens on."""
    busy = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].split(":")[1], 16) in ports:
                busy.add(int(cols[1].split(":")[1], 16))
    return busy


class Cli:
    """`sglang-backport live TREE` in the background, its stderr collected line by line."""

    def __init__(self, tree: Path, serving_env, logs: Path):
        env = {**os.environ, "SGLANG_BACKPORT_PROBE_PYTHON": str(serving_env.python)}
        self.proc = subprocess.Popen([sys.executable, "-m", "backport.cli", "live", str(tree), "--logs", str(logs)],
                                     cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def wait_for(self, predicate, seconds: float, what: str):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            assert self.proc.poll() is None, f"live exited {self.proc.returncode} before {what}:\n" + \
                "".join(self.lines[-20:])
            time.sleep(1)
        raise AssertionError(f"no {what} after {seconds:.0f} s:\n" + "".join(self.lines[-20:]))

    def sigkill_and_measure(self, token: bytes) -> float:
        """SIGKILL, then the seconds until no process of the deployment and none of its ports is left."""
        pids = _marked(token)
        ports = {port for _, port in _listeners(pids)}
        self.proc.kill()
        self.proc.wait(timeout=10)
        started = time.monotonic()
        while time.monotonic() - started < BOUND_SECONDS:
            if not _marked(token) and not _listening_anywhere(ports):
                return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"{BOUND_SECONDS:.0f} s after SIGKILL: processes {_marked(token)}, "
                             f"listening {_listening_anywhere(ports)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigkill_while_the_servers_load_leaves_nothing(serving, release_tree, tmp_path):  # noqa: F811
    cli = Cli(release_tree("0.5.22").path, serving[0], tmp_path)
    try:
        token = cli.wait_for(lambda: _token(cli.proc.pid), 120, "server started")
        # both servers have forked their scheduler children: the grandchildren are in play
        cli.wait_for(lambda: len(_marked(token)) >= 4, 240, "scheduler children")
        seconds = cli.sigkill_and_measure(token)
    finally:
        cli.stop()
    print(f"during start: nothing left {seconds:.1f} s after SIGKILL")


def test_sigkill_during_the_scenarios_leaves_nothing(serving, release_tree, tmp_path):  # noqa: F811
    cli = Cli(release_tree("0.5.22").path, serving[0], tmp_path)
    try:
        token = cli.wait_for(lambda: _token(cli.proc.pid), 120, "server started")
        cli.wait_for(lambda: any("running" in line and "scenarios" in line for line in cli.lines), 900,
                     "scenarios running")
        progress = [line for line in cli.lines if re.search(r"live: .*starting, \d+ s, waiting for", line)]
        assert progress, "no progress line while the pair started"
        time.sleep(5)  # a scenario's requests in flight
        pids = _marked(token)
        listeners, chosen = _listeners(pids), _chosen_ports(pids)
        assert chosen and chosen <= {port for _, port in listeners}
        assert {address for address, port in listeners if port in chosen} == {"127.0.0.1"}, listeners
        others = sorted((a, p) for a, p in listeners if p not in chosen)
        seconds = cli.sigkill_and_measure(token)
    finally:
        cli.stop()
    print(f"during scenarios: nothing left {seconds:.1f} s after SIGKILL; listeners not chosen by the tier: {others}")


def _chosen_ports(pids: list[int]) -> set[int]:
    """The ports the tier put on the command lines (servers, bootstrap, router, metrics), read back
    from the deployment's processes."""
    ports = set()
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for flag in ("--port", "--disaggregation-bootstrap-port", "--prometheus-port"):
            if flag in argv:
                ports.add(int(argv[argv.index(flag) + 1]))
    return ports
