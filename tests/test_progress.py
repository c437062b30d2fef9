"""No phase silent for more than the progress interval (issue 43 row 16), with the interval made
short: a slow step, a download (its bytes so far) and a removal print a line; a phase that prints
its own progress gets no extra ones."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from backport import cache
from backport.job import progress
from tests.synthetic import build_wheel


@pytest.fixture
def lines(monkeypatch):
    """The lines the `backport` loggers print, at a progress interval of 0.1 s."""
    monkeypatch.setattr(progress, "INTERVAL", 0.1)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler, logger = Keep(), logging.getLogger("backport")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield seen
    logger.removeHandler(handler)
    logger.setLevel(old)


def test_a_slow_step_says_it_is_still_running(lines):
    steps = progress.Progress(total=1, target="sglang==0.5.19")
    with steps.step("bundle", "writing the evidence bundle"):
        time.sleep(0.45)
    still = [line for line in lines if "sglang==0.5.19 bundle: still running" in line]
    assert len(still) >= 2, lines  # one per interval, each with the time so far
    assert lines[0] == "[sglang==0.5.19 1/1] writing the evidence bundle ..."


def test_a_phase_that_prints_its_own_progress_gets_no_extra_lines(lines):
    log = logging.getLogger("backport.probing")
    with progress.heartbeat("probing"):
        for n in range(15):
            log.info("probe matrix: %d", n)
            time.sleep(0.03)
    assert lines == [f"probe matrix: {n}" for n in range(15)]


def test_the_wheel_download_prints_its_bytes_so_far(lines, monkeypatch, tmp_path):
    """pip stood in for by a download that grows in pip's temporary directory (TMPDIR), then lands."""
    from backport.sources import wheel as wheel_source

    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(tmp_path / "cache"))
    made = build_wheel(tmp_path / "upstream", "9.9.9")

    def pip_download(cmd, env, **_):
        partial = Path(env["TMPDIR"]) / "pip-unpack-1" / made.name
        partial.parent.mkdir()
        with partial.open("wb") as fh:
            for _ in range(5):
                fh.write(b"\0" * 400_000)
                fh.flush()
                time.sleep(0.08)
        (Path(cmd[cmd.index("-d") + 1]) / made.name).write_bytes(made.read_bytes())

        class Done:
            returncode, stdout, stderr = 0, "", ""
        return Done()

    monkeypatch.setattr(wheel_source.subprocess, "run", pip_download)
    kept = wheel_source.WheelSource("sglang==9.9.9", "9.9.9", None)._download(cache.cache_root())
    assert kept.read_bytes() == made.read_bytes()
    sizes = [line for line in lines if line.strip().startswith("downloading sglang==9.9.9 ...")]
    assert sizes and all(line.endswith(" MB so far") for line in sizes), lines
    assert float(sizes[-1].split(", ")[-1].split()[0]) > 0.3  # the bytes grew as pip wrote them


def test_removing_a_large_folder_says_so(lines, monkeypatch, tmp_path):
    folder = tmp_path / "env"
    folder.mkdir()
    (folder / "big").write_bytes(b"x")
    real = cache.shutil.rmtree

    def slow_rmtree(path, **kwargs):
        time.sleep(0.3)  # a 2 GB environment on a slow disk
        real(path, **kwargs)

    monkeypatch.setattr(cache.shutil, "rmtree", slow_rmtree)
    cache.discard_dir(folder)
    assert not folder.exists()
    assert any(line.strip().startswith(f"removing {folder} ...") for line in lines), lines
