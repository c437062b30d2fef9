"""The names a scanner matches a statement by: the wheel's package URL, the tree's IRI, the
vulnerability classes' IRIs and the VEX document's id (shared by the OpenVEX and CycloneDX documents)."""

from __future__ import annotations

from packageurl import PackageURL

from backport.evidence.layout import product_role

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
