"""The bundle's CycloneDX 1.6 document (`sbom.cdx.json`): the patched build as a component with
its pedigree, and the vulnerability classes with their analysis, built and strictly validated
offline with cyclonedx-python-lib.

- the component: the exported wheel (purl with the full local version, sha-256), or without
  `--export` the patched tree (no purl: a release's purl would speak for upstream's build);
  its `dirHash1` and `gitTree` are properties;
- ``pedigree.ancestors``: the upstream release it was made from (its purl and wheel sha-256);
- ``pedigree.patches``: one of type `backport` per applied patch, resolving its fix (a defect,
  with the upstream PR) and its vulnerability class (a security issue);
- ``vulnerabilities``: one per class, ``analysis.state`` from the same case-derived status as
  the OpenVEX statement (vulnerabilities.py); its `id` is the class's CVE/GHSA alias where one is
  known, the SBP id a reference (identifiers.primary_id): `fixed` -> `resolved_with_pedigree`, `affected`
  -> `exploitable` (response `update`), `under_investigation` -> `in_triage`, `not_affected`
  -> `not_affected` (justification `code_not_present`).

The serial number is a UUID5 of the OpenVEX document's id and the timestamp the VEX document's
(the pack's date, vulnerabilities.issued), so the document is a function of the inputs; the tools entry that
the library adds (its own version) is left out of the comparison in `verify`.
"""

from __future__ import annotations

import datetime as _dt
import json
import uuid

from backport.evidence.identifiers import (
    document_id,
    other_ids,
    primary_id,
    product_version,
    tree_iri,
    vulnerability_iri,
    wheel_purl,
)
from backport.evidence.layout import HEAD, canonical_json, product_role
from backport.evidence.problem import Problem
from backport.evidence.vulnerabilities import VulnClass, action_statement, class_status, issued
from backport.vocab import PatchStatus, VexStatus

SBOM = "sbom.cdx.json"
_STATES = {VexStatus.FIXED: "resolved_with_pedigree", VexStatus.AFFECTED: "exploitable",
           VexStatus.UNDER_INVESTIGATION: "in_triage", VexStatus.NOT_AFFECTED: "not_affected"}


def _component(statement: dict, standards: dict):
    from cyclonedx.model import HashAlgorithm, HashType, Property, XsUri
    from cyclonedx.model.component import Component, ComponentType, Patch, PatchClassification, Pedigree
    from cyclonedx.model.issue import IssueClassification, IssueType
    from packageurl import PackageURL


    p = statement["predicate"]
    role = product_role(p["inputs"]["trees"])
    patched = p["inputs"]["trees"][role]
    pristine = p["inputs"]["trees"].get("pristine") or {}
    wheel = (p.get("export") or {}).get("wheel")
    class_of = {fix: row for row in map(VulnClass.from_json, standards["classes"]) for fix in row.fixes}
    patches = []
    for item in p["inputs"]["patches"]:
        if item.get("status") != PatchStatus.APPLIED:
            continue
        row = class_of.get(item["fix"])
        resolves = [
            IssueType(
                type=IssueClassification.DEFECT,
                id=item["fix"],
                name=item["variant"],
                references=[XsUri(u) for u in ((row.fix_urls if row else None) or {}).get(item["fix"], [])],
            )
        ]
        if row is not None:
            resolves.append(
                IssueType(
                    type=IssueClassification.SECURITY,
                    id=row.id,
                    name=row.name,
                    description=row.title,
                    references=[XsUri(u) for u in row.references],
                )
            )
        patches.append(Patch(type=PatchClassification.BACKPORT, resolves=resolves))
    ancestors = []
    if pristine.get("version"):
        ancestors.append(Component(
            name="sglang", version=pristine["version"], type=ComponentType.LIBRARY,
            purl=PackageURL(type="pypi", name="sglang", version=pristine["version"]),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=pristine["artifact_sha256"])]
            if pristine.get("artifact_sha256") else None))
    git_tree = standards.get("git_trees", {}).get(role)
    properties = [Property(name="sglang-backport:dirHash1", value=patched["tree_digest"])]
    if git_tree:
        properties.append(Property(name="sglang-backport:gitTree", value=git_tree))
    version = product_version(statement)
    ref = wheel_purl(version) if wheel else tree_iri(patched["tree_digest"])
    return Component(
        name="sglang", version=version, type=ComponentType.LIBRARY, bom_ref=ref,
        purl=PackageURL(type="pypi", name="sglang", version=version) if wheel else None,
        hashes=[HashType(alg=HashAlgorithm.SHA_256, content=wheel["sha256"])] if wheel else None,
        pedigree=Pedigree(ancestors=ancestors, patches=patches,
                          notes="the upstream release with this pack's backports applied (sglang-backport)"
                          if role == HEAD else "the upstream release as shipped: the pack has no backport "
                                               "for it (sglang-backport, an exposure run)"),
        properties=properties), ref


def serial_number(statement: dict) -> str:
    """The SBOM's serial number: a function of the VEX document's id (vex.cdx.json's BOM-Links name it)."""
    return f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, document_id(statement))}"


def product_ref(statement: dict) -> str:
    """The bom-ref of the SBOM's component: the wheel's purl, or the patched tree's IRI."""
    p = statement["predicate"]
    trees = p["inputs"]["trees"]
    wheel = (p.get("export") or {}).get("wheel")
    if wheel:
        return wheel_purl(product_version(statement))
    return tree_iri(trees[product_role(trees)]["tree_digest"])


def alias_source(alias: str) -> dict:
    """Where an id is published, as a CycloneDX `source` (name and URL)."""
    if alias.startswith("GHSA"):
        return {"name": "GitHub Advisory Database", "url": f"https://github.com/advisories/{alias}"}
    if alias.startswith("CVE"):
        return {"name": "NVD", "url": f"https://nvd.nist.gov/vuln/detail/{alias}"}
    return {"name": "sglang-backport", "url": vulnerability_iri(alias)}


def _vulnerabilities(statement: dict, standards: dict, ref: str, aliased: bool = True) -> list:
    from cyclonedx.model import XsUri
    from cyclonedx.model.impact_analysis import (
        ImpactAnalysisJustification,
        ImpactAnalysisResponse,
        ImpactAnalysisState,
    )
    from cyclonedx.model.vulnerability import (
        BomTarget,
        Vulnerability,
        VulnerabilityAdvisory,
        VulnerabilityAnalysis,
        VulnerabilityReference,
        VulnerabilitySource,
    )


    p = statement["predicate"]
    found = []
    for row in map(VulnClass.from_json, standards["classes"]):
        status = class_status(row, p["cases"], p["apply"], p.get("live"))
        # aliased: the CVE/GHSA is the id scanners match and the SBP id a reference (module docstring)
        primary, others = (primary_id(row), other_ids(row)) if aliased else (row.id, list(row.aliases))
        origin = alias_source(primary)
        own = VulnerabilitySource(name=origin["name"], url=XsUri(origin["url"]))
        references = [
            VulnerabilityReference(id=alias, source=VulnerabilitySource(
                name=alias_source(alias)["name"],
                url=XsUri(alias_source(alias)["url"]) if aliased else None))
            for alias in others
        ]
        detail = status.notes
        recommendation = None
        if status.status == VexStatus.AFFECTED:
            recommendation = action_statement(row, status, product_version(statement), p["apply"])
        found.append(
            Vulnerability(
                bom_ref=f"vulnerability:{row.id}",
                id=primary,
                source=own,
                references=references,
                description=row.title,
                detail=row.description,
                recommendation=recommendation,
                advisories=[VulnerabilityAdvisory(url=XsUri(u)) for u in row.references],
                analysis=VulnerabilityAnalysis(
                    state=ImpactAnalysisState(_STATES[status.status]),
                    detail=detail,
                    justification=ImpactAnalysisJustification.CODE_NOT_PRESENT
                    if status.status == VexStatus.NOT_AFFECTED
                    else None,
                    responses=([ImpactAnalysisResponse.UPDATE] if status.status == VexStatus.AFFECTED
                               else None),
                ),
                affects=[BomTarget(ref=ref)],
            )
        )
    return found


def build(statement: dict, standards: dict, aliased: bool = True) -> str:
    """The CycloneDX 1.6 JSON text of one bundle (not yet validated)."""
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.output.json import JsonV1Dot6


    component, ref = _component(statement, standards)
    started = _dt.datetime.fromisoformat(
        issued(statement, standards)
    )  # not the run's time: same inputs, same bytes
    bom = Bom(serial_number=uuid.UUID(serial_number(statement).removeprefix("urn:uuid:")),
              metadata=BomMetaData(component=component, timestamp=started),
              vulnerabilities=_vulnerabilities(statement, standards, ref, aliased))
    return JsonV1Dot6(bom).output_as_string(indent=2)


def validation_error(text: str | bytes) -> str | None:
    """The strict CycloneDX 1.6 JSON schema's complaint about a document (None: valid)."""
    from backport.evidence import jsonschemas

    jsonschemas.load()  # before cyclonedx imports jsonschema: its IRI checks without the rfc3987 grammar
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(
        text.decode() if isinstance(text, bytes) else text)
    return None if error is None else str(error)[:300]


def comparable(document: dict) -> dict:
    """The document without the tools entry the library adds (its own name and version)."""
    document = json.loads(json.dumps(document))
    document.get("metadata", {}).pop("tools", None)
    return document


def build_bytes(statement: dict, standards: dict, aliased: bool = True) -> bytes:
    """The bundle file: validated strictly, in the bundle's canonical JSON form."""
    from backport.errors import Finding

    text = build(statement, standards, aliased)
    error = validation_error(text)
    if error:
        raise Finding(f"{SBOM}: not valid CycloneDX 1.6 ({error}); a toolkit bug: nothing written")
    return canonical_json(json.loads(text))


def same_document(a: bytes, b: bytes) -> bool:
    return comparable(json.loads(a)) == comparable(json.loads(b))


def validation_problems(data: bytes) -> list[Problem]:
    error = validation_error(data)
    return [Problem(SBOM, "inconsistent", f"not valid CycloneDX 1.6: {error}")] if error else []
