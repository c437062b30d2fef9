"""The `mori_hold` probe on real release trees: the tree's own decode `MoriKVManager` (built by
its constructor, the `mori` RDMA library stood in for) and `MoriKVReceiver`, pristine and patched.
One harness run per tree (mori_hold only), cached for the session."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.probe_env

HOLD = "aborted_mori_transfer_holds_pages"
OFF = "mori_off_switch_releases_at_once"
@pytest.fixture(scope="session")
def mori(probe_cases):
    """mori("0.5.21", "pristine"|"patched") -> {case name: case result} of the mori_hold probe."""
    return lambda version, kind: probe_cases("mori_hold", version, kind)


def test_pristine_0_5_21_releases_a_decode_aborted_mori_transfer_at_once(mori):
    case = mori("0.5.21", "pristine")[HOLD]
    assert case["verdict"] == "unsafe", case
    details = case["details"]
    # the real Mori decode: no capability, the ABORT sent to the prefill rank, pages back at pop_transferred
    assert details["backend"] == "MoriKVManager" and details["capability"] is False
    assert details["sent_to_prefill"] == ["ABORT"] and details["steps"][0]["pages_held"] == 0
    assert details["threads_started_by_constructor"] == 0  # the listener threads stay unstarted


def test_patched_0_5_21_holds_until_the_timeout_without_claiming_the_capability(mori):
    cases = mori("0.5.21", "patched")
    assert {name: c["verdict"] for name, c in cases.items()} == {HOLD: "safe", OFF: "safe"}
    details = cases[HOLD]["details"]
    assert details["capability"] is False and details["backend_flag"] is True
    held, _, after = details["steps"]
    assert held["pages_held"] > 0 and held["deferred_entries"] == 1
    assert after["pages_held"] == 0 and after["release_calls"] == 1 and after["metadata_frees"] == 1
    # the off switch still releases at once
    assert cases[OFF]["details"]["backend_flag"] is False


def test_reference_0_5_22_holds_with_its_own_capability(mori):
    case = mori("0.5.22", "pristine")[HOLD]
    assert case["verdict"] == "safe", case
    assert case["details"]["capability"] is True
