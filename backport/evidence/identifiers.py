"""The names a scanner matches a statement by: the wheel's package URL, the tree's IRI, the
vulnerability classes' IRIs and the VEX document's id (shared by the OpenVEX and CycloneDX documents)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from packageurl import PackageURL

from backport.evidence.layout import product_role

if TYPE_CHECKING:
    from backport.evidence.vulnerabilities import VulnClass

SITE = "https://sglang-backport.dev"

def wheel_purl(version: str) -> str:
    return PackageURL(type="pypi", name="sglang", version=version).to_string()

def tree_iri(digest: str) -> str:
    return f"urn:sglang-backport:tree:dirHash1:{digest}"

def vulnerability_iri(class_id: str) -> str:
    return f"{SITE}/vulnerabilities/{class_id}"

def product_version(statement: dict) -> str:
    p = statement["predicate"]
    wheel = (p.get("export") or {}).get("wheel")
    trees = p["inputs"]["trees"]
    return wheel["version"] if wheel else trees[product_role(trees)]["version"]

def document_id(statement: dict) -> str:
    p = statement["predicate"]
    wheel = (p.get("export") or {}).get("wheel")
    trees = p["inputs"]["trees"]
    key = wheel["sha256"] if wheel else trees[product_role(trees)]["tree_digest"]
    return f"{SITE}/vex/sglang-{product_version(statement)}/{key}"

def primary_id(row: VulnClass) -> str:
    """The id a scanner's findings carry for a class: its first CVE/GHSA alias (CVE before GHSA, as
    sorted), else the class's own SBP id. trivy keys CycloneDX VEX by `vulnerabilities[].id` alone
    and go-vex compares a finding's id to `name`, `@id` and `aliases`: a CVE only in references
    would suppress nothing."""
    aliases = sorted(row.aliases)
    return aliases[0] if aliases else row.id

def other_ids(row: VulnClass) -> list[str]:
    """The class's ids besides `primary_id`: the SBP id and the remaining aliases."""
    primary = primary_id(row)
    return [i for i in [row.id, *sorted(row.aliases)] if i != primary]

def bom_link(serial_number: str, version: int, ref: str) -> str:
    """A CycloneDX BOM-Link to one element of a BOM (`urn:cdx:<serial>/<version>#<bom-ref>`): the
    serial without its `urn:uuid:` prefix, the bom-ref percent-encoded (a purl's `%2B` becomes
    `%252B`, so that decoding the fragment gives the bom-ref back, `+` and all)."""
    from urllib.parse import quote

    return f"urn:cdx:{serial_number.removeprefix('urn:uuid:')}/{version}#{quote(ref, safe='')}"
