"""`sglang-backport live --serve TREE`: one pair kept up, its router URL printed, everything stopped
on SIGTERM (the way it is meant to end), and `audit --live URL` against it in the meantime."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO
from tests.test_live import serving  # noqa: F401 - the session's serving environment and model
from tests.test_live_lifetime import alive as _alive
from tests.test_live_lifetime import descendants as _tree
from tests.test_live_sigkill import _listeners, _listening_anywhere

BOUND_SECONDS = 15.0


def test_serve_wants_exactly_one_tree(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "backport.cli", "live", "--serve", str(tmp_path), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 2
    expected = "sglang-backport: error: live --serve keeps one pair up: give one TREE, not 2"
    assert proc.stderr.strip().splitlines() == [expected]


@pytest.mark.live
@pytest.mark.probe_env
def test_serve_prints_the_router_and_sigterm_leaves_nothing(serving, release_tree, shared_cache):  # noqa: F811
    env = {**os.environ, "SGLANG_BACKPORT_CACHE": str(shared_cache),
           "SGLANG_BACKPORT_PROBE_PYTHON": str(serving[0].python)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "backport.cli", "live", "--serve", str(release_tree("0.5.22").path), "--json"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 900
        while not lines and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert lines, (
            f"no router URL (exit {proc.poll()}): {proc.stderr.read() if proc.poll() is not None else ''}"
        )
        served = json.loads(lines[0])
        assert served["router"].startswith("http://127.0.0.1:") and served["version"] == "0.5.22"
        audit = subprocess.run([sys.executable, "-m", "backport.cli", "audit", "--live", served["router"],
                                "--live-count", "1", "--json"], capture_output=True, text=True, cwd=REPO,
                               timeout=300, check=False)
        gate = next(g for g in json.loads(audit.stdout)["gates"] if g["gate"] == 2)
        assert gate["verdict"] == "pass", gate   # 0.5.22 refuses the over-pool prompt at admission
        assert proc.poll() is None, "live --serve ended by itself"
        tree = _tree(proc.pid)
        ports = {port for _, port in _listeners(list(tree))}
        assert len(tree) >= 5 and ports   # the reaper, prefill, decode (and their children), the router
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        started = time.monotonic()
        while (_alive(tree) or _listening_anywhere(ports)) and time.monotonic() - started < BOUND_SECONDS:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read()
    assert not _alive(tree) and not _listening_anywhere(ports)
    assert len(lines) == 1   # the URL line and nothing else on stdout
