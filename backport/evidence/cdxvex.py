"""The bundle's standalone CycloneDX VEX (`vex.cdx.json`), the document trivy's `--vex` applies.

trivy reads a CycloneDX VEX by two rules (docs/vex-and-ci.md, "What scanners match"): a statement
is keyed by `vulnerabilities[].id` alone, and each `affects[].ref` must be a BOM-Link
(`urn:cdx:<serial>/<version>#<bom-ref>`) whose serial and version are those of the SBOM being
scanned and whose bom-ref is the scanned component's bom-ref or purl. sbom.cdx.json's own
vulnerabilities use a plain bom-ref (valid, but not a BOM-Link), so this file carries the same
statements as links into that SBOM: its serial number (cyclonedx.serial_number), version 1, and
the component's bom-ref (the wheel's purl, or the tree's IRI). Where a class has a CVE/GHSA alias
it is the `id` and the SBP id a reference. The document is built as plain JSON (no tools entry,
nothing of the run's time) and checked by the strict CycloneDX 1.6 validator, so the same inputs
give the same bytes and `verify` compares it byte for byte.

`aggregate` is merge's form: every bundle's statements in one document, one entry per (id,
state), its `affects` the BOM-Links of every bundle with that state.
"""

from __future__ import annotations

import hashlib
import uuid

from backport.errors import Finding
from backport.evidence import cyclonedx
from backport.evidence.identifiers import (
    SITE,
    bom_link,
    document_id,
    other_ids,
    primary_id,
    product_version,
)
from backport.evidence.layout import canonical_json
from backport.evidence.vulnerabilities import ClassStatus, VulnClass, action_statement, class_status, issued
from backport.vocab import VexStatus

VEX_CDX = "vex.cdx.json"
SBOM_VERSION = 1  # cyclonedx-python-lib writes every BOM as version 1
# trivy keeps the last entry of an id: entries that suppress nothing come first (aggregate)
_RANK = {"exploitable": 0, "in_triage": 1, "not_affected": 2, "resolved_with_pedigree": 3}


def _entry(row: VulnClass, status: ClassStatus, statement: dict, link: str) -> dict:
    p = statement["predicate"]
    primary = primary_id(row)
    analysis: dict = {"state": cyclonedx._STATES[status.status], "detail": status.notes}
    if status.status == VexStatus.NOT_AFFECTED:
        analysis["justification"] = "code_not_present"
    if status.status == VexStatus.AFFECTED:
        analysis["response"] = ["update"]
    entry = {
        "bom-ref": f"vulnerability:{row.id}",
        "id": primary,
        "source": cyclonedx.alias_source(primary),
        "references": [{"id": other, "source": cyclonedx.alias_source(other)} for other in other_ids(row)],
        "description": row.title,
        "detail": row.description,
        "advisories": [{"url": u} for u in row.references],
        "analysis": analysis,
        "affects": [{"ref": link}],
    }
    if not entry["references"]:
        del entry["references"]
    if status.status == VexStatus.AFFECTED:
        entry["recommendation"] = action_statement(row, status, product_version(statement), p["apply"])
    return entry


def build(statement: dict, standards: dict) -> dict:
    """The CycloneDX VEX document of one bundle: one vulnerability per class, linked into sbom.cdx.json."""
    p = statement["predicate"]
    link = bom_link(cyclonedx.serial_number(statement), SBOM_VERSION, cyclonedx.product_ref(statement))
    entries = [_entry(row, class_status(row, p["cases"], p["apply"], p.get("live")), statement, link)
               for row in map(VulnClass.from_json, standards["classes"])]
    serial = uuid.uuid5(uuid.NAMESPACE_URL, document_id(statement) + "#vex.cdx.json")
    return _document(f"urn:uuid:{serial}", issued(statement, standards), entries)


def _document(serial: str, timestamp: str, entries: list[dict]) -> dict:
    return {"bomFormat": "CycloneDX", "specVersion": "1.6", "serialNumber": serial, "version": 1,
            "metadata": {"timestamp": timestamp}, "vulnerabilities": entries}


def checked_bytes(document: dict, name: str = VEX_CDX) -> bytes:
    """The canonical bytes of a document the strict CycloneDX 1.6 validator accepts (else a toolkit
    bug: nothing is written)."""
    data = canonical_json(document)
    error = cyclonedx.validation_error(data)
    if error:
        raise Finding(f"{name}: not valid CycloneDX 1.6 ({error}); a toolkit bug: nothing written")
    return data


def build_bytes(statement: dict, standards: dict) -> bytes:
    return checked_bytes(build(statement, standards))


def aggregate(documents: list[dict]) -> dict | None:
    """merge's vex.cdx.json: the bundles' entries grouped by (id, state), their links joined in bundle
    order (each still names its own bundle's SBOM); None without any entry."""
    grouped: dict[tuple[str, str], dict] = {}
    for document in documents:
        for entry in document.get("vulnerabilities") or []:
            key = (entry["id"], entry["analysis"]["state"])
            if key not in grouped:
                own = entry["bom-ref"].removeprefix("vulnerability:")
                grouped[key] = {**entry, "bom-ref": f"vulnerability:{own}:{key[1]}", "affects": [],
                                "analysis": {**entry["analysis"], "detail": "per product: the detail of "
                                             "each bundle's own vex.cdx.json (merged by sglang-backport)"}}
                grouped[key].pop("recommendation", None)  # a release's own advice; the bundles keep it
            grouped[key]["affects"] += [a for a in entry["affects"] if a not in grouped[key]["affects"]]
    if not grouped:
        return None
    entries = [grouped[k] for k in sorted(grouped, key=lambda k: (k[0], _RANK.get(k[1], 0)))]
    digest = hashlib.sha256("".join(sorted(d["serialNumber"] + "\n" for d in documents)).encode()).hexdigest()
    serial = uuid.uuid5(uuid.NAMESPACE_URL, f"{SITE}/vex/merged/{digest}#vex.cdx.json")
    return _document(f"urn:uuid:{serial}", max(d["metadata"]["timestamp"] for d in documents), entries)


def class_of(entry: dict) -> str:
    """The SBP id of an entry (its bom-ref names it, whatever its primary id)."""
    return entry["bom-ref"].split(":")[1]

