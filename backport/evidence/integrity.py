"""A bundle's digests: its files against SHA256SUMS, then against the receipt's list of them
(``predicate.files``; the subjects are the artifacts, checked in artifacts.py).

When a file and its line in SHA256SUMS disagree, the problem is blamed on the file, unless
the receipt (itself intact) vouches for the file's bytes or the two digests differ in a
couple of hex digits only: then SHA256SUMS was altered.
"""

from __future__ import annotations

import json
from pathlib import Path

from backport.evidence.layout import ATTESTATION_SUFFIX, ENVELOPE, RECEIPT, SUMS, parse_sums, sha256_file
from backport.evidence.problem import Problem


def bundle_files(bundle: Path) -> dict[str, Path]:
    """Every file and symbolic link of the bundle but SHA256SUMS and the signed envelopes (the
    receipt's and the attestations' `*.intoto.jsonl`, which their own signatures cover), by its
    name inside the bundle."""
    found = {}
    for path in sorted(bundle.rglob("*")):
        if path.is_file() or path.is_symlink():
            name = path.relative_to(bundle).as_posix()
            if name not in (SUMS, ENVELOPE) and not name.endswith(ATTESTATION_SUFFIX):
                found[name] = path
    return found


def read_receipt(bundle: Path) -> tuple[dict | None, dict[str, str]]:
    """(statement, file name -> sha256 from predicate.files); (None, {}) when receipt.json is not a
    statement that lists the bundle's files."""
    try:
        statement = json.loads((bundle / RECEIPT).read_bytes())
        files = dict(statement["predicate"]["files"])
        if not isinstance(statement["subject"], list):
            return None, {}
    except (OSError, ValueError, KeyError, TypeError):
        return None, {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        return None, {}
    return statement, files


def _hex_distance(a: str, b: str) -> int:
    return sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))


def sums_problems(bundle: Path, present: dict[str, Path], actual: dict[str, str],
                  subjects: dict[str, str]) -> list[Problem]:
    """The files against SHA256SUMS, in name order."""
    problems = [Problem(name, "unexpected", "a symbolic link; bundles hold regular files only")
                for name, path in present.items() if path.is_symlink()]
    sums_path = bundle / SUMS
    if not sums_path.is_file():
        return problems + [Problem(SUMS, "missing", "no SHA256SUMS in the bundle")]
    listed, why = parse_sums(sums_path.read_bytes())
    if listed is None:
        return problems + [Problem(SUMS, "modified", why or "unreadable")]
    receipt_matches_sums = RECEIPT in listed and actual.get(RECEIPT) == listed[RECEIPT]

    # A listed name that no file has, whose digest an unlisted file has: either the file was
    # renamed or the name in SHA256SUMS was altered. The receipt's subjects (and the fixed name
    # receipt.json) say which names a bundle really has.
    known = set(subjects) | {RECEIPT}
    unlisted = {name for name in actual if name not in listed}
    altered = {}
    for name in listed:
        if name not in actual and name not in known:
            renamed = [u for u in sorted(unlisted) if actual[u] == listed[name] and u in known]
            if renamed:
                altered[name] = renamed[0]
    for name in sorted(set(listed) | set(actual)):
        if name in altered:
            problems.append(
                Problem(SUMS, "modified", f"lists {name!r} where the bundle has {altered[name]!r}")
            )
        elif name in altered.values():
            continue  # reported as the altered SHA256SUMS entry
        elif name in listed and name not in actual:
            problems.append(Problem(name, "missing", "listed in SHA256SUMS, not in the bundle"))
        elif name not in listed:
            problems.append(Problem(name, "unexpected", "in the bundle, not listed in SHA256SUMS"))
        elif actual[name] != listed[name]:
            vouched = name != RECEIPT and receipt_matches_sums and subjects.get(name) == actual[name]
            if vouched or _hex_distance(actual[name], listed[name]) <= 2:
                problems.append(
                    Problem(
                        SUMS,
                        "modified",
                        f"its digest for {name} was altered; the file itself "
                        f"matches {'the receipt' if vouched else 'all but a few hex digits'}",
                    )
                )
            else:
                problems.append(
                    Problem(name, "modified", f"sha256 {actual[name]}, SHA256SUMS says {listed[name]}")
                )
    return problems


def file_problems(actual: dict[str, str], files: dict[str, str]) -> list[Problem]:
    """The files against the receipt's predicate.files: every file but the receipt is listed, with its
    digest."""
    problems = []
    for name in sorted((set(actual) - {RECEIPT}) | set(files)):
        if name not in files:
            problems.append(Problem(name, "unexpected", "not listed in the receipt's predicate.files"))
        elif name not in actual:
            problems.append(
                Problem(name, "missing", "listed in the receipt's predicate.files, not in the bundle")
            )
        elif files[name] != actual[name]:
            problems.append(
                Problem(
                    name,
                    "modified",
                    f"sha256 {actual[name]}, the receipt's predicate.files says {files[name]}",
                )
            )
    return problems


def digests(present: dict[str, Path]) -> dict[str, str]:
    return {name: sha256_file(path) for name, path in present.items() if path.is_file()}
