"""The differential probes (`probes/`), run for real on SGLang release trees.

The probe harness runs in the CPU probe interpreter with the tree under test as
the only SGLang on the path. These tests need:

- SGLANG_BACKPORT_PROBE_PYTHON: the probe virtualenv's python (CPU torch and
  probes/requirements-cpu.txt);
- SGLANG_BACKPORT_TEST_TREES: a directory of pristine release trees, one
  subfolder per version (e.g. `0.5.19/sglang/...`, as git repositories for the
  patched-tree tests).

Without them the probe_env tests skip. The bad-input tests need neither: the
harness refuses a tree before importing anything heavy.

Each harness run costs ~10 s (one SGLang import); results are cached per tree
for the session.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "probes" / "shims"
PATCHES = REPO / "patches"
PROBE_PYTHON = os.environ.get("SGLANG_BACKPORT_PROBE_PYTHON")
TEST_TREES = os.environ.get("SGLANG_BACKPORT_TEST_TREES")

VERDICTS = {"safe", "unsafe", "error", "not-applicable"}
FIXED_PROBES = ("admission", "prefill_retire", "handoff")

# Measured on the pristine wheels (S safe, U unsafe, - not-applicable), in case order.
EXPECTED = {
    #                                                   17   18   19   20   21   22
    ("admission", "prefill_door_rejected_not_enqueued"): "UUUUSS",
    ("admission", "decode_door_rejected_not_enqueued"): "UUUUSS",
    ("admission", "prefill_door_valid_admitted"): "SSSSSS",
    ("admission", "decode_door_valid_admitted"): "SSSSSS",
    ("admission", "prefill_door_metadata_owner_not_retired"): "SSSSSS",
    ("admission", "prefill_door_retraction_backup_not_retired"): "-SSSSS",
    ("admission", "prefill_door_preempted_reentry_not_retired"): "SSSSSS",
    ("admission", "decode_door_retracted_not_retired"): "SSSSSS",
    ("admission", "decode_door_rebootstrap_not_retired"): "SSSSSS",
    ("admission", "decode_door_preempted_reentry_not_retired"): "SSSSSS",
    ("admission", "null_mode_dispatch_untouched"): "SSSSSS",
    ("prefill_retire", "final_aborted_result_retired"): "UUUSSS",
    ("prefill_retire", "delayed_result_after_retirement_ignored"): "UUUSSS",
    ("prefill_retire", "sender_abort_failure_does_not_skip_cleanup"): "UUUSSS",
    ("prefill_retire", "middle_chunk_inflight_delays_retirement"): "UUUSSS",
    ("prefill_retire", "valid_finished_request_sends_kv"): "SSSSSS",
    ("handoff", "oversized_prompt_handoff_not_started"): "UUUSSS",
    ("handoff", "fitting_prompt_covers_reservation"): "SSSSSS",
    ("page_lifetime", "failed_transfer_holds_pages_until_drain"): "UUUUSS",
    ("page_lifetime", "ack_before_registration_not_counted"): "--SSSS",
    ("page_lifetime", "ack_after_release_not_counted"): "--SSSS",
    ("page_lifetime", "no_capability_backend_releases_at_once"): "SSSSSS",
}
RELEASES = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22")
LETTER = {"safe": "S", "unsafe": "U", "not-applicable": "-", "error": "E"}

needs_probe_env = pytest.mark.skipif(
    not (PROBE_PYTHON and TEST_TREES),
    reason="set SGLANG_BACKPORT_PROBE_PYTHON (probe venv python) and SGLANG_BACKPORT_TEST_TREES "
    "(dir of release trees, one subfolder per version) to run the probes",
)


def harness(tree: Path, *probes: str, python: str | None = None, extra_path: Path | None = None):
    """Run `python -m probes.harness` the way the toolkit's runner does."""
    path = [str(REPO), str(SHIMS)] + ([str(extra_path)] if extra_path else []) + [str(tree)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    cmd = [python or PROBE_PYTHON, "-m", "probes.harness", "--tree", str(tree)]
    for p in probes:
        cmd += ["--probe", p]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@lru_cache(maxsize=None)
def probe_doc(tree: str) -> dict:
    proc = harness(Path(tree))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # exactly one JSON document, nothing else


def release_trees() -> list[Path]:
    if not TEST_TREES:
        return []
    root = Path(TEST_TREES)
    return sorted(p for p in root.iterdir() if (p / "sglang" / "__init__.py").is_file())


def _ids(paths):
    return [p.name for p in paths]


def verdict_row(doc: dict) -> dict:
    return {(c["probe"], c["case"]): c["verdict"] for c in doc["cases"]}


# ---- bad input (no probe environment needed) -----------------------------------------------------


def test_tree_without_sglang_is_bad_input(tmp_path):
    proc = harness(tmp_path, python=sys.executable)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["tree"] == str(tmp_path) and "no sglang/" in doc["error"]


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
    for path in (REPO / "probes").glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+backport\b", path.read_text(), re.M), path


# ---- real trees ----------------------------------------------------------------------------------


@pytest.mark.probe_env
@needs_probe_env
@pytest.mark.parametrize("tree", release_trees(), ids=_ids(release_trees()))
def test_harness_document_shape(tree):
    doc = probe_doc(str(tree))
    assert doc["tree"] == str(tree.resolve()) or doc["tree"] == str(tree)
    assert Path(doc["sglang_file"]).resolve().is_relative_to(tree.resolve())
    assert isinstance(doc["import_seconds"], float) and doc["torch"]
    if re.fullmatch(r"\d+\.\d+\.\d+", tree.name):
        assert doc["version"] == tree.name
    keys = [(c["probe"], c["case"]) for c in doc["cases"]]
    assert keys == list(EXPECTED), "case names and order are stable across releases"
    for case in doc["cases"]:
        assert case["verdict"] in VERDICTS
        assert case["expect"] and case["observed"] and isinstance(case["details"], dict)
        assert case["verdict"] != "error", (case["case"], case["details"])
        if case["must_preserve"]:
            assert case["verdict"] in ("safe", "not-applicable"), (case["case"], case["observed"])


@pytest.mark.probe_env
@needs_probe_env
@pytest.mark.parametrize("tree", release_trees(), ids=_ids(release_trees()))
def test_pristine_release_verdicts(tree):
    if tree.name not in RELEASES:
        pytest.skip(f"{tree.name} is not one of the measured releases {RELEASES}")
    col = RELEASES.index(tree.name)
    got = verdict_row(probe_doc(str(tree)))
    want = {key: row[col] for key, row in EXPECTED.items()}
    assert {k: LETTER[v] for k, v in got.items()} == want


@pytest.mark.probe_env
@needs_probe_env
def test_details_are_deterministic():
    trees = release_trees()
    if not trees:
        pytest.skip("no trees")
    first = dict(probe_doc(str(trees[0])))
    second = json.loads(harness(trees[0]).stdout)
    first.pop("import_seconds"), second.pop("import_seconds")
    assert first == second


@pytest.mark.probe_env
@needs_probe_env
def test_single_probe_selection():
    trees = release_trees()
    if not trees:
        pytest.skip("no trees")
    proc = harness(trees[0], "handoff")
    assert proc.returncode == 0
    assert {c["probe"] for c in json.loads(proc.stdout)["cases"]} == {"handoff"}


# ---- patched trees: the pack makes old releases behave like the fixed one ------------------------


def _series_variants(version: str) -> list[Path]:
    """The pack's variant for `version` of every fix in patches/series (by Applies-To)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    chosen = []
    series = PATCHES / "series"
    if not series.is_file():
        return chosen
    for line in series.read_text().splitlines():
        fix = line.split("#", 1)[0].strip()
        if not fix or not (PATCHES / fix).is_dir():
            continue
        for patch in sorted((PATCHES / fix).glob("*.patch")):
            m = re.search(r"^Applies-To:\s*(.+)$", patch.read_text(), re.M)
            if m and Version(version) in SpecifierSet(m.group(1).strip()):
                chosen.append(patch)
                break
    return chosen


def _patched_releases() -> list[Path]:
    return [t for t in release_trees() if t.name in RELEASES and _series_variants(t.name)]


@pytest.mark.probe_env
@needs_probe_env
@pytest.mark.parametrize("tree", _patched_releases(), ids=_ids(_patched_releases()))
def test_patched_tree_matches_fixed_release(tree, tmp_path):
    """On a tree with the pack applied, every admission/prefill_retire/handoff case
    has the verdict of 0.5.21 (the first release with both fixes), must-preserve
    cases stay safe, and nothing errors."""
    if shutil.which("git") is None:
        pytest.skip("git not available")
    dest = tmp_path / tree.name
    subprocess.run(["git", "clone", "-q", str(tree), str(dest)], check=True)
    for patch in _series_variants(tree.name):
        subprocess.run(["git", "apply", str(patch)], cwd=dest, check=True)
    doc = probe_doc(str(dest))
    fixed = RELEASES.index("0.5.21")
    for case in doc["cases"]:
        key = (case["probe"], case["case"])
        assert case["verdict"] != "error", (key, case["details"])
        if case["must_preserve"]:
            assert case["verdict"] in ("safe", "not-applicable"), (key, case["observed"])
        if case["probe"] in FIXED_PROBES:
            want = EXPECTED[key][fixed]
            if EXPECTED[key][RELEASES.index(tree.name)] == "-":
                want = "-"  # the structure the case needs does not exist in this release
            assert LETTER[case["verdict"]] == want, (key, case["observed"])
