"""The `prefill_drain` probe on real release trees, pristine and patched (issue 13).

Each test runs the probe for real: the tree's own Mooncake transfer worker, ABORT handler and
`CommonKVManager` ACK registry, in the CPU probe environment, through the toolkit's runner.
One harness run per tree (prefill_drain only, ~30 s of SGLang import), cached for the session.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.probe_env

FAILED_SEND = "failed_send_withholds_ack_while_writes_in_flight"
MUST_PRESERVE = ("successful_transfer_untouched", "without_capability_keeps_immediate_ack")

_RUNS: dict[tuple[str, str], dict[str, dict]] = {}


@pytest.fixture(scope="session")
def drain(probe_python, release_tree, patched_tree):
    """drain("0.5.21", "pristine"|"patched") -> {case name: case result}."""
    from backport.probing import run_harness

    def get(version: str, kind: str) -> dict[str, dict]:
        key = (version, kind)
        if key not in _RUNS:
            tree = release_tree(version) if kind == "pristine" else patched_tree(version)[0]
            doc = run_harness(probe_python, tree.package_root, ["prefill_drain"], label=f"{kind} {version}")
            assert doc["version"] == version
            _RUNS[key] = {c["case"]: c for c in doc["cases"]}
        return _RUNS[key]

    return get


def verdicts(cases: dict[str, dict]) -> dict[str, str]:
    return {name: c["verdict"] for name, c in cases.items()}


@pytest.mark.parametrize("version", ["0.5.19", "0.5.21"])
def test_pristine_acks_a_failed_send_while_its_write_runs(drain, version):
    case = drain(version, "pristine")[FAILED_SEND]
    assert case["verdict"] == "unsafe", case
    assert case["details"]["acks_while_writes_in_flight"] >= 1
    # the write really was posted and timed out while running
    assert case["details"]["writes_posted"][0] == "timeout"


@pytest.mark.parametrize("version", ["0.5.19", "0.5.21"])
def test_patched_withholds_the_ack_and_matches_the_reference(drain, version):
    patched = drain(version, "patched")
    assert set(verdicts(patched).values()) == {"safe"}, verdicts(patched)
    failed = patched[FAILED_SEND]["details"]
    assert failed["acks_while_writes_in_flight"] == 0
    assert sum(failed["acks_per_peer"].values()) == 0  # withheld for good: decode uses its timeout
    assert verdicts(patched) == verdicts(drain("0.5.22", "pristine"))


def test_patched_keeps_fan_out_to_every_peer_that_asked(drain):
    """#41402 on 0.5.19: both decode ranks aborted during the transfer; each gets its ACK
    (pristine 0.5.19 keeps only the last ABORT's target)."""
    name = "abort_during_transfer_acks_each_peer_once_after_drain"
    pristine = drain("0.5.19", "pristine")[name]
    patched = drain("0.5.19", "patched")[name]
    assert pristine["verdict"] == "unsafe" and 0 in pristine["details"]["acks_per_peer"].values()
    assert patched["verdict"] == "safe" and min(patched["details"]["acks_per_peer"].values()) >= 1


def test_must_preserve_cases_hold_everywhere(drain):
    for version, kind in (("0.5.19", "pristine"), ("0.5.19", "patched"), ("0.5.22", "pristine")):
        cases = drain(version, kind)
        for name in MUST_PRESERVE:
            assert cases[name]["must_preserve"] and cases[name]["verdict"] == "safe", (version, kind, cases[name])


def test_release_without_drain_accounting_is_not_applicable(drain):
    cases = drain("0.5.18", "pristine")
    assert set(verdicts(cases).values()) == {"not-applicable"}, verdicts(cases)
    assert all("no #35049" in c["details"]["reason"] for c in cases.values())
