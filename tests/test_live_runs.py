"""The live table's records (tests/data/live-runs.json, written by `python -m tools.live_runs BUNDLE...`).

A record is what a verified `run --live` bundle showed; these checks catch a row edited by hand
(a pair verdict the roles' verdicts do not give, a `pass` with a live finding, an unpinned
release) and show the recorder refuses what is not a verified live bundle.
"""

from __future__ import annotations

import shutil

import pytest

from backport.errors import BadInput
from backport.evidence.verdicts import is_finding, pair_verdict
from backport.releases import load_releases
from tests.conftest import REPO
from tools.live_runs import load, record

FIXTURE = REPO / "tests" / "fixtures" / "bundle-format-3"  # a real bundle, written without --live
RECORDS = load()


def test_there_are_records_and_every_one_is_a_pinned_release():
    assert RECORDS, "tests/data/live-runs.json is empty"
    assert set(RECORDS) <= set(load_releases())


@pytest.mark.parametrize("version", sorted(RECORDS))
def test_each_row_follows_from_its_verdicts(version):
    row = RECORDS[version]
    assert row["version"] == version and len(row["receipt_sha256"]) == 64 and len(row["toolkit_commit"]) == 40
    findings = []
    for name, v in row["scenarios"].items():
        assert v["pair"] == pair_verdict(v["pristine"], v["patched"]), (name, v)
        if is_finding(v["pair"], v["must_preserve"]):
            findings.append(name)
    assert not row["toolkit_dirty"]  # the commit named is the code that ran
    if row["result"] == "pass":
        assert not findings, findings


def test_a_bundle_without_a_live_tier_is_refused():
    with pytest.raises(BadInput, match="no live tier"):
        record(FIXTURE)


def test_a_bundle_verify_rejects_is_refused(tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(FIXTURE, copy)
    report = copy / "REPORT.md"
    report.write_text(report.read_text() + "\nedited after the run\n")
    with pytest.raises(BadInput, match="verify rejects it"):
        record(copy)
