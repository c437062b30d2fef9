"""`verify`: recompute every digest of a bundle and check that its files agree with each other.

Problems come in a fixed order, and each stage runs only when the one before found none:

1. the files against SHA256SUMS (in name order);
2. the files against the receipt's list of them (predicate.files);
3. the receipt against the receipt schema and against itself (statement.check_statement);
4. the files against the receipt's copies of them, and REPORT.md against the receipt's
   rendering (agreement.py), so that a file edited and resealed is named;
5. the VEX documents against the receipt: the OpenVEX schema, strict CycloneDX 1.6, and each
   one what the receipt and standards.json give (vex.py).
"""

from __future__ import annotations

from pathlib import Path

from backport.errors import BadInput
from backport.evidence.agreement import agreement_problems
from backport.evidence.integrity import bundle_files, digests, file_problems, read_receipt, sums_problems
from backport.evidence.layout import MARKER, RECEIPT
from backport.evidence.live import bundle_problems as live_bundle_problems
from backport.evidence.problem import Problem, VerifyResult
from backport.evidence.statement import check_statement, schema_errors

from . import vex


def _problems(bundle: Path, present: dict, actual: dict[str, str]) -> tuple[list[Problem], dict | None]:
    statement, subjects = read_receipt(bundle)
    problems = sums_problems(bundle, present, actual, subjects)
    if problems:
        return problems, statement
    if statement is None:
        return [Problem(RECEIPT, "inconsistent", "not an in-toto statement that lists the bundle's files")], None
    problems = file_problems(actual, subjects)
    if problems:
        return problems, statement
    schema_error = schema_errors(statement)
    if schema_error:
        problems.append(Problem(RECEIPT, "inconsistent", schema_error))
    problems += [Problem(RECEIPT, "inconsistent", message) for message in check_statement(statement)]
    if problems:
        return problems, statement
    problems = agreement_problems(bundle, statement, set(actual))
    problems += [Problem(name, "inconsistent", why) for name, why in live_bundle_problems(bundle, statement["predicate"])]
    if problems:
        return problems, statement
    return vex.problems(bundle, statement, set(actual)), statement


def verify(bundle: Path | str) -> VerifyResult:
    """Check one bundle directory (BadInput when it is not a directory)."""
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise BadInput(f"{bundle}: not a directory")
    if not (bundle / MARKER).exists() and not (bundle / RECEIPT).exists():
        # neither the marker nor the receipt: not a damaged bundle, not a bundle at all
        raise BadInput(f"{bundle}: not an evidence bundle (no {MARKER}, no {RECEIPT})")
    present = bundle_files(bundle)
    actual = digests(present)
    problems, statement = _problems(bundle, present, actual)
    summary = statement["predicate"]["summary"] if not problems else None
    return VerifyResult(bundle, actual, tuple(problems), summary)
