"""pytest's JUnit XML, read into one entry per test, each failure judged by `classify`."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath

from backport.upstream.classify import classify, scrub, stand_ins
from backport.upstream.fetch import Fetched
from backport.upstream.names import TreeNames, static_missing_imports
from backport.vocab import TestOutcome

# `stale-test`: the test's own stand-ins or a signature the release predates; never a pass.
# `unavailable`: the file was not fetched (the reason says why); `refused`: its bytes did not
# match the pin (or changed, or are not Python) and it was never run. Both are per file.
OUTCOMES = tuple(TestOutcome)


def entry(fetched: Fetched, nodeid: str, outcome: TestOutcome, reason: str | None) -> dict:
    """One test's result, the shape `upstream-tests.json` carries."""
    assert outcome in OUTCOMES
    return {"file": fetched.ref.path, "rev": fetched.ref.rev, "sha256": fetched.sha256,
            "nodeid": nodeid, "outcome": outcome, "reason": reason}


def _skip_reason(skipped: ET.Element) -> str:
    message = skipped.get("message", "") or ""
    if message == "collection skipped":
        match = re.search(r"Skipped: (.*?)['\"]\)?$", (skipped.text or "").strip())
        message = f"whole file: {match.group(1) if match else 'skipped at import'}"
    if skipped.get("type") == "pytest.xfail":
        message = f"xfail: {message}"
    return message or "skipped"


def parse_junit(xml_path: Path, fetched: Fetched, *, names: TreeNames, fix_names: frozenset[str],
                tmp: str, has_fix: bool | None = None) -> list[dict]:
    root = ET.parse(xml_path).getroot()
    stem = PurePosixPath(fetched.ref.path).stem
    source = fetched.data.decode("utf-8", errors="replace") if fetched.data else ""
    standins = stand_ins(source)
    results: list[dict] = []
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        collection = classname == "" and name in (stem, f"{stem}.py", fetched.ref.path)
        if collection:
            nodeid = fetched.ref.path
        else:
            parts = classname.split(".")
            if parts and parts[0] == stem:
                parts = parts[1:]
            nodeid = "::".join([fetched.ref.path, *parts, name])
        failures = case.findall("failure")
        errors = case.findall("error")
        skipped = case.find("skipped")
        if failures or errors:
            outcome = TestOutcome.FAILED if failures else TestOutcome.ERROR
            first = (failures or errors)[0]
            message, body = first.get("message", ""), first.text or ""
            static = static_missing_imports(source, names) if collection else None
            outcome, reason = classify(outcome, message, body, names=names, fix_names=fix_names,
                                       static=static, tmp=tmp, standins=standins, source=source,
                                       has_fix=has_fix, own_names=fetched.ref.own_names)
            count = len(failures) + len(errors)
            if count > 1 and outcome in (TestOutcome.FAILED, TestOutcome.ERROR):
                reason = f"{count} failures (subtests or teardown); first: {reason}"
            if collection and outcome == TestOutcome.ERROR:
                reason = f"collection error: {reason}"
        elif skipped is not None:
            outcome, reason = TestOutcome.SKIPPED, scrub(_skip_reason(skipped), tmp, names.root)
        else:
            outcome, reason = TestOutcome.PASSED, None
        results.append(entry(fetched, nodeid, outcome, reason))
    return results
