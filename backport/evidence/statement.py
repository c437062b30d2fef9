"""The receipt: an in-toto Statement v1 whose predicate records one run, and its own consistency.

`build_statement` gives the *attached* statement: the predicate with the bundle's JSON documents
under ``probes``, ``apply`` and ``upstream_tests`` and what derives from them (``cases``,
``reference_differences``, ``summary``, the patch digests and statuses in ``inputs.patches``, the
patched tree's commit, ``environment.torch``). Format 3 wrote it so; format 4 writes it
`table.pointed` (the documents left out: the files are pinned by digest in ``predicate.files``)
and `verify` attaches them again from the files. `check_statement` re-derives all of it, so a
receipt edited in one place contradicts itself.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from backport.vocab import ApplyStatus

if TYPE_CHECKING:  # jsonschema is imported where used, through jsonschemas.load (start-up stays light)
    import jsonschema

from backport.evidence import formats, jsonschemas
from backport.evidence.coverage import problems as coverage_problems
from backport.evidence.environment import probe_torch
from backport.evidence.layout import (
    APPLY_REPORT,
    HEAD,
    UPSTREAM_TESTS,
    probe_file,
    product_role,
    role_of,
)
from backport.evidence.record import RunRecord
from backport.evidence.table import embed
from backport.evidence.verdicts import REFERENCE, ROLES, case_rows, reference_differences, summarise

from . import artifacts
from . import live as live_evidence

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://sglang-backport.dev/receipt/v1"
# predicate.schema_version, the bundle format: the receipt schema's `$id` says it (formats.py).
# 4: the receipt points at the files (table.py): no copies, the verdict table cut to table.TABLE_KEYS;
#    tree subjects by dirHash1 and gitTree (inputs.trees.<role>.git_tree).
# 3: toolkit.code (digests of the code that judged) and toolkit.distribution; the bundle marker.
# 2: subjects are the artifacts, bundle files in predicate.files, predicate.export.
_EMBEDDING_KEYS = ("file", "sha256")


def build_statement(record: RunRecord, files: dict[str, str]) -> dict:
    """`record`: the run, normalised (bundle.assemble). `files`: every bundle file
    but the receipt and SHA256SUMS, with its sha256. The subjects are the artifacts (artifacts.py): the
    patched tree and, with `export`, the exported files. The statement is the attached one (the module
    docstring): `table.pointed` of it is what receipt.json holds."""
    r = record
    probes = {role: probe.to_json() for role, probe in r.probes.items()}
    trees, upstream = r.trees, r.upstream_tests or {}
    export = None if r.export is None else r.export.record
    live = None if r.live is None else live_evidence.section(r.live)
    rows = case_rows(probes)
    reference = trees.get(REFERENCE)
    chosen = None if reference is None else {**reference.to_input(), "chosen": r.reference_choice}
    predicate = {
        "schema_version": formats.current(),
        "mode": r.mode,
        "toolkit": r.toolkit.to_json(),
        "environment": r.environment.to_json(probe_torch(probes)),
        "inputs": {
            "target": r.target,
            "series": r.series_files,
            "patches": r.patches,
            "trees": {role: trees[role].to_input() for role in ROLES if role in trees},
            "reference": chosen,
        },
        "apply": r.apply_report,
        "probes": {role: embed(probes[role], probe_file(role)) for role in ROLES if role in probes},
        "cases": rows,
        "reference_differences": reference_differences(rows),
        "upstream_tests": embed(upstream, UPSTREAM_TESTS),
        "summary": live_evidence.fold_summary(
            summarise(rows, probes, upstream, r.coverage, apply=r.apply_report), live
        ),
        "files": dict(sorted(files.items())),
        "export": export,
        "timestamps": r.timestamps,
    }
    if r.coverage is not None:
        predicate["coverage"] = r.coverage
    if live is not None:
        predicate["live"] = live
    if r.advisories is not None:  # what else is open on the release (backport/advisories.py)
        predicate["advisories"] = r.advisories
    product = trees[product_role(trees)]
    return {
        "_type": STATEMENT_TYPE,
        "subject": artifacts.subjects(product.tree_digest, product.version, export,
                                      role=product_role(trees), git_tree=product.git_tree),
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


def embedded(predicate: dict, name: str) -> Any:
    """The document the receipt embeds for one bundle file, as the file must hold it (None: none)."""
    role = role_of(name)
    if role is not None:
        doc = predicate["probes"].get(role)
    elif name == UPSTREAM_TESTS:
        doc = predicate["upstream_tests"]
    elif name == APPLY_REPORT:
        return predicate["apply"]
    else:
        return None
    return None if doc is None else {k: v for k, v in doc.items() if k not in _EMBEDDING_KEYS}


def _plain_probes(predicate: dict) -> dict[str, dict]:
    return {role: embedded(predicate, probe_file(role)) for role in predicate["probes"]}


def patch_inputs_from(apply_report: dict | None, recorded: Sequence[dict] = ()) -> list[dict]:
    """inputs.patches as the apply report implies them: one per patch that has a variant, in order."""
    patches: list[dict] = []
    recorded = list(recorded)
    for patch in (apply_report or {}).get("patches", []):
        if not patch.get("variant"):
            continue
        old = recorded[len(patches)] if len(patches) < len(recorded) else {}
        path = (
            old.get("path")
            if old.get("variant") == patch["variant"]
            else f"{patch['fix']}/{patch['variant']}"
        )
        patches.append({"fix": patch["fix"], "variant": patch["variant"], "path": path,
                        "sha256": patch.get("variant_sha256"), "status": patch.get("status")})
    return patches


_KEEP = object()


def restate(statement: dict, *, probes: dict[str, dict] | None = None, apply: Any = _KEEP,
            upstream: dict | None = None) -> dict:
    """The statement with some embedded documents replaced and everything derived from them redone:
    what the receipt would say had the run produced these documents."""
    s = copy.deepcopy(statement)
    p = s["predicate"]
    if probes is not None:
        p["probes"] = {role: embed(probes[role], probe_file(role)) for role in ROLES if role in probes}
    if upstream is not None:
        p["upstream_tests"] = embed(upstream, UPSTREAM_TESTS)
    if apply is not _KEEP:
        p["apply"] = apply
        if apply is not None and p["mode"] != "exposure":
            p["inputs"]["patches"] = patch_inputs_from(apply, p["inputs"]["patches"])
            p["inputs"]["trees"]["patched"]["commit"] = apply.get("head_commit")
    plain = _plain_probes(p)
    rows = case_rows(plain)
    p["cases"] = rows
    p["reference_differences"] = reference_differences(rows)
    p["summary"] = live_evidence.fold_summary(
        summarise(rows, plain, embedded(p, UPSTREAM_TESTS), p.get("coverage"), apply=p["apply"]),
        p.get("live"),
    )
    p["environment"]["torch"] = probe_torch(plain)
    return s


# ---- checks ---------------------------------------------------------------------------------------


@cache
def _validator(format: int | None = None) -> jsonschema.Draft202012Validator:
    return jsonschemas.load().Draft202012Validator(formats.receipt_schema(format))


def schema_errors(statement: Any) -> str | None:
    """The first place where a receipt departs from the receipt schema of its format, when this toolkit
    reads that format, else of this toolkit's (None: it matches)."""
    predicate = statement.get("predicate") if isinstance(statement, dict) else None
    found = predicate.get("schema_version") if isinstance(predicate, dict) else None
    older = found if isinstance(found, int) and found in formats.ALSO_READ else None
    error = first_schema_error(_validator(older), statement)
    if error is None:
        return None
    return f"does not match the receipt schema at {schema_place(error)}: {error.message}"


def first_schema_error(validator: jsonschema.Validator, document: Any) -> jsonschema.ValidationError | None:
    """The error at the first place (in path order) where `document` departs from `validator`'s schema."""
    return min(validator.iter_errors(document), key=lambda e: [str(x) for x in e.absolute_path], default=None)


def schema_place(error: jsonschema.ValidationError) -> str:
    return "/".join(str(part) for part in error.absolute_path) or "(top)"


def _derived_problems(p: dict, table: bool = True) -> list[str]:
    """What derives from the documents against the receipt; `table` False (format 4): only the coverage
    and live sections, as table.table_problems compares the rest with the files, naming the side."""
    problems = []
    probes = _plain_probes(p)
    if not table:
        found = coverage_problems(p.get("coverage"), upstream=embedded(p, UPSTREAM_TESTS),
                                  pristine=probes.get("pristine"))
        return found + live_evidence.section_problems(p.get("live"))
    expected_rows = case_rows(probes)
    rows = p["cases"]
    if len(rows) != len(expected_rows):
        problems.append(
            f"cases lists {len(rows)} cases, the per-tree probe results have {len(expected_rows)}"
        )
    for row, expected in zip(rows, expected_rows):
        name = f"{expected['probe']}/{expected['case']}"
        if (row.get("probe"), row.get("case")) != (expected["probe"], expected["case"]):
            problems.append(f"case {row.get('probe')}/{row.get('case')} is not {name} of the probe results")
            break
        if row.get("verdicts") != expected["verdicts"]:
            problems.append(f"case {name}: verdicts {row.get('verdicts')} disagree with the per-tree "
                            f"results {expected['verdicts']}")
        if row.get("pair") != expected["pair"]:
            problems.append(f"case {name}: pair verdict {row.get('pair')!r} does not follow from "
                            f"{expected['verdicts']} (expected {expected['pair']!r})")
        for key in ("must_preserve", "expect", "reference_agrees"):
            if row.get(key) != expected[key]:
                problems.append(f"case {name}: {key} {row.get(key)!r} disagrees with the probe results")
    if p["reference_differences"] != reference_differences(expected_rows):
        problems.append("reference_differences disagree with the cases")
    problems += coverage_problems(p.get("coverage"), upstream=embedded(p, UPSTREAM_TESTS),
                                  pristine=probes.get("pristine"))
    expected_summary = live_evidence.fold_summary(
        summarise(expected_rows, probes, embedded(p, UPSTREAM_TESTS), p.get("coverage"), apply=p["apply"]),
        p.get("live"))
    problems += live_evidence.section_problems(p.get("live"))
    summary = p["summary"]
    for key in sorted(set(expected_summary) | set(summary)):
        if summary.get(key) != expected_summary.get(key):
            problems.append(
                f"summary.{key} is {summary.get(key)!r}, the cases give {expected_summary.get(key)!r}"
            )
    torch = probe_torch(probes)
    if p["environment"].get("torch") != torch:
        problems.append(f"environment.torch is {p['environment'].get('torch')!r}, the probe results "
                        f"give {torch!r}")
    return problems


def _embedding_problems(p: dict) -> list[str]:
    """Each embedded document names its file (its digest is checked against the file: format3.py)."""
    problems = []
    parts = [(f"probes.{role}", p["probes"][role], probe_file(role)) for role in p["probes"]]
    parts.append(("upstream_tests", p["upstream_tests"], UPSTREAM_TESTS))
    for where, doc, name in parts:
        if doc.get("file") != name:
            problems.append(f"{where}.file is {doc.get('file')!r}, not {name!r}")
    return problems


def _input_problems(p: dict, table: bool = True) -> list[str]:
    """The inputs against what the run's documents say of the same things (`table`: _derived_problems)."""
    problems = []
    inputs, apply = p["inputs"], p["apply"]
    trees = inputs["trees"]
    if set(trees) != set(p["probes"]):
        problems.append(f"inputs.trees names {sorted(trees)}, probes cover {sorted(p['probes'])}")
    reference = inputs["reference"]
    if (reference is None) != (REFERENCE not in trees) or (
        reference is not None and {k: v for k, v in reference.items() if k != "chosen"} != trees[REFERENCE]
    ):
        problems.append("inputs.reference disagrees with inputs.trees.reference")
    target, pristine = inputs["target"], trees.get("pristine", {})
    for key in ("version", "artifact_sha256", "unpinned"):
        if target.get(key) != pristine.get(key):
            problems.append(f"inputs.target.{key} is {target.get(key)!r}, inputs.trees.pristine.{key} is "
                            f"{pristine.get(key)!r}")
    if target.get("commit") not in (None, pristine.get("commit")):
        problems.append(f"inputs.target.commit {target.get('commit')} is not the pristine tree's commit "
                        f"{pristine.get('commit')}")
    backport = p["mode"] == "backport"
    exposure = p["mode"] == "exposure"  # the pack could not serve the release: no head tree at all
    paired = p["mode"] == "upstream-pair"
    if (backport or exposure) != (apply is not None) or paired != (target.get("head") is not None):
        problems.append(f"mode {p['mode']!r} disagrees with the apply report and inputs.target.head")
    if exposure != (HEAD not in trees) or (exposure and (apply or {}).get("status") != ApplyStatus.FAILED):
        problems.append(
            f"mode {p['mode']!r} disagrees with inputs.trees (an exposure run, and only one, has no "
            f"patched tree, and its apply report failed)"
        )
    if backport:  # the patched tree is a clone of the pristine one
        for key in ("spec", "version", "artifact_sha256", "unpinned"):
            if trees.get("patched", {}).get(key) != pristine.get(key):
                problems.append(
                    f"inputs.trees.patched.{key} is {trees.get('patched', {}).get(key)!r}, but the "
                    f"patched tree is the pristine tree's clone, whose {key} is {pristine.get(key)!r}"
                )
    # an exposure run names no patch: the engine's report is kept, the scratch clone it patched is not
    expected_patches = [] if exposure else patch_inputs_from(apply, inputs["patches"])
    if not table:  # the apply report against inputs.patches and the commit: table.table_problems
        expected_patches = list(inputs["patches"])
    for index in range(max(len(expected_patches), len(inputs["patches"]))):
        got = inputs["patches"][index] if index < len(inputs["patches"]) else None
        want = expected_patches[index] if index < len(expected_patches) else None
        if got is None or want is None:
            problems.append(f"inputs.patches lists {len(inputs['patches'])} patches, predicate.apply has "
                            f"{len(expected_patches)} with a variant")
            break
        for key in ("fix", "variant", "sha256", "status"):
            if got.get(key) != want[key]:
                problems.append(f"inputs.patches[{index}].{key} is {got.get(key)!r}, predicate.apply records "
                                f"{want[key]!r} for {want['variant']}")
        if not (got.get("path") == want["variant"] or str(got.get("path")).endswith("/" + want["variant"])):
            problems.append(
                f"inputs.patches[{index}].path {got.get('path')!r} does not name {want['variant']}"
            )
    if apply is not None and not exposure:
        if table and trees.get("patched", {}).get("commit") != apply.get("head_commit"):
            problems.append(f"inputs.trees.patched.commit is {trees.get('patched', {}).get('commit')!r}, "
                            f"predicate.apply.head_commit is {apply.get('head_commit')!r}")
        if apply.get("version") != trees.get("patched", {}).get("version"):
            problems.append(
                f"predicate.apply.version is {apply.get('version')!r}, inputs.trees.patched.version "
                f"is {trees.get('patched', {}).get('version')!r}"
            )
    for tree in p["upstream_tests"].get("trees") or []:
        if tree.get("tree") not in trees:
            problems.append(f"upstream_tests ran on {tree.get('tree')!r}, which inputs.trees does not name")
    return problems


def check_statement(statement: Any, *, table: bool = True) -> list[str]:
    """Internal consistency of a receipt: its structure, everything it derives, its copies of one value.
    A receipt of format 4 is checked attached (table.attach) and with `table` False: what derives from
    its files is compared with them by table.table_problems."""
    if not isinstance(statement, dict):
        return ["is not a JSON object"]
    problems: list[str] = []
    if statement.get("_type") != STATEMENT_TYPE:
        problems.append(f"_type is not {STATEMENT_TYPE}")
    if statement.get("predicateType") != PREDICATE_TYPE:
        problems.append(f"predicateType is not {PREDICATE_TYPE}")
    p = statement.get("predicate")
    if not isinstance(p, dict):
        return problems + ["has no predicate object"]
    for key in ("probes", "cases", "summary", "inputs", "upstream_tests", "reference_differences", "apply",
                "environment", "mode", "files"):
        if key not in p:
            return problems + [f"predicate has no {key!r}"]
    try:
        for role in p["probes"]:
            if role not in ROLES:
                problems.append(f"predicate.probes has an unknown role {role!r}")
        problems += _derived_problems(p, table)
        problems += _embedding_problems(p)
        problems += _input_problems(p, table)
        problems += artifacts.statement_problems(statement)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        problems.append(f"malformed predicate ({type(exc).__name__}: {exc})")
    return problems
