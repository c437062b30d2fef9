"""The live tier on real PD deployments: pristine and patched 0.5.19, and 0.5.22 (the reference).

One deployment per tree for the whole session (started, driven through every scenario and
`audit --live`, stopped), then the tests read the results. Each pair costs ~4 GB and a couple of
minutes of two cores; the three together add about ten minutes to the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backport.live.servers import group_members
from tests.conftest import REPO, _with_cache

pytestmark = [pytest.mark.live, pytest.mark.probe_env]

TREES = ("pristine-0.5.19", "patched-0.5.19", "reference-0.5.22")


@pytest.fixture(scope="session")
def serving(shared_cache, probe_python):
    from backport.live import ensure_model, ensure_serving_env

    with _with_cache(shared_cache):
        env = ensure_serving_env(probe_python)
        return env, ensure_model(env.python)


@pytest.fixture(scope="session")
def live_results(serving, release_tree, patched_tree, tmp_path_factory):
    """label -> {"scenarios": {name: result}, "audit": audit --live's JSON, "exit": its code}."""
    from backport.live.deployment import deployed
    from backport.live.scenarios import REGISTRY
    from backport.live.tier import run_scenario

    env, model = serving
    trees = {"pristine-0.5.19": release_tree("0.5.19"), "patched-0.5.19": patched_tree("0.5.19")[0],
             "reference-0.5.22": release_tree("0.5.22")}
    results = {}
    for label in TREES:
        tree = trees[label]
        with deployed(
            env, Path(tree.package_root), tree.version, model, tmp_path_factory.mktemp(label)
        ) as dep:
            scenarios = {item.name: run_scenario(item, dep, model).to_json() for item in REGISTRY}
            audit = subprocess.run([sys.executable, "-m", "backport.cli", "audit", "--live", dep.router_url,
                                    "--live-count", "2", "--json"], capture_output=True, text=True, cwd=REPO,
                                   timeout=300, check=False)
        results[label] = {"scenarios": scenarios, "audit": json.loads(audit.stdout), "exit": audit.returncode}
    return results


def _verdict(results, label, scenario):
    return results[label]["scenarios"][scenario]["verdict"]


def test_valid_prompt_matches_reference_everywhere(live_results, serving):
    _, model = serving
    for label in TREES:
        result = live_results[label]["scenarios"]["valid_prompt_matches_reference"]
        assert result["verdict"] == "safe", (label, result)
        assert result["details"]["reply"]["tokens"] == model.reference["valid"]


def test_over_pool_prompt_served_on_pristine_rejected_on_patched_and_reference(live_results):
    pristine = live_results["pristine-0.5.19"]["scenarios"]["over_pool_prompt_rejected"]
    assert pristine["verdict"] == "unsafe"
    assert pristine["details"]["reply"]["status"] == 200
    assert pristine["details"]["reply"]["prompt_tokens"] == 400
    for label in ("patched-0.5.19", "reference-0.5.22"):
        result = live_results[label]["scenarios"]["over_pool_prompt_rejected"]
        assert result["verdict"] == "safe", (label, result)
        assert result["details"]["reply"]["status"] == 400
        assert result["details"]["reply"]["tokens"] == []


def test_rejected_request_reads_another_requests_prompt_only_on_pristine(live_results):
    pristine = live_results["pristine-0.5.19"]["scenarios"]["rejected_request_reads_no_other_request"]
    assert pristine["verdict"] == "unsafe", pristine
    after_a, after_b, after_a_again = (s["rejected_reply"]["tokens"] for s in pristine["details"]["steps"])
    assert after_a != after_b and after_a == after_a_again
    assert _verdict(live_results, "reference-0.5.22", "rejected_request_reads_no_other_request") == "safe"


# The live tier's finding (README, Live tier): a decode flushed during a deferred hold freed the
# held pages twice and died ("pool memory leak detected"). The patched tree carries sbp-flush-holds
# (flush refused during a hold: probes/cases/flush_holds.py proves it); on 0.5.22 the scenarios do not
# flush right after a refused request (Deployment.flush_frees_held_pages).
def test_patched_rejected_request_is_refused_every_time_and_decode_survives(live_results):
    result = live_results["patched-0.5.19"]["scenarios"]["rejected_request_reads_no_other_request"]
    assert result["verdict"] == "safe", result
    assert not any("leak" in line for line in result["details"]["log"].get("decode", []))
    # R refused: no flush is needed after it, and none is sent
    assert [s["flush"] for s in result["details"]["steps"]][1:] == [
        "left out: the previous R was refused"
    ] * 2


def test_only_the_reference_flushes_with_a_hold_hazard(live_results):
    over_pool = {
        label: live_results[label]["scenarios"]["over_pool_prompt_rejected"]["details"] for label in TREES
    }
    assert "sbp-flush-holds" in over_pool["reference-0.5.22"]["decode_flush_skipped"]
    for label in ("pristine-0.5.19", "patched-0.5.19"):
        assert over_pool[label]["decode_flush_accepted_after_seconds"] is not None, label


def test_refused_requests_reservation_is_released_on_patched_and_reference(live_results, serving):
    """Decode's load (read from /v1/loads) is back at its idle baseline within 0.5.22's bound after
    two refused over-pool requests, and the next valid prompt gets the reference tokens; pristine
    serves the prompt, so there is no refusal to release."""
    pristine = live_results["pristine-0.5.19"]["scenarios"]["rejected_request_releases_decode_reservation"]
    assert pristine["verdict"] == "not-applicable" and "served" in pristine["observed"], pristine
    for label in ("patched-0.5.19", "reference-0.5.22"):
        result = live_results[label]["scenarios"]["rejected_request_releases_decode_reservation"]
        assert result["verdict"] == "safe", (label, result)
        details = result["details"]
        assert details["decode_load"].startswith("/v1/loads") and details["baseline_tokens"] == 0, details
        assert [r["status"] for r in details["refused"]] == [400, 400]
        assert details["released_after_seconds"] is not None
        assert details["released_after_seconds"] <= details["bound_seconds"]
        assert details["next_valid"]["tokens"] == serving[1].reference["valid"]
        cost = details["concurrent_cost"]
        assert cost["valid_only"]["valid_p50_seconds"] is not None and cost["mix"]["valid_wrong_tokens"] == 0
        assert cost["mix"]["over_pool_statuses"] == ["400"], cost


def test_over_decode_pool_is_not_applicable_with_its_reason(live_results):
    for label in TREES:
        result = live_results[label]["scenarios"]["over_decode_pool_prompt_rejected"]
        assert result["verdict"] == "not-applicable" and "decode's pool" in result["observed"]


def test_bootstrap_route_poisoned_on_pristine_and_reference_refused_on_patched(live_results, serving):
    """No release authenticates PUT /route (sgl-project/sglang#39400): on pristine 0.5.19 and on
    0.5.22 a client without a token points rank 0's entry at the scenario's sink and reads it back;
    the entry is put back and the pair serves on. Patched (sbp-bootstrap-auth): 401 without a
    header, 403 with a wrong token, the entry unchanged, the sink silent."""
    reference = serving[1].reference["valid"]
    for label in ("pristine-0.5.19", "reference-0.5.22"):
        result = live_results[label]["scenarios"]["bootstrap_route_poisoning_refused"]
        assert result["verdict"] == "unsafe", (label, result)
        details = result["details"]
        assert [a["put"]["status"] for a in details["attempts"]] == [200, 200], details
        assert details["attempts"][0]["read_back"]["entry"] == details["attacker"]
        assert details["restore"]["read_back"]["entry"] == details["before"]["entry"]
        assert details["final_valid"]["tokens"] == reference
    result = live_results["patched-0.5.19"]["scenarios"]["bootstrap_route_poisoning_refused"]
    assert result["verdict"] == "safe", result
    details = result["details"]
    assert [a["put"]["status"] for a in details["attempts"]] == [401, 403]
    assert all(a["read_back"]["entry"] == details["before"]["entry"] for a in details["attempts"])
    assert details["dp_rank"]["register"]["status"] == 401 and details["sink_connections"] == []
    assert "restore" not in details and details["final_valid"]["tokens"] == reference


def test_audit_live_gate_2_fails_on_pristine_passes_on_patched_and_reference(live_results):
    def gate(label, number):
        return next(g for g in live_results[label]["audit"]["gates"] if g["gate"] == number)

    for label in TREES:  # the pairs run the incident's misconfiguration on purpose
        assert gate(label, 1)["verdict"] == "fail"
        assert any(line.startswith("live: ") for line in gate(label, 1)["evidence"])
    assert gate("pristine-0.5.19", 2)["verdict"] == "fail"
    assert live_results["pristine-0.5.19"]["exit"] == 1
    assert "incident's fingerprint" in gate("pristine-0.5.19", 2)["evidence"][-1]
    assert gate("reference-0.5.22", 2)["verdict"] == "pass", gate("reference-0.5.22", 2)


def test_audit_live_gate_2_passes_on_patched(live_results):
    gate = next(g for g in live_results["patched-0.5.19"]["audit"]["gates"] if g["gate"] == 2)
    assert gate["verdict"] == "pass", gate


def _processes_naming(needle: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_sigint_mid_start_leaves_no_server_or_listener(serving, release_tree, tmp_path, shared_cache):
    """`live` interrupted while the servers load: every process of the deployment is gone."""
    tree = release_tree("0.5.22")
    model_path = str(serving[1].path)
    env = {**os.environ, "SGLANG_BACKPORT_CACHE": str(shared_cache),
           "SGLANG_BACKPORT_PROBE_PYTHON": str(serving[0].python)}
    proc = subprocess.Popen([sys.executable, "-m", "backport.cli", "live", str(tree.path)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pgids: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and len(group_members(pgids)) < 4:  # both servers have forked
            pgids = {_pgid(pid) for pid in _processes_naming(model_path)} - {None}
            time.sleep(1)
        assert len(pgids) == 2 and len(group_members(pgids)) >= 4, "the servers never started"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert group_members(pgids) == []
    from backport.live.servers import listening_pids

    assert not listening_pids(set(_processes_naming(model_path)))
