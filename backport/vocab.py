"""Every closed vocabulary the toolkit writes or compares, one `StrEnum` each.

One module for all of them (docs/decisions.md): they cross the stages (the engine's statuses are
read by evidence/ and job/, the tree verdicts by evidence/, live/, audit/ and the release matrix),
so a module per area would import across areas only to name a string. It imports nothing, so any
module may import it without a cycle.

The values are exactly the strings bundles, receipts, `--json` output and the schemas hold: a
`StrEnum` member is a `str` equal to its value, `json.dumps` writes the value and f-strings format
it, so nothing on disk changes. Readers of a JSON document compare its strings with the members;
no verdict is ever drawn from message text (`reason`, `evidence`, notes): those are for people.
"""

from __future__ import annotations

from enum import StrEnum


class Vocabulary(StrEnum):
    """A member reads as its value everywhere text is made of it, `repr` too: a message built with
    `{value!r}` (verify's problems, bad-input lines) says 'safe' as it did when it was a str."""

    def __repr__(self) -> str:
        return repr(self.value)


class TreeVerdict(Vocabulary):
    """A probe case's (or a live scenario's) verdict on one tree."""

    SAFE = "safe"
    UNSAFE = "unsafe"
    ERROR = "error"  # the probe could not judge the tree: a finding, never safe
    NOT_APPLICABLE = "not-applicable"  # the code path the case drives is not in the tree


class PairVerdict(Vocabulary):
    """A case's verdict from pristine to patched (evidence/verdicts.py has the table)."""

    FIXED = "fixed"
    HELD = "held"
    STILL_UNSAFE = "still-unsafe"
    REGRESSED = "regressed"
    ADDED = "added"
    NOT_APPLICABLE = "not-applicable"
    ERROR = "error"


class RunResult(Vocabulary):
    """A run's result (the summary's `result`; REPORT.md and `run` print it in capitals)."""

    PASS = "pass"
    FAIL = "fail"


class PatchStatus(Vocabulary):
    """What the engine did with one fix (apply-report.json's `patches[].status`)."""

    APPLIED = "applied"
    PRESENT = "already-present"
    NOT_APPLICABLE = "not-applicable"
    FAILED = "failed"


class ApplyStatus(Vocabulary):
    """How a whole apply ended (apply-report.json's top-level `status`)."""

    APPLIED = "applied"
    NOTHING_TO_DO = "nothing-to-do"
    FAILED = "failed"


class Cause(Vocabulary):
    """Why a patch failed or does not apply (apply-report.json's `cause`); readers never parse `reason`."""

    # failed: no variant for the release; a dependency is not there; the variant does not place
    NO_VARIANT = "no-variant"
    MISSING_DEPENDENCY = "missing-dependency"
    DOES_NOT_PLACE = "does-not-place"
    # not-applicable: the release ships the fix; the pack has no backport for the release
    SHIPPED = "shipped"
    OUT_OF_SCOPE = "out-of-scope"


class HunkStatus(Vocabulary):
    """Where one hunk went (apply-report.json's `hunks[].status`)."""

    EXACT = "exact"
    OFFSET = "offset"
    FUZZ = "fuzz"
    CONFLICT = "conflict"


class VexStatus(Vocabulary):
    """A vulnerability class's status (OpenVEX spelling; cyclonedx.py maps it to CycloneDX's states)."""

    AFFECTED = "affected"
    NOT_AFFECTED = "not_affected"
    FIXED = "fixed"
    UNDER_INVESTIGATION = "under_investigation"


class GateVerdict(Vocabulary):
    """An audit gate's (or one server's) result, best first."""

    PASS = "pass"
    WARN = "warn"
    UNKNOWN = "unknown"
    FAIL = "fail"


class TestOutcome(Vocabulary):
    """One upstream test's outcome on one tree (upstream-tests.json; upstream/junit.py says each)."""

    __test__ = False  # pytest: not a test class despite its name

    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    INCOMPATIBLE = "incompatible"
    STALE_TEST = "stale-test"
    UNAVAILABLE = "unavailable"
    REFUSED = "refused"


class UpstreamPair(Vocabulary):
    """An upstream test's verdict from pristine to patched (evidence/upstream_verdicts.py)."""

    FIXED = "fixed"
    HELD = "held"
    PASSED = "passed"
    STILL_FAILING = "still-failing"
    REGRESSED = "regressed"
    REFUSED = "refused"
    INCONCLUSIVE = "inconclusive"
