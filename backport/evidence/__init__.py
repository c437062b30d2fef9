"""Evidence: pair verdicts, the receipt (an in-toto Statement v1), bundles, and `verify`.

The modules follow the data: `verdicts` (tree and pair verdicts, case rows, the summary),
`scrub` (normalising raw documents), `environment` (what the results depend on besides the
trees), `statement` (the receipt and its own consistency), `report` (REPORT.md), `bundle`
(laying out and writing a bundle), `layout` (file names, canonical bytes, digests), and the
checks: `integrity` (digests), `table` (the receipt's verdict table against the files it points
at), `rendering` (REPORT.md against the receipt), `format3` (the copies a format 3 receipt holds)
and `verify`.
"""

from backport.evidence.artifacts import Exported, export_of
from backport.evidence.bundle import (
    Bundle,
    Written,
    assemble,
    check_bundle_target,
    is_bundle,
    place_bundle,
    write_bundle,
)
from backport.evidence.environment import (
    KEY_PACKAGES,
    TOOLKIT_PACKAGES,
    environment_record,
    interpreter_environment,
    toolkit_info,
)
from backport.evidence.layout import (
    APPLY_REPORT,
    RECEIPT,
    REPORT,
    SUMS,
    UPSTREAM_TESTS,
    canonical_json,
    probe_file,
    sha256_bytes,
    sha256_file,
    sums_text,
)
from backport.evidence.problem import Problem, VerifyResult
from backport.evidence.record import RunRecord, TreeInput
from backport.evidence.report import render_report
from backport.evidence.scope import exposure_line, unserved_fixes
from backport.evidence.statement import PREDICATE_TYPE, STATEMENT_TYPE, check_statement
from backport.evidence.verdicts import PAIR_VERDICTS, PASSING, ROLES, TREE_VERDICTS, is_finding, pair_verdict
from backport.evidence.verify import verify

__all__ = [
    "APPLY_REPORT",
    "KEY_PACKAGES",
    "PAIR_VERDICTS",
    "PASSING",
    "PREDICATE_TYPE",
    "RECEIPT",
    "REPORT",
    "ROLES",
    "STATEMENT_TYPE",
    "SUMS",
    "TOOLKIT_PACKAGES",
    "TREE_VERDICTS",
    "UPSTREAM_TESTS",
    "Bundle",
    "Exported",
    "Problem",
    "RunRecord",
    "TreeInput",
    "VerifyResult",
    "Written",
    "assemble",
    "canonical_json",
    "check_bundle_target",
    "check_statement",
    "environment_record",
    "export_of",
    "exposure_line",
    "interpreter_environment",
    "is_bundle",
    "is_finding",
    "pair_verdict",
    "place_bundle",
    "probe_file",
    "render_report",
    "sha256_bytes",
    "sha256_file",
    "sums_text",
    "toolkit_info",
    "unserved_fixes",
    "verify",
    "write_bundle",
]
