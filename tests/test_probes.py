"""The probe harness (`probes/`): bad input, determinism and selection.

Per-release verdicts live in the release matrix and are checked in tests/test_matrix.py.

The harness runs in the CPU probe interpreter (the session's `probe_python` fixture: built
once, or SGLANG_BACKPORT_PROBE_PYTHON) with the tree under test as the only SGLang on the
path, through the toolkit's own runner (`backport.probing.run_harness`). Pristine trees are
the real PyPI wheels (`release_tree`); patched trees are fresh clones with the whole pack
applied by the engine (`patched_tree`). The bad-input tests need neither.

Each harness run costs ~10 s (one SGLang import); results are cached per tree for the session.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backport.probing.harness import launch

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "probes" / "standins" / "shims" / "torchvision"
PATCHES = REPO / "patches"

def harness(tree: Path, *probes: str, python: str, extra_path: Path | None = None):
    """Run the harness the way the toolkit's runner does (launch.py, the probe package off the path)."""
    path = [str(SHIMS)] + ([str(extra_path)] if extra_path else []) + [str(tree)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    cmd = [*launch(python, "harness"), "--tree", str(tree)]
    for p in probes:
        cmd += ["--probe", p]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)


# ---- bad input (no probe environment needed) -----------------------------------------------------


def test_tree_without_sglang_is_bad_input(tmp_path):
    proc = harness(tmp_path, python=sys.executable)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["tree"] == str(tmp_path) and "no sglang/" in doc["error"]


def test_the_launcher_keeps_the_package_folder_off_the_path(tmp_path):
    """The child registers the probe package from its folder: neither that folder's parent (a
    site-packages, a checkout) nor a link to the package is on its path, and nothing is linked."""
    from backport.probing.harness import probe_environ

    env = probe_environ(sys.executable, tmp_path)
    assert not any((Path(p) / "probes").exists() or (Path(p) / "sglang_backport_probes").exists()
                   for p in env["PYTHONPATH"].split(os.pathsep))
    proc = subprocess.run([*launch(sys.executable, "harness"), "--tree", str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "no sglang/" in json.loads(proc.stdout)["error"], proc.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # no link made in the working folder


def test_unknown_probe_is_bad_input(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    proc = harness(tmp_path, "no_such_probe", python=sys.executable)
    assert proc.returncode == 2
    assert "unknown probe" in json.loads(proc.stdout)["error"]


def test_shadowing_sglang_is_bad_input(tmp_path):
    """A different sglang earlier on the path than the tree under test is refused."""
    for name in ("tree", "other"):
        (tmp_path / name / "sglang").mkdir(parents=True)
        (tmp_path / name / "sglang" / "__init__.py").write_text("__version__ = '0.0'\n")
    proc = harness(tmp_path / "tree", python=sys.executable, extra_path=tmp_path / "other")
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert "not the tree under test" in doc["error"], doc


def test_probes_never_import_the_toolkit():
    for path in (REPO / "probes").rglob("*.py"):  # the probe packages' scenario modules too
        assert not re.search(r"^\s*(from|import)\s+backport\b", path.read_text(), re.MULTILINE), path


def test_nixl_agent_stand_in_follows_its_plan():
    """The NIXL agent stand-in (prefill_drain's NIXL case): ERR and DONE handles are settled, a running
    sibling counts as in flight until the probe settles it, and every posted write is recorded."""
    from probes.rigs.nixl import NixlAgentStandIn
    from probes.standins import Ledger

    ledger = Ledger()
    agent = NixlAgentStandIn(ledger, ["err", "running"])
    failed, sibling, third = agent.post("kv"), agent.post("kv"), agent.post("aux")
    assert [agent.check_xfer_state(h) for h in (failed, sibling, third)] == ["ERR", "PROC", "DONE"]
    assert agent.in_flight == 1
    agent.settle()
    assert agent.check_xfer_state(sibling) == "DONE" and agent.in_flight == 0
    assert [e["mode"] for e in ledger.of("write_posted")] == ["err", "running", "done"]
    assert ledger.of("writes_settled") == [{"kind": "writes_settled", "count": 1}]



def test_page_pool_stand_in_returns_pages_only_when_every_reserved_slot_came_back():
    """The transfer rig's page pool, freed by slot (a release that frees a request's row itself, as the
    pack's refused-room release up to 0.4.6.post4 does): one slot short keeps the owner's pages held,
    and a slot freed twice is recorded."""
    from probes.standins import Ledger
    from probes.standins.memory import CountingTokenToKVPoolAllocator, ReqToTokenPoolStandIn

    ledger = Ledger()
    pool = CountingTokenToKVPoolAllocator(ledger, "decode", 8, 16)
    rows = ReqToTokenPoolStandIn(ledger)
    row = rows.assign(pool.token_slots(pool.reserve("r", 40))[:40])
    assert pool.held_by("r") == 3 and pool.available_size() == 5 * 16
    pool.free(rows.req_to_token[row, :39])
    assert pool.held_by("r") == 3  # one slot short: nothing back
    pool.free(rows.req_to_token[row, 39:40])
    assert pool.held_by("r") == 0 and pool.available_size() == 8 * 16
    pool.free(rows.req_to_token[row, :1])
    assert ledger.count("slots_freed_unowned") == 1
    rows.free(row)
    rows.free(row)
    assert ledger.count("req_row_double_free") == 1
# ---- real trees ----------------------------------------------------------------------------------

@pytest.mark.probe_env
def test_selection_is_deterministic(probe_python, release_tree):
    """One probe selected, run twice: only its cases, and the same document apart from timing."""
    from backport.probing import run_harness

    root = release_tree("0.5.19").package_root
    first, second = (run_harness(probe_python, root, ["handoff"]) for _ in range(2))
    assert {c["probe"] for c in first["cases"]} == {"handoff"} and len(first["cases"]) >= 2
    first.pop("import_seconds"), second.pop("import_seconds")
    assert first == second
