"""Shipping: the toolkit installed from its wheel, outside the checkout.

The wheel is built with `pip wheel --no-deps .` and installed with `pip install WHEEL` from the
normal package index (its dependencies come from there, as an operator's would) into a fresh
virtual environment in a temporary directory; every command then runs with that directory as
the working directory, so nothing of the checkout is on the path.
"""

from __future__ import annotations

import json
import os
import shutil
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
    # Built from a copy of the checkout's files as git sees them (tracked, and new files not ignored):
    # pip builds a local folder in place, and setuptools' build/lib there keeps every module an
    # earlier build wrote, so a module moved since (probes/ by kind) would ship twice.
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    source = root / "source"
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(source), "-w", str(root / "dist")],
        cwd=root,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("sglang_backport-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sglang_backport_data/patches/series" in names
    assert "sglang_backport_data/receipt.schema.json" in names
    assert "sglang_backport_probes/requirements-cpu.txt" in names
    assert "sglang_backport_probes/standins/shims/sgl_kernel/sgl_kernel/__init__.py" in names
    # every kind of probe module ships, and the probes that are packages of scenario modules ship whole
    assert {"sglang_backport_probes/cases/prefill_drain/drain_ack.py",
            "sglang_backport_probes/cases/page_lifetime/drain_hold.py", "sglang_backport_probes/rigs/door.py",
            "sglang_backport_probes/standins/addons.py", "sglang_backport_probes/runtime/harness.py",
            "sglang_backport_probes/runtime/launch.py"} <= set(names)
    # what only the tests run does not ship, nor do the maintainer tools
    assert not any(n.endswith("/server_info.py") or n.startswith("tools/") for n in names)
    assert not any(n.startswith("probes/") for n in names), (
        "the probes must not install as top-level `probes`"
    )
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

    # the receipt's toolkit record: no git commit outside a checkout, but the wheel and the code by digest
    record = _run(
        [
            str(installed / "python"),
            "-c",
            "import json; from backport.evidence import toolkit_info; "
            "print(json.dumps(toolkit_info().to_json()))",
        ],
        cwd=tmp_path,
    )
    assert record.returncode == 0, record.stderr
    toolkit = json.loads(record.stdout)
    (wheel,) = (installed.parent.parent / "dist").glob("sglang_backport-*.whl")
    assert toolkit["git_commit"] is None and toolkit["distribution"] == {
        "installed_from": "wheel", "wheel": wheel.name, "wheel_sha256": evidence.sha256_file(wheel)}
    assert toolkit["code"]["probes_sha256"] == evidence.environment.directory_digest(REPO / "probes")

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


@pytest.mark.network
@pytest.mark.probe_env
def test_run_export_from_the_installed_toolkit_deploys_and_verifies(installed, probe_python, tmp_path):
    """The issue's whole path: from the installed toolkit, `run sglang==0.5.19 --export` writes a bundle
    holding the patched wheel and the series; the wheel installs with `pip install --no-deps` into a
    fresh environment, whose package the probes then judge (every incident case safe) and `status
    installed` recognises; `sign` then `verify --key` pass, and an edited byte of the wheel fails."""
    cli = str(installed / "sglang-backport")
    cache = {"SGLANG_BACKPORT_CACHE": str(WORKSPACE_CACHE)}
    bundle = tmp_path / "bundle"
    ran = _run([cli, "run", "sglang==0.5.19", "--export", "--python", probe_python, "--no-upstream-tests",
                "--out", str(bundle)], cwd=tmp_path, **cache)
    assert ran.returncode == 0, ran.stderr[-2000:] + ran.stdout[-2000:]
    assert "exported: " in ran.stdout
    (wheel,) = (bundle / "export").glob("sglang-0.5.19+backport.*.whl")
    assert len(list((bundle / "export" / "patches").glob("*.patch"))) > 0

    # A fresh environment for the deployment: the probe environment's third-party packages (torch and
    # SGLang's dependencies, without sglang) through a .pth file, and the exported wheel, --no-deps.
    deploy = tmp_path / "deploy"
    assert _run([sys.executable, "-m", "venv", str(deploy)], cwd=tmp_path).returncode == 0
    (site,) = (deploy / "lib").glob("python3.*/site-packages")
    (probe_site,) = (Path(probe_python).parent.parent / "lib").glob("python3.*/site-packages")
    (site / "probe_env_packages.pth").write_text(f"{probe_site}\n")
    python = str(deploy / "bin" / "python")
    pip = _run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=tmp_path)
    assert pip.returncode == 0, pip.stderr

    probed = _run([cli, "probe", str(site), "--python", python, "--json"], cwd=tmp_path, **cache)
    assert probed.returncode in (0, 1), probed.stderr[-2000:]
    (doc,) = json.loads(probed.stdout)["trees"]
    # the incident's cases whose code is 0.5.19's (a case scoped to other releases by `needs` says
    # not-applicable)
    from backport.expectations import outside_release
    incident = [c for c in doc["cases"] if c["probe"] in ("admission", "prefill_retire", "handoff")
                and not outside_release(f"{c['probe']}/{c['case']}", "0.5.19")]
    assert incident and all(c["verdict"] == "safe" for c in incident), [
        (c["probe"], c["case"], c["verdict"]) for c in incident if c["verdict"] != "safe"]

    status = _run([cli, "status", "installed", "--python", python, "--bundle", str(bundle), "--json"],
                  cwd=tmp_path, **cache)
    assert status.returncode == 0, status.stderr
    found = json.loads(status.stdout)["installed"]
    assert found["version"].startswith("0.5.19+backport.") and found["digest_matches_record"] is True
    assert found["bundles"] == [{"bundle": str(bundle), "verifies": True, "problem": None}]

    key, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True)
    assert _run([cli, "sign", str(bundle), "--key", str(key)], cwd=tmp_path).returncode == 0
    assert _run([cli, "verify", str(bundle), "--key", str(pub)], cwd=tmp_path).returncode == 0
    data = bytearray(wheel.read_bytes())
    data[len(data) // 3] ^= 1
    wheel.write_bytes(bytes(data))
    refused = _run([cli, "verify", str(bundle), "--key", str(pub)], cwd=tmp_path)
    assert refused.returncode == 1 and wheel.name in refused.stdout
