"""Nothing the live tier starts outlives the command, and a taken port is retried: no SGLang here.

Stand-ins for a server (small Python scripts): SERVER listens on its port in the session
`Processes` gives it and forks a scheduler grandchild that listens too, both ignoring SIGTERM, as
`launch_server` and its scheduler do; in "escape" mode the grandchild also moves to a session of
its own and execs SCHEDULER with an empty environment (SGLang's setproctitle hides a scheduler's
environment from /proc the same way).
UVICORN_LIKE fails to bind as uvicorn does (logs Errno 98, then hangs, as prefill did).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backport.live import servers, supervisor
from backport.live.servers import Launch, PortInUse, Processes, free_port, serve, wait_ready

REPO = Path(__file__).resolve().parent.parent
BOUND_SECONDS = 15.0

SERVER = textwrap.dedent("""
    import os, signal, socket, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def listen(port):
        s = socket.socket(); s.bind(("127.0.0.1", port)); s.listen(); return s
    if os.fork() == 0:  # the scheduler
        if sys.argv[3] == "escape":  # its own session, and an environment without the run's mark
            os.setsid()
            os.execve(sys.executable, [sys.executable, "-c", SCHEDULER, sys.argv[2]], {})
        held = listen(int(sys.argv[2]))
        while True:
            time.sleep(1)
    held = listen(int(sys.argv[1]))
    while True:
        time.sleep(1)
""")
SCHEDULER = textwrap.dedent("""
    import signal, socket, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
    while True:
        time.sleep(1)
""")
SERVER = SERVER.replace("SCHEDULER, ", repr(SCHEDULER) + ", ")

# The CLI side: Processes with two stand-in servers, then it waits to be killed.
DRIVER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from backport.live.servers import Processes, sigterm_raises
    work, stand_in, ports = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    with sigterm_raises(), Processes(work) as processes:
        for i, mode in enumerate(("stay", "escape")):
            argv = [sys.executable, "-c", stand_in, ports[2 * i], ports[2 * i + 1], mode]
            processes.start(f"server{i}", argv, url="", env=None)
        print(json.dumps([s.process.pid for s in processes.servers]), flush=True)
        time.sleep(300)
""")

UVICORN_LIKE = textwrap.dedent("""
    import http.server, os, socket, sys, time
    port = int(sys.argv[1])
    try:
        server = http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    except OSError as exc:
        print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
              f"('127.0.0.1', {port}): address already in use", flush=True)
        time.sleep(600)  # prefill's scheduler kept it alive: it never exits on its own
    os.chdir(sys.argv[2])
    server.serve_forever()
""")


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _marked(token: str) -> list[int]:
    """Live processes carrying the reaper's mark `token` (every descendant of a started server)."""
    needle = f"{supervisor.MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _token_of(pid: int) -> str:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(f"{supervisor.MARKER}=".encode()):
            return item.split(b"=", 1)[1].decode()
    raise AssertionError(f"{pid} carries no mark")


def _wait(predicate, seconds: float) -> float | None:
    """Seconds until `predicate()` held, or None when it did not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live descendant of `root` (reaper included; read by parent links:
    SGLang's setproctitle hides a scheduler's environment from /proc)."""
    table = supervisor.processes()
    found: dict[int, str] = {}
    grew = True
    while grew:
        more = {pid for pid, (parent, _, _) in table.items() if parent == root or parent in found} - set(
            found
        )
        found.update({pid: table[pid][2] for pid in more})
        grew = bool(more)
    return found


def alive(tree: dict[int, str]) -> list[int]:
    table = supervisor.processes()
    return [pid for pid, started in tree.items() if pid in table and table[pid][2] == started]


def test_sigkill_of_the_cli_leaves_no_process_or_listener(tmp_path):
    """The OOM killer's SIGKILL: no `finally` runs, the reaper still stops both servers, their
    grandchildren (one in a session of its own, without the mark) and every port, within the
    bound, and exits."""
    ports = [free_port() for _ in range(4)]
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path), SERVER, *map(str, ports)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        pids = json.loads(driver.stdout.readline())
        assert _wait(lambda: all(_listening(p) for p in ports), 20) is not None, (
            "the stand-ins never listened"
        )
        token = _token_of(pids[0])
        assert len(_marked(token)) == 3  # two servers, the grandchild that stayed
        time.sleep(2 * supervisor.SCAN_SECONDS)  # the reaper has read the tree once since
        tree = descendants(driver.pid)
        assert len(tree) == 5  # two servers, two grandchildren, the reaper
        driver.kill()
        driver.wait(timeout=10)
    finally:
        if driver.poll() is None:
            driver.kill()
    seconds = _wait(lambda: not alive(tree) and not any(_listening(p) for p in ports), BOUND_SECONDS)
    assert seconds is not None, f"left after {BOUND_SECONDS} s: {alive(tree)}"
    print(f"nothing left {seconds:.1f} s after SIGKILL")


def test_the_reaper_finds_a_server_it_was_never_told_of(tmp_path):
    """The CLI killed between starting a server and writing its group: the mark still finds it."""
    token = "t" + os.urandom(4).hex()
    reaper = subprocess.Popen([sys.executable, "-I", supervisor.__file__, token], stdin=subprocess.PIPE,
                              start_new_session=True)
    port, child_port = free_port(), free_port()
    unregistered = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(child_port), "escape"],
                                    env={**os.environ, supervisor.MARKER: token}, start_new_session=True)
    try:
        assert _wait(lambda: _listening(port) and _listening(child_port), 20) is not None
        reaper.stdin.close()
        reaper.wait(timeout=BOUND_SECONDS)
        unregistered.wait(timeout=5)
    finally:
        for proc in (reaper, unregistered):
            if proc.poll() is None:
                proc.kill()
    assert not _marked(token)
    assert not _listening(port) and not _listening(child_port)


def test_stop_all_closes_the_reaper(tmp_path):
    port, child_port = free_port(), free_port()
    with Processes(tmp_path) as processes:
        processes.start("server", [sys.executable, "-c", SERVER, str(port), str(child_port), "stay"], url="",
                        env=None)
        reaper = processes._reaper
        assert reaper is not None and reaper.poll() is None
    assert reaper.poll() is not None
    assert not _listening(port) and not _listening(child_port)


def _held_port() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def _stand_in(tmp_path: Path) -> Launch:
    (tmp_path / "health").write_text("ok")
    return Launch(
        "prefill",
        lambda ports: [sys.executable, "-c", UVICORN_LIKE, str(ports["http"]), str(tmp_path)],
        ("http",),
        None,
    )


def test_a_port_taken_before_the_bind_is_seen_in_seconds_and_retried(tmp_path, monkeypatch, caplog):
    held = _held_port()
    taken = held.getsockname()[1]
    offered = iter([taken])
    monkeypatch.setattr(servers, "free_port", lambda: next(offered, None) or free_port())
    started = time.monotonic()
    with held, caplog.at_level(logging.WARNING, "backport.live"), Processes(tmp_path) as processes:
        server = serve(processes, [_stand_in(tmp_path)], "/health", timeout=60)["prefill"]
        assert server.ports != (taken,) and server.alive()
        assert len(processes.servers) == 1  # the first start was stopped
    assert time.monotonic() - started < 20
    assert f"prefill server could not bind port {taken}" in caplog.text


def test_a_port_taken_every_time_is_an_error_naming_it_and_the_server(tmp_path, monkeypatch):
    held = _held_port()
    taken = held.getsockname()[1]
    monkeypatch.setattr(servers, "free_port", lambda: taken)
    started = time.monotonic()
    with held, Processes(tmp_path) as processes, pytest.raises(PortInUse) as raised:
        serve(processes, [_stand_in(tmp_path)], "/health", timeout=60)
    assert time.monotonic() - started < 30
    message = str(raised.value)
    assert message.startswith(f"prefill server could not bind port {taken} on 127.0.0.1")
    assert f"gave up after {servers.PORT_ATTEMPTS} starts" in message
    assert raised.value.port == taken


def test_a_bind_failure_on_another_port_is_not_the_servers(tmp_path):
    """A transfer engine retrying its own port says so in the log: not a reason to restart."""
    port = free_port()
    log = tmp_path / "decode.log"
    log.write_text(f"W mooncake: bind 127.0.0.1:{port + 1} failed: Address already in use, trying next\n")
    server = servers.Server(
        "decode", subprocess.Popen(["sleep", "30"]), log, f"http://127.0.0.1:{port}", (port,)
    )
    try:
        assert servers.bind_failure(server) is None
        log.write_text(f"ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port})\n")
        assert servers.bind_failure(server)[0] == port
        # a server started without ports (a caller that does not retry) is never judged by its log
        assert servers.bind_failure(servers.Server("decode", server.process, log, server.url)) is None
    finally:
        server.process.kill()
        server.process.wait()


def test_a_progress_line_at_least_every_period_while_waiting(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(servers, "PROGRESS_SECONDS", 0.5)
    monkeypatch.setattr(servers, "POLL_SECONDS", 0.2)
    port = free_port()
    argv = [sys.executable, "-c", "import time; print('loading weights', flush=True); time.sleep(60)"]
    with caplog.at_level(logging.INFO, "backport.live"), Processes(tmp_path) as processes:
        server = processes.start("decode", argv, url=f"http://127.0.0.1:{port}", env=None, ports=(port,))
        with pytest.raises(servers.ServerDidNotStart):
            wait_ready([server], "/health", timeout=2.5)
    lines = [r.getMessage() for r in caplog.records if "starting" in r.getMessage()]
    assert len(lines) >= 3, lines
    assert all(
        re.fullmatch(r"live: decode starting, \d+ s, waiting for /health \(decode: loading weights\)", line)
        for line in lines
    ), lines
