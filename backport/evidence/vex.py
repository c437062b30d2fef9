"""The bundle's VEX: what a scanner reads about the patched build (OpenVEX 0.2.0, and CycloneDX
1.6 in cyclonedx.py), built from the receipt and the bundle's `standards.json`.

`standards.json` holds what the standard documents say beyond the receipt: the vulnerability
classes the run was judged with (vulnerabilities.py, with their aliases) and each probed
tree's git tree id (`gitTree`, read from the work tree while it exists). Everything else comes
from the receipt, so `verify` rebuilds `vex.openvex.json` and `sbom.cdx.json` and compares.

Products of every statement:

- with `run --export`, the exported wheel by its purl with the full local version
  (``pkg:pypi/sglang@0.5.19%2Bbackport.N``; a version-less or upstream purl would hand the
  status to every build of the release) and its sha-256;
- the patched `sglang/` tree by its `dirHash1` (the receipt's tree digest: docs/vex-and-ci.md, "Tree
  digests"), as ``urn:sglang-backport:tree:dirHash1:<hex>``.

The upstream wheel is never a product: its status is upstream's to state.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from backport.vocab import VexStatus

if TYPE_CHECKING:  # jsonschema is imported where used, through jsonschemas.load (start-up stays light)
    import jsonschema

from backport import resources
from backport.errors import Finding
from backport.evidence import jsonschemas
from backport.evidence.identifiers import (  # noqa: F401 - the names scanners match, part of this API
    SITE,
    document_id,
    other_ids,
    primary_id,
    product_version,
    tree_iri,
    vulnerability_iri,
    wheel_purl,
)
from backport.evidence.layout import canonical_json, product_role
from backport.evidence.problem import Problem
from backport.evidence.statement import first_schema_error, schema_place
from backport.evidence.vulnerabilities import VulnClass, action_statement, class_status, issued

VEX = "vex.openvex.json"
STANDARDS = "standards.json"
CONTEXT = "https://openvex.dev/ns/v0.2.0"
AUTHOR = "sglang-backport (the patch pack's maintainers; statements generated from this bundle's probe cases)"








def products(statement: dict) -> list[dict]:
    p = statement["predicate"]
    found = []
    wheel = (p.get("export") or {}).get("wheel")
    if wheel:
        purl = wheel_purl(wheel["version"])
        found.append({"@id": purl, "identifiers": {"purl": purl}, "hashes": {"sha-256": wheel["sha256"]}})
    trees = p["inputs"]["trees"]
    found.append({"@id": tree_iri(trees[product_role(trees)]["tree_digest"])})
    return found






def build_vex(statement: dict, standards: dict, aliased: bool = True) -> dict:
    """The OpenVEX document of one bundle: one statement per vulnerability class. `aliased`: a
    class's CVE/GHSA alias is the vulnerability's `name` and the SBP id an alias (False: the layout
    of bundles written before vex.cdx.json, the SBP id as `name`, which `verify` still reads)."""
    p = statement["predicate"]
    version = p["inputs"]["trees"][product_role(p["inputs"]["trees"])]["version"]
    toolkit = p["toolkit"]
    statements = []
    for row in map(VulnClass.from_json, standards["classes"]):
        status = class_status(row, p["cases"], p["apply"], p.get("live"))
        name, aliases = (primary_id(row), other_ids(row)) if aliased else (row.id, list(row.aliases))
        vulnerability: dict = {"@id": vulnerability_iri(row.id), "name": name, "description": row.title}
        if aliases:
            vulnerability["aliases"] = aliases
        item = {"vulnerability": vulnerability, "products": products(statement), "status": status.status,
                "status_notes": f"{status.notes}. Fixes of the class: {', '.join(row.fixes)}. "
                                f"References: {' '.join(row.references)}"}
        if status.status == VexStatus.AFFECTED:
            item["action_statement"] = action_statement(row, status, version, p["apply"])
        if status.status == VexStatus.NOT_AFFECTED:
            item["justification"] = "vulnerable_code_not_present"
        statements.append(item)
    return {
        "@context": CONTEXT,
        "@id": document_id(statement),
        "author": AUTHOR,
        "role": "backport maintainer",
        "timestamp": issued(statement, standards),
        "version": 1,
        "tooling": f"sglang-backport {toolkit.get('version')} (commit {toolkit.get('git_commit')})",
        "statements": statements,
    }


@cache
def _validator() -> jsonschema.Draft202012Validator:
    path = resources.openvex_schema()
    schema = json.loads(path.read_text())
    jsonschema = jsonschemas.load()
    return jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )


def schema_errors(document: object) -> str | None:
    """The first place where a document departs from the OpenVEX schema (None: it matches)."""
    error = first_schema_error(_validator(), document)
    if error is None:
        return None
    where = schema_place(error)
    if error.validator in (
        "anyOf",
        "oneOf",
        "not",
        "if",
    ):  # the status rules: name the rule, not the instance
        rule = "/".join(str(part) for part in error.schema_path)
        return f"does not match the OpenVEX 0.2.0 schema at {where}: breaks the status rule {rule} " \
               f"(not_affected needs a justification or impact_statement, affected an action_statement, " \
               f"and no other status has them)"
    return f"does not match the OpenVEX 0.2.0 schema at {where}: {error.message[:200]}"


def standards_document(classes: list[VulnClass], git_trees: dict[str, str | None]) -> dict:
    return {"classes": [c.to_json() for c in classes], "git_trees": dict(sorted(git_trees.items()))}


def bundle_files(statement: dict, standards: dict, aliased: bool = True) -> dict[str, bytes]:
    """standards.json, vex.openvex.json, sbom.cdx.json and vex.cdx.json, each validated before it
    is written (aliased False: the three files of a bundle written before vex.cdx.json, as
    `verify` rebuilds them)."""
    from backport.evidence import cdxvex, cyclonedx

    vex = build_vex(statement, standards, aliased)
    error = schema_errors(vex)
    if error:
        raise Finding(f"{VEX}: {error} (a toolkit bug: nothing written)")
    files = {STANDARDS: canonical_json(standards), VEX: canonical_json(vex),
             cyclonedx.SBOM: cyclonedx.build_bytes(statement, standards, aliased)}
    if aliased:
        files[cdxvex.VEX_CDX] = cdxvex.build_bytes(statement, standards)
    return files


def problems(bundle: Path, statement: dict, present: set[str]) -> list[Problem]:
    """The VEX files against the receipt: each one is what the receipt and standards.json give.

    A bundle without vex.cdx.json was written before it (and before a CVE/GHSA alias became the
    primary id): its three files are rebuilt in that layout. The receipt lists every file of the
    bundle, so vex.cdx.json cannot go missing from a newer one unnoticed (integrity checks it first)."""
    from backport.evidence import cdxvex, cyclonedx

    names = {STANDARDS, VEX, cyclonedx.SBOM}
    if not names & present:
        return []  # a bundle from before VEX (the receipt lists no such file, or the earlier checks said so)
    aliased = cdxvex.VEX_CDX in present
    missing = sorted(names - present)
    if missing:
        return [Problem(name, "missing", "the bundle holds VEX files but not this one") for name in missing]
    try:
        standards = json.loads((bundle / STANDARDS).read_bytes())
        expected = bundle_files(statement, standards, aliased)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return [
            Problem(
                STANDARDS,
                "inconsistent",
                f"not the standards document of a bundle ({type(exc).__name__}: {exc})",
            )
        ]
    except Finding as exc:
        return [Problem(VEX, "inconsistent", str(exc))]
    found = []
    document = json.loads((bundle / VEX).read_bytes())
    error = schema_errors(document)
    if error:
        found.append(Problem(VEX, "inconsistent", error))
    same = {
        **({cdxvex.VEX_CDX: (bundle / cdxvex.VEX_CDX).read_bytes() == expected[cdxvex.VEX_CDX]}
           if aliased else {}),
        VEX: (bundle / VEX).read_bytes() == expected[VEX],
        cyclonedx.SBOM: cyclonedx.same_document(
            (bundle / cyclonedx.SBOM).read_bytes(), expected[cyclonedx.SBOM]
        ),
    }
    for name, ok in same.items():
        if not ok:
            found.append(
                Problem(
                    name,
                    "inconsistent",
                    "differs from what the receipt and standards.json give: "
                    + _difference(bundle / name, expected[name]),
                )
            )
    found += cyclonedx.validation_problems((bundle / cyclonedx.SBOM).read_bytes())
    if aliased:
        error = cyclonedx.validation_error((bundle / cdxvex.VEX_CDX).read_bytes())
        if error:
            found.append(Problem(cdxvex.VEX_CDX, "inconsistent", f"not valid CycloneDX 1.6: {error}"))
    return found


def _difference(path: Path, expected: bytes) -> str:
    """Where a VEX file departs from the one the receipt gives, named by what changed (a product,
    a status, another field), so that a reader is not sent to the cases for an edited product."""
    from backport.evidence import cyclonedx
    from backport.evidence.table import first_difference

    try:
        found = json.loads(path.read_bytes())
    except ValueError:
        return "not JSON"
    want = json.loads(expected)
    if path.name == cyclonedx.SBOM:
        found, want = cyclonedx.comparable(found), cyclonedx.comparable(want)
    where = first_difference(found, want)
    if where is None:
        return "not in the canonical form the toolkit writes"
    place, has, gives = where
    what = (
        "a product changed"
        if ".products" in place or ".affects" in place or "metadata.component" in place
        else "a status changed (statuses follow from the receipt's cases)"
        if place.endswith((".status", ".state", ".justification"))
        else "a field changed"
    )
    return (
        f"{what}: {place.lstrip('.')} is {json.dumps(has)[:120]}, the receipt gives {json.dumps(gives)[:120]}"
    )
