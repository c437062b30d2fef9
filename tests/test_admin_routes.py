"""The `admin_routes` probe on real release trees: the tree's own FastAPI app and key middleware,
driven in process, pristine and patched (#26789; the pack's pr26789). One harness run per tree
(admin_routes only), cached for the session."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.probe_env

REFUSED = "unkeyed_lora_tensor_load_refused"
ACCEPTED = "admin_keyed_lora_tensor_load_accepted"
ADMIN_ONLY = "admin key only, no key sent"
USER_KEY = "admin and API key, the API key sent"
ROUTE = "/load_lora_adapter_from_tensors"


@pytest.fixture(scope="session")
def admin(probe_cases):
    """admin("0.5.17", "pristine"|"patched") -> {case name: case result} of the admin_routes probe."""
    return lambda version, kind: probe_cases("admin_routes", version, kind)


@pytest.mark.parametrize("version", ["0.5.8", "0.5.17"])  # one per variant: 0.5.8 - 0.5.14, 0.5.15 - 0.5.21
def test_pristine_lets_a_caller_without_the_admin_key_load_an_adapter(admin, version):
    cases = admin(version, "pristine")
    assert cases[REFUSED]["verdict"] == "unsafe", cases[REFUSED]
    details = cases[REFUSED]["details"]
    # the route answers 200 and the adapter load reaches the tokenizer manager, while the sibling refuses
    for label in (ADMIN_ONLY, USER_KEY):
        assert details[label]["status"] == 200
        assert details[label]["loads_reaching_manager"] == [[ROUTE, "probe-adapter"]]
        assert details[label]["sibling_status"] == 401
    assert cases[ACCEPTED]["verdict"] == "safe", cases[ACCEPTED]


@pytest.mark.parametrize("version", ["0.5.8", "0.5.17"])
def test_patched_refuses_it_before_the_handler_and_keeps_the_admin_call(admin, version):
    cases = admin(version, "patched")
    assert {name: c["verdict"] for name, c in cases.items()} == {REFUSED: "safe", ACCEPTED: "safe"}
    refused = cases[REFUSED]["details"]
    assert all(refused[label]["status"] == 401 and refused[label]["loads_reaching_manager"] == []
               for label in (ADMIN_ONLY, USER_KEY))
    accepted = cases[ACCEPTED]["details"]
    assert {label: d["status"] for label, d in accepted.items()} == {"admin key configured and sent": 200,
                                                                     "no key configured": 200}


def test_reference_0_5_22_behaves_as_the_patched_tree(admin):
    cases = admin("0.5.22", "pristine")
    assert {name: c["verdict"] for name, c in cases.items()} == {REFUSED: "safe", ACCEPTED: "safe"}
    assert cases[REFUSED]["details"][ADMIN_ONLY]["status"] == 401


def test_releases_before_the_route_are_not_applicable(admin):
    cases = admin("0.5.7", "pristine")
    assert {c["verdict"] for c in cases.values()} == {"not-applicable"}
    assert all("0.5.8" in c["observed"] for c in cases.values())
