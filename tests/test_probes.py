"""The differential probes (`probes/`), run for real on SGLang release trees.

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

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "probes" / "shims"
PATCHES = REPO / "patches"

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


def harness(tree: Path, *probes: str, python: str, extra_path: Path | None = None):
    """Run `python -m probes.harness` the way the toolkit's runner does."""
    path = [str(REPO), str(SHIMS)] + ([str(extra_path)] if extra_path else []) + [str(tree)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    cmd = [python, "-m", "probes.harness", "--tree", str(tree)]
    for p in probes:
        cmd += ["--probe", p]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)


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
        assert not re.search(r"^\s*(from|import)\s+backport\b", path.read_text(), re.MULTILINE), path


# ---- real trees ----------------------------------------------------------------------------------

_DOCS: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="session")
def probe_doc(probe_python, release_tree, patched_tree):
    """probe_doc("0.5.19", "pristine" | "patched") -> the harness document for that tree."""
    from backport.probing import run_harness

    def get(version: str, role: str = "pristine") -> dict:
        key = (version, role)
        if key not in _DOCS:
            tree = release_tree(version) if role == "pristine" else patched_tree(version)[0]
            _DOCS[key] = run_harness(probe_python, tree.package_root)
        return _DOCS[key]

    return get


@pytest.mark.probe_env
@pytest.mark.parametrize("version", RELEASES)
def test_pristine_release_document_and_verdicts(version, probe_doc, release_tree):
    doc = probe_doc(version)
    tree = release_tree(version)
    assert Path(doc["sglang_file"]).resolve().is_relative_to(tree.package_root.resolve())
    assert doc["version"] == version and isinstance(doc["import_seconds"], float) and doc["torch"]
    keys = [(c["probe"], c["case"]) for c in doc["cases"]]
    assert keys == list(EXPECTED), "case names and order are stable across releases"
    for case in doc["cases"]:
        assert case["verdict"] in VERDICTS
        assert case["expect"] and case["observed"] and isinstance(case["details"], dict)
        assert case["verdict"] != "error", (case["case"], case["details"])
        if case["must_preserve"]:
            assert case["verdict"] in ("safe", "not-applicable"), (case["case"], case["observed"])
    col = RELEASES.index(version)
    got = {key: LETTER[v] for key, v in verdict_row(doc).items()}
    assert got == {key: row[col] for key, row in EXPECTED.items()}


@pytest.mark.probe_env
def test_details_are_deterministic(probe_doc, probe_python, release_tree):
    from backport.probing import run_harness

    first = dict(probe_doc("0.5.19"))
    second = run_harness(probe_python, release_tree("0.5.19").package_root)
    first.pop("import_seconds"), second.pop("import_seconds")
    assert first == second


@pytest.mark.probe_env
def test_single_probe_selection(probe_python, release_tree):
    from backport.probing import run_harness

    doc = run_harness(probe_python, release_tree("0.5.19").package_root, ["handoff"])
    assert {c["probe"] for c in doc["cases"]} == {"handoff"}


# ---- patched trees: the pack makes old releases behave like the fixed one ------------------------


@pytest.mark.probe_env
@pytest.mark.parametrize("version", ["0.5.17", "0.5.18", "0.5.19", "0.5.20"])
def test_patched_tree_matches_fixed_release(version, probe_doc, patched_tree):
    """With the pack applied, every admission/prefill_retire/handoff case has the verdict of
    0.5.21 (the first release with both fixes), must-preserve cases stay safe, nothing errors,
    and every incident case that was unsafe on the pristine tree is safe."""
    _, report = patched_tree(version)
    assert report.status == "applied", report.to_json()
    pristine = verdict_row(probe_doc(version))
    doc = probe_doc(version, "patched")
    fixed = RELEASES.index("0.5.21")
    for case in doc["cases"]:
        key = (case["probe"], case["case"])
        assert case["verdict"] != "error", (key, case["details"])
        if case["must_preserve"]:
            assert case["verdict"] in ("safe", "not-applicable"), (key, case["observed"])
        if case["probe"] in FIXED_PROBES:
            want = EXPECTED[key][fixed]
            if EXPECTED[key][RELEASES.index(version)] == "-":
                want = "-"  # the structure the case needs does not exist in this release
            assert LETTER[case["verdict"]] == want, (key, case["observed"])
            if pristine[key] == "unsafe":
                assert case["verdict"] == "safe", key


@pytest.mark.probe_env
@pytest.mark.parametrize("version", ["0.5.17", "0.5.18", "0.5.19", "0.5.20"])
def test_page_lifetime_on_patched_tree(version, probe_doc):
    """Pack II holds a failed transfer's pages until the drain ACKs on 0.5.19/0.5.20, as 0.5.21
    does; 0.5.17/0.5.18 get no page-lifetime backport (README), so their verdicts stay as they were."""
    doc = probe_doc(version, "patched")
    got = {c["case"]: LETTER[c["verdict"]] for c in doc["cases"] if c["probe"] == "page_lifetime"}
    column = RELEASES.index("0.5.21" if version in ("0.5.19", "0.5.20") else version)
    assert got == {case: EXPECTED[("page_lifetime", case)][column] for case in got}
    if version in ("0.5.17", "0.5.18"):
        assert got["failed_transfer_holds_pages_until_drain"] == "U"  # the exposure that remains, shown
