"""Bundle format 4: the receipt points at the bundle's files instead of copying them.

The receipt lists every file by path and sha256 (``predicate.files``) and keeps only what a
policy engine reads without opening them: the summary and the verdict table (``cases``: per
probe case its tree verdicts, pair verdict, must-preserve flag and whether patched agrees with
the reference), the patch inputs and the patched commit. `verify` reads the files (their digests
already checked), derives all of that from them (statement.restate) and compares: a value that
differs is named on the file or on the receipt, and REPORT.md, rendered from both, says which
was edited (the one it does not agree with; both when it agrees with neither).

In memory the toolkit works on the *attached* statement: the receipt with the documents read
back from the files under the keys format 3 embedded (``probes``, ``apply``, ``upstream_tests``),
so the renderers and VEX writers read one shape whatever the format (docs/decisions.md).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from backport.evidence.layout import (
    APPLY_REPORT,
    RECEIPT,
    UPSTREAM_TESTS,
    canonical_json,
    probe_file,
    role_of,
    sha256_bytes,
)
from backport.evidence.problem import Problem
from backport.evidence.verdicts import ROLES, case_rows

# The verdict table a receipt of format 4 carries: one row per probe case (the case's prose,
# `expect`, stays in the probe files).
TABLE_KEYS = ("probe", "case", "must_preserve", "verdicts", "pair", "reference_agrees")
# What format 3 embedded and format 4 reads from the files instead.
DOCUMENT_KEYS = ("probes", "apply", "upstream_tests")
POINTING_FORMAT = 4
_ABSENT = "<absent>"


def points(statement: dict) -> bool:
    """Whether a receipt is of a format that points at its files (4 and later)."""
    version = statement.get("predicate", {}).get("schema_version")
    return isinstance(version, int) and version >= POINTING_FORMAT


def pointed(statement: dict) -> dict:
    """The receipt as format 4 writes it: the attached documents left out, the table's rows cut to
    TABLE_KEYS."""
    s = copy.deepcopy(statement)
    p = s["predicate"]
    for key in DOCUMENT_KEYS:
        p.pop(key, None)
    p["cases"] = [{k: row.get(k) for k in TABLE_KEYS} for row in p["cases"]]
    return s


def embed(document: dict, name: str) -> dict:
    """A document attached under its file's name and digest (format 3's embedding)."""
    return {**document, "file": name, "sha256": sha256_bytes(canonical_json(document))}


def read_documents(bundle: Path, statement: dict) -> tuple[dict[str, Any], list[Problem]]:
    """The JSON documents a receipt of format 4 points at (file name -> parsed), and the files that are
    no canonical JSON or are missing."""
    p = statement["predicate"]
    wanted = [probe_file(role) for role in ROLES if role in p["inputs"]["trees"]]
    if p["mode"] in ("backport", "exposure"):
        wanted.append(APPLY_REPORT)
    wanted.append(UPSTREAM_TESTS)
    documents: dict[str, Any] = {}
    problems = []
    for name in wanted:
        path = bundle / name
        if name not in p["files"] or not path.is_file():
            problems.append(Problem(RECEIPT, "inconsistent", f"predicate.files lists no {name}, which a "
                                    f"{p['mode']} run of its inputs.trees writes"))
            continue
        document, problem = read_canonical(bundle, name)
        if problem:
            problems.append(problem)
            continue
        documents[name] = document
    for name in sorted(p["files"]):  # the files are as listed (integrity.py): the receipt says too much
        if role_of(name) is not None and name not in wanted:
            problems.append(Problem(RECEIPT, "inconsistent", f"predicate.files lists {name}, but "
                                    f"inputs.trees names no such tree"))
        elif name == APPLY_REPORT and name not in wanted:
            problems.append(Problem(RECEIPT, "inconsistent", f"predicate.files lists {name}, but a "
                                    f"{p['mode']} run applies nothing"))
    return documents, problems


def attach(statement: dict, documents: dict[str, Any]) -> dict:
    """The receipt with its documents attached as format 3 embedded them; each row of the table gets
    its case's `expect` from the probe files. A format 3 receipt is returned as it is."""
    if not points(statement):
        return statement
    s = copy.deepcopy(statement)
    p = s["predicate"]
    probes = {role: documents[probe_file(role)] for role in ROLES if probe_file(role) in documents}
    p["probes"] = {role: embed(doc, probe_file(role)) for role, doc in probes.items()}
    p["apply"] = documents.get(APPLY_REPORT)
    upstream = documents.get(UPSTREAM_TESTS, {"skipped": "not in the bundle", "trees": []})
    p["upstream_tests"] = embed(upstream, UPSTREAM_TESTS)
    expects = {(r["probe"], r["case"]): r["expect"] for r in case_rows(probes)}
    p["cases"] = [{**row, "expect": expects.get((row.get("probe"), row.get("case")), "")}
                  if isinstance(row, dict) else row for row in p["cases"]]
    return s


def read_canonical(bundle: Path, name: str) -> tuple[Any, Problem | None]:
    """The bundle file `name` as a JSON document and None, or None and why it is not one: its bytes
    must be the canonical form the receipt's digest covers (formats 3 and 4 alike)."""
    data = (bundle / name).read_bytes()
    try:
        document = json.loads(data)
    except ValueError as exc:
        return None, Problem(name, "inconsistent", f"not JSON ({exc})")
    if data != canonical_json(document):
        return None, Problem(name, "inconsistent",
                             "not in the canonical JSON form the receipt's digest covers")
    return document, None


def attached_from(bundle: Path, statement: dict) -> dict:
    """`attach` with the documents read from the bundle (files that cannot be read are left out)."""
    documents, _problems = read_documents(Path(bundle), statement)
    return attach(statement, documents)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON: of one JSON type (1, 1.0 and True differ) and equal; a vocabulary member
    (backport/vocab.py, a `str` subclass) is the string it serialises as."""
    def kind(x: Any) -> type:
        return str if isinstance(x, str) else type(x)
    return kind(a) is kind(b) and a == b


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(where, a's value, b's value) of the first difference between two JSON values, in key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = first_difference(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{index}]")
            if found:
                return found
        return None if len(a) == len(b) else (f"{path} (length)", len(a), len(b))
    return None if _same(a, b) else (path, a, b)


def differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Every (where, a's value, b's value) at which two JSON values differ, in key order."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for key in sorted(set(a) | set(b), key=str)
                for d in differences(a.get(key, _ABSENT), b.get(key, _ABSENT), f"{path}.{key}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [(f"{path} (length)", len(a), len(b))]
        return [d for index, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{index}]")]
    return [] if _same(a, b) else [(path, a, b)]


def _sources(where: str, recorded: dict, derived: dict, documents: dict[str, Any]) -> list[str]:
    """The files a derived value comes from (the place it differs at, in the predicate)."""
    if where.startswith((".inputs.patches", ".inputs.trees.patched.commit")):
        return [APPLY_REPORT]
    if where.startswith((".summary.upstream", ".upstream")):
        return [UPSTREAM_TESTS]
    if where.startswith(".cases[") and "(length)" not in where:
        index = int(where[len(".cases["):where.index("]")])
        rows_r, rows_d = recorded["cases"], derived["cases"]
        if index < len(rows_r) and index < len(rows_d) and isinstance(rows_r[index], dict):
            got, want = rows_r[index].get("verdicts") or {}, rows_d[index]["verdicts"]
            roles = [r for r in ROLES if r in want and got.get(r) != want.get(r)]
            if roles:
                return [probe_file(r) for r in roles]
            if where.endswith(".pair") or where.endswith(".reference_agrees"):
                return [probe_file(r) for r in ROLES if r in want]
    if where.startswith(".summary.per_tree."):
        return [probe_file(where.split(".")[3])]
    roles = [r for r in ROLES if r in derived["inputs"]["trees"]]
    if where.startswith(".environment.torch"):  # the probe files whose torch is not the recorded one
        torch = recorded["environment"].get("torch")
        recorded_torch = torch if isinstance(torch, list) else [torch]
        named = [probe_file(r) for r in roles
                 if (documents.get(probe_file(r)) or {}).get("torch") not in recorded_torch]
        return named or [probe_file(r) for r in roles]
    # the table's length, the summary's counts and the reference differences: the probe files
    return [probe_file(r) for r in roles] + ([UPSTREAM_TESTS] if where.startswith(".summary.result") else [])


def table_problems(statement: dict, documents: dict[str, Any], report: bytes, render) -> list[Problem]:
    """The receipt's table, summary and patch inputs against what the files give (`render`: the
    receipt -> REPORT.md renderer, the witness that says which side was edited)."""
    from backport.evidence.statement import restate

    held = attach(statement, documents)
    p = held["predicate"]
    derived = restate(held, probes={role: documents[probe_file(role)] for role in p["probes"]},
                      upstream=documents.get(UPSTREAM_TESTS), apply=documents.get(APPLY_REPORT))
    found = differences(statement["predicate"], pointed(derived)["predicate"])
    if not found:
        return []
    # The summary follows from the table, the inputs and the documents: named only when nothing before
    # it differs (else it repeats what the first differences say, on a file that was not edited).
    primary = [d for d in found if not d[0].startswith((".summary", ".reference_differences"))]
    found = primary or found

    def renders(s: dict) -> bool:
        try:
            return render(s).encode() == report
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            return False

    # REPORT.md was rendered from the run's files and receipt: a file it does not render from was edited
    # (the receipt's predicate.files with it), else the receipt's value; both when it shows neither.
    receipt_renders, files_render = renders(held), renders(derived)
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    for where, ours, theirs in found:
        part = f"predicate{where}"
        names = [n for n in _sources(where, statement["predicate"], derived["predicate"], documents)
                 if n in documents]
        named = ", ".join(names) or "the files"
        if (files_render and not receipt_renders) or not names:
            blamed = [(RECEIPT, f"{part} is {ours!r}; {named} and REPORT.md give {theirs!r}")]
        elif not files_render:
            blamed = [(n, f"gives {part} {theirs!r}; receipt.json has {ours!r}, and REPORT.md was not "
                          f"rendered from this file") for n in names]
        else:
            why = "REPORT.md does not show the value"
            blamed = [(n, f"gives {part} {theirs!r}, receipt.json has {ours!r}; {why}") for n in names]
            blamed.append((RECEIPT, f"{part} is {ours!r}, {named} give {theirs!r}; {why}"))
        for name, detail in blamed:
            if (name, where) not in seen:
                seen.add((name, where))
                problems.append(Problem(name, "inconsistent", detail))
    return problems

