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
LATE_BOOTSTRAP = "aborted_room_stays_failed_on_late_bootstrap"
PER_LAYER = "per_layer_send_reports_failure_after_every_write"  # needs no drain accounting: runs on 0.5.18

@pytest.fixture(scope="session")
def drain(probe_cases):
    """drain("0.5.21", "pristine"|"patched") -> {case name: case result} of the prefill_drain probe."""
    return lambda version, kind: probe_cases("prefill_drain", version, kind)


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
            assert cases[name]["must_preserve"] and cases[name]["verdict"] == "safe", (
                version,
                kind,
                cases[name],
            )


def test_release_without_drain_accounting_is_not_applicable(drain):
    cases = {name: c for name, c in drain("0.5.18", "pristine").items() if name != PER_LAYER}
    assert set(verdicts(cases).values()) == {"not-applicable"}, verdicts(cases)
    assert all("no #35049" in c["details"]["reason"] for c in cases.values())


def test_late_bootstrap_un_fails_an_aborted_room_until_patched(drain):
    """Failed was not terminal on 0.5.19 (update_status took the max): a decode rank registering after another
    rank's ABORT lifted the room to WaitingForInput and its chunk was written after the drain ACK. The pack
    carries 0.5.20's rule (pr41402); the reference keeps the room Failed."""
    pristine = drain("0.5.19", "pristine")[LATE_BOOTSTRAP]
    assert pristine["verdict"] == "unsafe", pristine
    assert pristine["details"]["status_after_late_info"] == "WaitingForInput"
    assert pristine["details"]["writes_after_drain_ack"] > 0
    for version, kind in (("0.5.19", "patched"), ("0.5.22", "pristine")):
        case = drain(version, kind)[LATE_BOOTSTRAP]
        assert case["verdict"] == "safe", (version, kind, case)
        assert case["details"]["status_after_late_info"] == "Failed"
        assert case["details"]["chunks_queued"] == 0 and case["details"]["writes_after_drain_ack"] == 0
        assert sum(case["details"]["acks_per_peer"].values()) == 1  # the ABORTing rank did get its ACK


def test_per_layer_send_waits_for_every_write_from_0_5_19(drain):
    """The real send_kvcache's per-layer futures: 0.5.18 reports the failed layer while a sibling still
    writes; 0.5.19 (and the reference) only once every write landed."""
    early = drain("0.5.18", "pristine")[PER_LAYER]
    assert early["verdict"] == "unsafe" and early["details"]["returned_while_a_write_ran"], early
    for version, kind in (("0.5.19", "pristine"), ("0.5.22", "pristine")):
        case = drain(version, kind)[PER_LAYER]
        assert case["verdict"] == "safe", (version, kind, case)
        assert case["details"]["returned"] == -1
        landed = [e["kind"] for e in case["details"]["events"]]
        assert landed.index("layer_write_landed") < landed.index("send_returned"), landed


CONSTRUCTED = (
    "constructed_manager_holds_an_ack_per_aborting_peer",
    "constructed_manager_poisoned_room_withholds_ack_until_reopened",
    "cleared_sender_drops_target_without_drain_accounting",
)


def test_constructed_manager_registry_pristine_patched_reference(drain):
    """Issue 14: the drain-ACK registry as CommonKVManager.__init__ sets it up (a real ZMQ socket on
    localhost; the bootstrap sync, registration and PP group stood in for). Pristine 0.5.19 holds one target
    per room (the first ABORTing rank never gets its ACK) and has no poisoned rooms; the patched tree and the
    reference hold one per endpoint and keep a poisoned room silent until its next request."""
    held, poisoned, cleared = CONSTRUCTED
    pristine = drain("0.5.19", "pristine")
    assert pristine[held]["verdict"] == "unsafe", pristine[held]
    for run in pristine[held]["details"].values():
        assert run["targets_held_while_outstanding"] == [
            "10.0.1.2:17101"
        ]  # the last ABORT replaced the first
    assert pristine[poisoned]["verdict"] == "not-applicable"
    assert pristine[cleared]["verdict"] == "safe"
    for version, kind in (("0.5.19", "patched"), ("0.5.22", "pristine")):
        cases = drain(version, kind)
        assert [cases[n]["verdict"] for n in CONSTRUCTED] == ["safe"] * 3, (version, kind)
        built = [*cases[held]["details"].values(), cases[poisoned]["details"], cases[cleared]["details"]]
        for details in built:
            # the constructor ran for real: it registered (stand-in) and started no thread
            assert details["registered_to_bootstrap"] == 1 and details["constructor_started_threads"] == 0
        for run in cases[held]["details"].values():
            assert run["acks_before_drain"] == []
            assert sorted(run["acks_to"]) == ["10.0.1.1:17100", "10.0.1.2:17101"]
        assert cases[poisoned]["details"]["targets_after_poison"] == []
        assert cases[poisoned]["details"]["acks_while_poisoned"] == []
        assert cases[cleared]["details"]["targets_after_clear"] == []
    # 0.5.19's patched manager counts nothing itself: clear() drops the target without an ACK (#40645's
    # branch); 0.5.22's constructor sets the count up, so clear() ACKs the quiescent room.
    patched_clear = drain("0.5.19", "patched")[cleared]["details"]
    assert not patched_clear["manager_counts_outstanding"] and patched_clear["acks_to"] == []
    reference_clear = drain("0.5.22", "pristine")[cleared]["details"]
    assert reference_clear["manager_counts_outstanding"] and reference_clear["acks_to"] == ["10.0.1.1:17100"]


SEND_LOCK = "abort_ack_sent_under_endpoint_lock"
# the pr35049-ack variant as it shipped before issue 41's send lock (ACK pushed on the bare cached socket)
UNLOCKED_ACK_COMMIT = "acb075204b3bf2ee04b6c51fc3cae248c03d1558"


def _check_locked_pushes(case: dict) -> None:
    assert case["verdict"] == "safe", case
    details = case["details"]
    heads = [p["head"] for p in details["sequential_pushes"]]
    assert heads[0] == "ABORT_ACK" and len(heads) == 1 + sum(
        r == "pushed" for r in details["release_pushes"].values())
    assert all(p["lock_held"] for p in details["sequential_pushes"])
    raced = details["raced_pushes"]
    assert sorted(p["head"] for p in raced) == ["ABORT_ACK", "AUX_DATA"]
    assert {p["thread"] for p in raced} == {"bootstrap", "transfer"}
    assert not any(p["overlapped"] for p in raced)
    # the real PULL socket got every push, the ACK with its room and this prefill rank
    assert len(details["frames_received"]) == len(heads) + 2
    # 0.5.22 adds the ABORT's generation as a fourth frame
    assert ["ABORT_ACK", "721", "0"] in [f[:3] for f in details["frames_received"]]


@pytest.mark.parametrize("version", ["0.5.13", "0.5.16"])
def test_drain_ack_pushes_under_the_endpoint_lock_where_the_release_has_none(drain, version):
    """Issue 41: 0.5.13 - 0.5.16 keep one PUSH socket per decode endpoint without 0.5.17's send lock, and the
    pack's drain ACK leaves from the bootstrap thread and the transfer workers. Patched, the ACK and the
    release's own pushes on that socket (status, aux, CHUNK_READY) hold the endpoint's lock, and an ACK racing
    another thread's aux push never shares the socket with it. Pristine has no drain ACK: not-applicable."""
    assert drain(version, "pristine")[SEND_LOCK]["verdict"] == "not-applicable"
    case = drain(version, "patched")[SEND_LOCK]
    _check_locked_pushes(case)
    assert set(case["details"]["release_pushes"].values()) == {"pushed"}


def test_drain_ack_send_lock_is_the_reference_s(drain):
    """0.5.22's own ACK and pushes take the lock (its status push has another name: absent here)."""
    _check_locked_pushes(drain("0.5.22", "pristine")[SEND_LOCK])


def test_the_variant_without_the_lock_is_caught(probe_python, release_tree, tmp_path):
    """The case tells: 0.5.16 with pr35049-ack as it shipped before the lock (from this repository's history)
    pushes the ACK without the lock, and the ACK and another thread's push meet on the socket."""
    import shutil
    import subprocess

    from backport.engine import apply_series
    from backport.pack import load_pack
    from backport.probing import run_harness
    from backport.tree import clone_tree
    from tests.conftest import REPO

    series = tmp_path / "patches"
    shutil.copytree(REPO / "patches", series)
    name = "pr35049-ack/pr35049-ack-0.5.16.patch"
    old = subprocess.run(["git", "show", f"{UNLOCKED_ACK_COMMIT}:patches/{name}"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    assert "_send_multipart_locked(" not in old.split("\n---\n", 1)[1]
    (series / name).write_text(old)
    dest = tmp_path / "tree"
    tree = clone_tree(release_tree("0.5.16"), dest.parent, dest)
    assert apply_series(dest, load_pack(series), "0.5.16").status == "applied"
    doc = run_harness(probe_python, tree.package_root, ["prefill_drain"], label="unlocked 0.5.16")
    case = next(c for c in doc["cases"] if c["case"] == SEND_LOCK)
    assert case["verdict"] == "unsafe", case
    assert not any(p["lock_held"] for p in case["details"]["sequential_pushes"])
    # the unlocked pushes met on the socket (a meeting is waited for, bounded: on a loaded host one
    # racing push can still miss it, so one meeting is the proof, as the verdict says)
    assert any(p["overlapped"] for p in case["details"]["raced_pushes"]), case["details"]
