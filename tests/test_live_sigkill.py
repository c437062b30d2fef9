"""SIGKILL of `sglang-backport live` (as the OOM killer does) on a real 0.5.22 PD deployment.

Nothing of the deployment (servers, their scheduler children, the router) may be left 15 s
later, neither a process nor a listening socket: once while the servers load, once while the
scenarios run. One full deployment start in all (the first kill comes before either server is
ready). The second also takes the router's first port away (smg's bind failure is seen and it
starts again elsewhere) and records every listener of the deployment: each port the tier chose is
bound to 127.0.0.1; the others (Mooncake's and SGLang's own) are printed.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from backport.live import supervisor
from tests.conftest import REPO
from tests.test_live import serving  # noqa: F401 - the session's serving environment and model
from tests.test_live_lifetime import alive as _alive
from tests.test_live_lifetime import descendants as _tree

pytestmark = [pytest.mark.live, pytest.mark.probe_env]
BOUND_SECONDS = 15.0


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


# `sglang-backport live ...` whose router is first offered a port that is taken (argv[1]), as when
# another process binds it between free_port() and smg's bind.
TAKEN_ROUTER_PORT = textwrap.dedent("""
    import sys
    from backport.cli import main
    from backport.live import servers
    taken, launch = int(sys.argv[1]), servers._launch
    def first_router_on_taken_port(processes, spec):
        if spec.name != "router" or taken is None:
            return launch(processes, spec)
        globals()["taken"], free = None, servers.free_port
        offered = iter([int(sys.argv[1])])  # the router's own port; its metrics port as usual
        servers.free_port = lambda: next(offered, None) or free()
        try:
            return launch(processes, spec)
        finally:
            servers.free_port = free
    servers._launch = first_router_on_taken_port
    sys.exit(main(sys.argv[2:]))
""")


class Cli:
    """`sglang-backport live TREE` in the background, its stderr collected line by line."""

    def __init__(self, tree: Path, serving_env, logs: Path, taken_router_port: int | None = None):
        env = {**os.environ, "SGLANG_BACKPORT_PROBE_PYTHON": str(serving_env.python)}
        entry = ["-m", "backport.cli"] if taken_router_port is None else \
            ["-c", TAKEN_ROUTER_PORT, str(taken_router_port)]
        self.proc = subprocess.Popen(
            [sys.executable, *entry, "live", str(tree), "--logs", str(logs)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
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

    def sigkill_and_measure(self) -> float:
        """SIGKILL, then the seconds until no process of the deployment and none of its ports is left."""
        tree = _tree(self.proc.pid)
        ports = {port for _, port in _listeners(list(tree))}
        self.proc.kill()
        self.proc.wait(timeout=10)
        started = time.monotonic()
        while time.monotonic() - started < BOUND_SECONDS:
            if not _alive(tree) and not _listening_anywhere(ports):
                return time.monotonic() - started
            time.sleep(0.2)
        raise AssertionError(f"{BOUND_SECONDS:.0f} s after SIGKILL: processes {_alive(tree)}, "
                             f"listening {_listening_anywhere(ports)}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_sigkill_while_the_servers_load_leaves_nothing(serving, release_tree, tmp_path):  # noqa: F811
    cli = Cli(release_tree("0.5.22").path, serving[0], tmp_path)
    try:
        # the reaper, both servers and at least their scheduler children: the grandchildren are in play
        cli.wait_for(lambda: len(_tree(cli.proc.pid)) >= 5, 240, "scheduler children")
        time.sleep(2 * supervisor.SCAN_SECONDS)
        seconds = cli.sigkill_and_measure()
    finally:
        cli.stop()
    print(f"during start: nothing left {seconds:.1f} s after SIGKILL")


def test_sigkill_during_the_scenarios_leaves_nothing(serving, release_tree, tmp_path):  # noqa: F811
    """Also: the router's first port is taken (held here): smg's bind failure is seen and it starts
    again on another port; the servers' start shows progress lines."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    cli = Cli(release_tree("0.5.22").path, serving[0], tmp_path, taken_router_port=taken_port)
    try:
        cli.wait_for(lambda: any("running" in line and "scenarios" in line for line in cli.lines), 900,
                     "scenarios running")
        progress = [line for line in cli.lines if re.search(r"live: .*starting, \d+ s, waiting for", line)]
        assert progress, "no progress line while the pair started"
        retried = [line for line in cli.lines if f"router server could not bind port {taken_port}" in line]
        assert retried and "starting router again on other ports" in retried[0], cli.lines
        time.sleep(5)  # a scenario's requests in flight
        pids = list(_tree(cli.proc.pid))
        listeners, chosen = _listeners(pids), _chosen_ports(pids)
        assert chosen and chosen <= {port for _, port in listeners}
        assert {address for address, port in listeners if port in chosen} == {"127.0.0.1"}, listeners
        others = sorted((a, p) for a, p in listeners if p not in chosen)
        seconds = cli.sigkill_and_measure()
    finally:
        cli.stop()
        taken.close()
    print(
        f"during scenarios: nothing left {seconds:.1f} s after SIGKILL; listeners not chosen by the tier: "
        f"{others}"
    )


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
