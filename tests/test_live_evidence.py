"""`run --live` in a bundle: live/<role>.json under SHA256SUMS, predicate.live, the summary, verify."""

from __future__ import annotations

import json

from backport import evidence
from backport.records import LiveResult
from tests.test_evidence import _reseal, fixture_run

SCENARIOS = (
    "valid_prompt_matches_reference",
    "over_pool_prompt_rejected",
    "rejected_request_reads_no_other_request",
    "over_decode_pool_prompt_rejected",
)


def _live_doc(role: str, verdicts: dict[str, str]) -> dict:
    return {
        "tree": role,
        "version": "0.5.22" if role == "reference" else "0.5.19",
        "startup_seconds": 120.0,
        "server": {
            "version": "0.5.19",
            "flags": {"prefill": ["--max-total-tokens", "256"]},
            "backend": "mooncake",
            "router": "smg==1.13.0",
            "model_sha256": "0" * 64,
        },
        "scenarios": [
            {
                "scenario": name,
                "must_preserve": name.startswith("valid"),
                "expect": "",
                "verdict": verdicts.get(name, "safe"),
                "observed": "",
                "details": {},
                "seconds": 1.0,
            }
            for name in SCENARIOS
        ],
    }


INCIDENT = {"over_pool_prompt_rejected": "unsafe", "rejected_request_reads_no_other_request": "unsafe",
            "over_decode_pool_prompt_rejected": "not-applicable"}
CLOSED = {"over_decode_pool_prompt_rejected": "not-applicable"}


def _bundle(tmp_path, monkeypatch, patched=CLOSED):
    docs = {"pristine": _live_doc("pristine", INCIDENT), "patched": _live_doc("patched", patched),
            "reference": _live_doc("reference", CLOSED)}
    results = {role: LiveResult.from_json(doc) for role, doc in docs.items()}
    return evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "run", live=results))


def test_live_bundle_verifies_and_counts_the_pairs(tmp_path, monkeypatch):
    bundle = _bundle(tmp_path, monkeypatch)
    sums = (bundle / "SHA256SUMS").read_text()
    assert all(f"  live/{role}.json" in sums for role in ("pristine", "patched", "reference"))
    receipt = json.loads((bundle / "receipt.json").read_text())
    live = receipt["predicate"]["live"]
    assert {r["scenario"]: r["pair"] for r in live["scenarios"]} == {
        "valid_prompt_matches_reference": "held",
        "over_pool_prompt_rejected": "fixed",
        "rejected_request_reads_no_other_request": "fixed",
        "over_decode_pool_prompt_rejected": "not-applicable",
    }
    assert live["servers"]["patched"]["router"] == "smg==1.13.0"
    assert receipt["predicate"]["summary"]["live"]["findings"] == []
    assert "## Live tier" in (bundle / "REPORT.md").read_text()
    result = evidence.verify(bundle)
    assert result.ok, result.problems


def test_live_finding_fails_the_run(tmp_path, monkeypatch):
    bundle = _bundle(tmp_path, monkeypatch, patched=INCIDENT)
    summary = json.loads((bundle / "receipt.json").read_text())["predicate"]["summary"]
    assert summary["result"] == "fail"
    assert {f["scenario"] for f in summary["live"]["findings"]} == {
        "over_pool_prompt_rejected", "rejected_request_reads_no_other_request"}
    assert evidence.verify(bundle).ok


def test_verify_names_an_edited_live_file_or_pair(tmp_path, monkeypatch):
    bundle = _bundle(tmp_path, monkeypatch)
    path = bundle / "live" / "patched.json"
    doc = json.loads(path.read_text())
    doc["scenarios"][1]["verdict"] = "unsafe"
    path.write_text(json.dumps(doc))
    assert not evidence.verify(bundle).ok  # SHA256SUMS and the receipt both disagree
    receipt = json.loads((bundle / "receipt.json").read_text())
    receipt["predicate"]["files"]["live/patched.json"] = evidence.sha256_file(path)
    _reseal(bundle, receipt)  # digests hidden: the receipt's rows no longer follow from the file
    problems = evidence.verify(bundle).problems
    assert any("predicate.live" in p.detail for p in problems), problems
    receipt["predicate"]["live"]["scenarios"][1]["pair"] = "held"
    _reseal(bundle, receipt)
    assert not evidence.verify(bundle).ok
