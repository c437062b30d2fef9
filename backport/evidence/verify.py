"""`verify`: recompute every digest of a bundle and check that its files agree with each other.

Problems come in a fixed order, and each stage runs only when the one before found none:

0. the bundle format its receipt says (formats.py): one this toolkit does not read is bad input,
   said in one line with the toolkit that reads it, not judged;
1. the files against SHA256SUMS (in name order);
2. the files against the receipt's list of them (predicate.files);
3. the receipt against the receipt schema of its format and against itself
   (statement.check_statement), with the JSON files it points at attached (table.py);
4. format 4: the verdict table, summary and patch inputs against what the files give
   (table.table_problems), the export against the receipt, then REPORT.md against the receipt's
   rendering (rendering.py), so that a file edited and resealed is named; format 3: the files
   against the receipt's copies of them (format3.py);
5. the VEX documents against the receipt: the OpenVEX schema, strict CycloneDX 1.6, and each
   one what the receipt and standards.json give (vex.py).

`verify_signed` adds the signature layer (sign.py): without a key, everything in the envelope and
the attestations that needs no key; with one, their signatures too. Integrity is one question,
the run's result another: `finding_reason` says why a bundle that verifies is not a pass.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from backport.errors import BadInput
from backport.evidence.format3 import agreement_problems
from backport.evidence.integrity import bundle_files, digests, file_problems, read_receipt, sums_problems
from backport.evidence.layout import MARKER, RECEIPT, REPORT
from backport.evidence.live import bundle_problems as live_bundle_problems
from backport.evidence.problem import Problem, VerifyResult
from backport.evidence.report import render_report
from backport.evidence.statement import check_statement, schema_errors
from backport.vocab import RunResult

from . import artifacts, formats, table, vex

if TYPE_CHECKING:
    from securesystemslib.signer import SSlibKey


def _pointed_problems(bundle: Path, statement: dict, names: set[str]) -> tuple[list[Problem], dict]:
    """Format 4, after the digests and the schema: the receipt (attached) against itself, its table
    against the files, the export, REPORT.md. The attached statement is returned for the later stages."""
    documents, problems = table.read_documents(bundle, statement)
    if problems:
        return problems, statement
    held = table.attach(statement, documents)
    problems = [Problem(RECEIPT, "inconsistent", m) for m in check_statement(held, table=False)]
    if problems:
        return problems, held
    if REPORT not in names:
        return [Problem(REPORT, "missing", "every bundle has the receipt rendered as REPORT.md")], held
    report = (bundle / REPORT).read_bytes()
    problems = table.table_problems(statement, documents, report, render_report)
    problems = problems or artifacts.bundle_problems(bundle, held)
    if problems:
        return problems, held
    from backport.evidence.rendering import rendering_problems

    # A value only a file and REPORT.md show (a pin, a reason) has no copy in the receipt of format 4:
    # the receipt pins both by digest, so the line names the files it is rendered from as suspects too.
    files = ", ".join(sorted(documents))
    return [dataclasses.replace(pr, detail=f"{pr.detail}; REPORT.md renders the receipt with {files}, so "
                                f"it or one of them was edited") if pr.file == REPORT else pr
            for pr in rendering_problems(held, report)], held


def _problems(bundle: Path, present: dict, actual: dict[str, str]) -> tuple[list[Problem], dict | None]:
    statement, subjects = read_receipt(bundle)
    problems = sums_problems(bundle, present, actual, subjects)
    if problems:
        return problems, statement
    if statement is None:
        return [
            Problem(RECEIPT, "inconsistent", "not an in-toto statement that lists the bundle's files")
        ], None
    problems = file_problems(actual, subjects)
    if problems:
        return problems, statement
    schema_error = schema_errors(statement)
    if schema_error:
        return [Problem(RECEIPT, "inconsistent", schema_error)], statement
    if table.points(statement):
        problems, statement = _pointed_problems(bundle, statement, set(actual))
    else:
        problems = [Problem(RECEIPT, "inconsistent", message) for message in check_statement(statement)]
        if problems:
            return problems, statement
        problems = agreement_problems(bundle, statement, set(actual))
    problems += [
        Problem(name, "inconsistent", why)
        for name, why in live_bundle_problems(bundle, statement["predicate"])
    ]
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
    formats.check_readable(bundle)  # a format this toolkit cannot read: said, not judged as altered
    present = bundle_files(bundle)
    actual = digests(present)
    problems, statement = _problems(bundle, present, actual)
    summary = statement["predicate"]["summary"] if not problems and statement is not None else None
    return VerifyResult(bundle, actual, tuple(problems), summary)


def verify_signed(bundle: Path | str, key: SSlibKey | None = None) -> tuple[VerifyResult, str]:
    """verify(), then the envelope and attestations (signatures only with `key`, an SSlibKey):
    the result and the signature state said to the user."""
    from backport.evidence import sign

    bundle = Path(bundle)
    result = verify(bundle)
    state = sign.signature_state(bundle)
    if not result.ok:
        return result, state
    problems = sign.envelope_problems(bundle, key)
    if problems:
        return dataclasses.replace(result, problems=tuple(problems), summary=None), state
    if key is not None:
        state = "signature verified"
    elif state == "signed":
        state = "signed, signature not checked (give --key PUB)"
    return result, state


def finding_reason(summary: dict) -> str | None:
    """Why a verified bundle's run is not a pass, in a few words (None for a pass)."""
    if summary.get("result") == RunResult.PASS:
        return None
    parts = [f"{n} {pair}" for pair, n in Counter(f["pair"] for f in summary.get("findings") or []).items()]
    live = summary.get("live")
    if live is not None:
        parts += [
            f"live {n} {pair}" for pair, n in Counter(f["pair"] for f in live.get("findings") or []).items()
        ]
        if not live.get("scenarios"):
            parts.append("the live tier ran no scenario")
    upstream = len((summary.get("upstream_evidence") or {}).get("findings") or [])
    if upstream:
        parts.append(f"{upstream} upstream-test finding(s)")
    if not summary.get("cases"):
        parts.append("no probe case ran")
    coverage = summary.get("coverage") or {}
    if coverage.get("min_percent") is not None and coverage.get("percent", 0) < coverage["min_percent"]:
        parts.append(f"coverage {coverage.get('percent')}% under the floor {coverage['min_percent']}%")
    return ", ".join(parts) or f"result {summary.get('result')}"
