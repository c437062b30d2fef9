"""`verify`: recompute every digest of a bundle and check that its files agree with each other.

Problems come in a fixed order, and each stage runs only when the one before found none:

0. the bundle format its receipt says (formats.py): one this toolkit does not read is bad input,
   said in one line with the toolkit that reads it, not judged;
1. the files against SHA256SUMS (in name order);
2. the files against the receipt's list of them (predicate.files);
3. the receipt against the receipt schema and against itself (statement.check_statement);
4. the files against the receipt's copies of them, and REPORT.md against the receipt's
   rendering (agreement.py), so that a file edited and resealed is named;
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

from backport.errors import BadInput
from backport.evidence.agreement import agreement_problems
from backport.evidence.integrity import bundle_files, digests, file_problems, read_receipt, sums_problems
from backport.evidence.layout import MARKER, RECEIPT
from backport.evidence.live import bundle_problems as live_bundle_problems
from backport.evidence.problem import Problem, VerifyResult
from backport.evidence.statement import check_statement, schema_errors

from . import formats, vex


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
        problems.append(Problem(RECEIPT, "inconsistent", schema_error))
    problems += [Problem(RECEIPT, "inconsistent", message) for message in check_statement(statement)]
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


def verify_signed(bundle: Path | str, key=None) -> tuple[VerifyResult, str]:
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
    if summary.get("result") == "pass":
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
