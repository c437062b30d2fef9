"""A SIGTERM at any point of the probe environment's build leaves nothing behind: not in $TMPDIR
(pip's temporary directories go into the cache's staging entry), not in the cache, and no process.

Real signals to a real `sglang-backport env` process; the real `ensurepip` runs, and `pip install`
is replaced by a stand-in that unpacks into its temporary directory as pip does and then waits
(the thing under test is our cleanup, not pip)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DRIVER = r'''
import sys
from backport.probing import env

SLOW_PIP = """
import os, sys, tempfile, time
unpacked = tempfile.mkdtemp(prefix="pip-unpack-")
with open(os.path.join(unpacked, "torch.whl"), "wb") as handle:
    handle.write(b"0" * 100000)
with open(os.environ["SLOW_PIP_STARTED"], "w") as handle:
    handle.write(f"{os.getpid()} {unpacked}")
time.sleep(300)
"""
env._pip_install = lambda python, constraint, requirements: [sys.executable, "-c", SLOW_PIP]
from backport.cli import main
sys.exit(main(["env"]))
'''


def _wait_for(predicate, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the build to reach the point"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("point", ["ensurepip", "pip-install"])
def test_sigterm_during_the_environment_build_leaves_nothing(point, tmp_path):
    cache, tmp, started = tmp_path / "cache", tmp_path / "tmp", tmp_path / "slow-pip-started"
    tmp.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k != "SGLANG_BACKPORT_PROBE_PYTHON"},
           "SGLANG_BACKPORT_CACHE": str(cache), "TMPDIR": str(tmp), "SLOW_PIP_STARTED": str(started)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if point == "ensurepip":
            _wait_for(lambda: any((cache / "envs").glob(".probe-*.partial/tmp")), 60)
            time.sleep(1.0)  # ensurepip is running, unpacking pip in its temporary directory
            assert not started.exists()
        else:
            _wait_for(started.exists, 120)
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=20)
        answered = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1].startswith("sglang-backport: interrupted by SIGTERM")
    assert answered < 10
    assert list(tmp.iterdir()) == []                       # nothing in $TMPDIR
    assert list((cache / "envs").iterdir()) == []          # no half-built environment, no pip leftovers
    if point == "pip-install":
        pid, unpacked = started.read_text().split()
        assert Path(unpacked).is_relative_to(cache) and not Path(unpacked).exists()
        assert not _alive(int(pid))                        # the stand-in pip was stopped with us
