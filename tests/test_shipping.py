"""Shipping: the toolkit installed from its wheel, outside the checkout.

The wheel is built with `pip wheel --no-deps .` and installed with `pip install WHEEL` from the
normal package index (its dependencies come from there, as an operator's would) into a fresh
virtual environment in a temporary directory; every command then runs with that directory as
the working directory, so nothing of the checkout is on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backport import evidence, resources
from tests.conftest import REPO, WORKSPACE_CACHE
from tests.test_evidence import fixture_run


def test_a_checkout_uses_its_own_folders():
    """Run from the checkout, an edit to patches/ takes effect without reinstalling."""
    assert resources.checkout_root() == REPO
    assert resources.pack_dir() == REPO / "patches"
    assert resources.probes_dir() == REPO / "probes"
    assert resources.receipt_schema() == REPO / "evidence" / "receipt.schema.json"


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(env)
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, check=False, timeout=600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the toolkit installed from its wheel: its bin/."""
    root = tmp_path_factory.mktemp("installed")
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w", str(root / "dist")],
                 cwd=root)
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("sglang_backport-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sglang_backport_data/patches/series" in names
    assert "sglang_backport_data/receipt.schema.json" in names
    assert "sglang_backport_probes/requirements-cpu.txt" in names
    assert "sglang_backport_probes/shims/sgl_kernel/sgl_kernel/__init__.py" in names
    assert not any(n.startswith("probes/") for n in names), "the probes must not install as top-level `probes`"
    made = _run([sys.executable, "-m", "venv", str(root / "venv")], cwd=root)
    assert made.returncode == 0, made.stderr
    pip = _run([str(root / "venv" / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], cwd=root)
    assert pip.returncode == 0, pip.stderr
    return root / "venv" / "bin"


@pytest.mark.network
def test_the_installed_toolkit_finds_its_data_and_runs(installed, tmp_path):
    where = _run([str(installed / "python"), "-c",
                  ("from backport import resources as r; print(r.checkout_root()); print(r.pack_dir());"
                   "print(r.probes_dir()); print(r.receipt_schema())")], cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    root, pack, probes, schema = where.stdout.split()
    assert root == "None"
    for path, tail in ((pack, "sglang_backport_data/patches"), (probes, "sglang_backport_probes"),
                       (schema, "sglang_backport_data/receipt.schema.json")):
        assert path.endswith(tail) and "site-packages" in path and not path.startswith(str(REPO))

    cli = str(installed / "sglang-backport")
    cache = {"SGLANG_BACKPORT_CACHE": str(WORKSPACE_CACHE)}
    status = _run([cli, "status", "sglang==0.5.19"], cwd=tmp_path, **cache)
    assert status.returncode == 0, status.stderr
    assert "sglang 0.5.19" in status.stdout and "pr38935    missing" in status.stdout

    check = _run([cli, "apply", "--check", "sglang==0.5.19"], cwd=tmp_path, **cache)
    assert check.returncode == 0, check.stderr
    assert "pr38935" in check.stdout

    bundle = evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "run"))
    verified = _run([cli, "verify", str(bundle)], cwd=tmp_path, **cache)
    assert verified.returncode == 0, verified.stderr + verified.stdout
    assert verified.stdout.startswith("OK ")
    (bundle / "REPORT.md").write_text("edited\n")
    refused = _run([cli, "verify", str(bundle)], cwd=tmp_path, **cache)
    assert refused.returncode == 1 and "REPORT.md" in refused.stdout + refused.stderr
