"""The probe package's layout (issue 46 item 3): moving or splitting a probe module never renames a
case. Bundles (probes/*.json), `sglang-backport probe --json` and the release matrix name each case
`probe/case`; tests/fixtures/probe-case-ids.txt is that list, in registration order, as the registry
gave it before probes/ was sorted into cases/, rigs/, standins/ and runtime/."""

from __future__ import annotations

from pathlib import Path

import probes

REPO = Path(__file__).resolve().parent.parent
IDS = REPO / "tests" / "fixtures" / "probe-case-ids.txt"


def test_case_ids_are_unchanged():
    ids = [f"{c.probe}/{c.name}" for p in probes.PROBE_NAMES for c in probes.cases_of(p)]
    assert ids == IDS.read_text().split()
    assert sorted(probes.REGISTRY) == sorted(probes.PROBE_NAMES)  # no case registers under a stray name
