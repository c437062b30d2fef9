"""A reference matcher: how scanners decide that a VEX statement speaks for a finding, written
from their public source's rules (our own code; nothing copied), to check the bundle's documents
by what consumers do with them rather than by their shape.

OpenVEX, as go-vex (openvex/go-vex pkg/vex: Statement.Matches, Product.Matches,
Component.Matches, Vulnerability.Matches, PurlMatches), which trivy and grype use:

- a vulnerability matches a finding's id when the id equals its `@id`, its `name` or one of its
  `aliases`;
- a product matches an identifier when its `@id` equals it, or its `@id` is a purl and the purls
  match; or one of its `identifiers` equals it, or (its `purl` identifier, the identifier a purl)
  the purls match; or one of its `hashes` values equals it; with subcomponents named, one must match;
- two purls match when type, namespace and name are equal, the statement's version is empty or
  equal to the finding's (both parsed, so `%2B` and `+` are one version), and every qualifier of
  the statement's purl is in the finding's with the same value.

CycloneDX VEX, as trivy (aquasecurity/trivy pkg/vex/cyclonedx.go, fanal PkgIdentifier.Match):

- statements are keyed by `vulnerabilities[].id` alone (a later entry of the same id replaces an
  earlier one); only states `resolved`, `resolved_with_pedigree` (fixed), `not_affected` and
  `false_positive` (not affected) suppress;
- each `affects[].ref` must parse as a BOM-Link (`urn:cdx:<uuid>/<version>#<ref>`, the fragment
  query-unescaped) whose serial number and version are those of the scanned SBOM;
- the link's ref matches the scanned component when it equals the component's bom-ref, or (a purl,
  normalised by parsing and printing) its purl printed the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote_plus

from packageurl import PackageURL

_SUPPRESSING = {"resolved": "fixed", "resolved_with_pedigree": "fixed", "not_affected": "not_affected",
                "false_positive": "not_affected"}
_BOM_LINK = re.compile(r"^urn:cdx:(?P<serial>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
                       r"/(?P<version>[1-9][0-9]*)(?:#(?P<ref>.+))?$")


def _purl(text: str) -> PackageURL | None:
    try:
        return PackageURL.from_string(text)
    except ValueError:
        return None


def purl_matches(statement_purl: str, finding_purl: str) -> bool:
    a, b = _purl(statement_purl), _purl(finding_purl)
    if a is None or b is None:
        return False
    if (a.type, a.namespace, a.name) != (b.type, b.namespace, b.name):
        return False
    if a.version and (not b.version or a.version != b.version):
        return False
    theirs = b.qualifiers if isinstance(b.qualifiers, dict) else {}
    ours = a.qualifiers if isinstance(a.qualifiers, dict) else {}
    return all(theirs.get(k) == v for k, v in ours.items())


def component_matches(component: dict, identifier: str) -> bool:
    own = component.get("@id") or ""
    if own and own == identifier:
        return True
    if own.startswith("pkg:") and purl_matches(own, identifier):
        return True
    for kind, value in (component.get("identifiers") or {}).items():
        if value == identifier or (kind == "purl" and identifier.startswith("pkg:")
                                   and purl_matches(value, identifier)):
            return True
    return identifier in (component.get("hashes") or {}).values()


def openvex_matches(statement: dict, vulnerability: str, product: str, subcomponents: tuple = ()) -> bool:
    v = statement["vulnerability"]
    if vulnerability not in {v.get("@id"), v.get("name"), *(v.get("aliases") or ())}:
        return False
    for item in statement.get("products") or []:
        if not component_matches(item, product):
            continue
        subs = item.get("subcomponents") or []
        if not subs or not subcomponents or any(component_matches(s, x) for s in subs for x in subcomponents):
            return True
    return False


def openvex_status(document: dict, vulnerability: str, product: str) -> str | None:
    """The status the last matching statement gives (go-vex reads statements in document order)."""
    found = [s["status"] for s in document["statements"] if openvex_matches(s, vulnerability, product)]
    return found[-1] if found else None


def _normal(ref: str) -> str:
    parsed = _purl(ref) if ref.startswith("pkg:") else None
    return parsed.to_string() if parsed is not None else ref


def trivy_cdx_status(vex: dict, vulnerability: str, sbom: dict, component: dict) -> str | None:
    """The status trivy gives a finding of `vulnerability` on `component` of the SBOM `sbom` (its
    serialNumber and version) from the CycloneDX VEX `vex`: fixed, not_affected or None (not suppressed)."""
    statements = {v["id"]: v for v in vex.get("vulnerabilities") or []}  # the last of an id wins
    entry = statements.get(vulnerability)
    if entry is None:
        return None
    status = _SUPPRESSING.get((entry.get("analysis") or {}).get("state"))
    if status is None:
        return None
    serial = str(sbom.get("serialNumber", "")).removeprefix("urn:uuid:")
    for affect in entry.get("affects") or []:
        link = _BOM_LINK.match(affect.get("ref", ""))
        if link is None or link["ref"] is None:
            continue  # a plain bom-ref: trivy cannot place it in the scanned SBOM
        if link["serial"] != serial or int(link["version"]) != int(sbom.get("version", 1)):
            continue
        ref = _normal(unquote_plus(link["ref"]))
        purl = component.get("purl")
        if ref == component.get("bom-ref") or (purl is not None and ref == _normal(purl)):
            return status
    return None


def _spellings(version: str) -> list[str]:
    """A wheel's purl as consumers print it: percent-encoded `+` (the spec) and a literal one."""
    encoded = PackageURL(type="pypi", name="sglang", version=version).to_string()
    return [encoded, encoded.replace("%2B", "+")]


def check_files(files: dict[str, bytes]) -> int:
    """Assert what a scanner would do with one bundle's documents (its in-memory files); returns the
    number of (class, consumer) checks made (0: a bundle without VEX)."""
    if "vex.openvex.json" not in files:
        return 0
    openvex = json.loads(files["vex.openvex.json"])
    sbom = json.loads(files["sbom.cdx.json"])
    cdx = json.loads(files["vex.cdx.json"]) if "vex.cdx.json" in files else None
    component = sbom["metadata"]["component"]
    release = (component.get("pedigree", {}).get("ancestors") or [{}])[0].get("version")
    version = component["version"]
    wheel = component.get("purl") is not None
    checks = 0
    for statement in openvex["statements"]:
        ids = [statement["vulnerability"]["name"], statement["vulnerability"]["@id"],
               *(statement["vulnerability"].get("aliases") or ())]
        ours = [*(_spellings(version) if wheel else []),
                *(x for p in statement["products"] for x in (p["@id"], *(p.get("hashes") or {}).values()))]
        local = "+backport.1" if version.endswith("+backport.0") else "+backport.0"
        others = [p for p in ([f"pkg:pypi/sglang@{release}"] if release else []) + (
            _spellings(version.split("+")[0] + local) if wheel else []) if p not in ours]
        for vid in ids:
            for identifier in ours:
                assert openvex_status(openvex, vid, identifier) == statement["status"], (vid, identifier)
            for identifier in others:
                assert openvex_status(openvex, vid, identifier) is None, (vid, identifier)
        checks += 1
        if cdx is None:
            continue
        primary = statement["vulnerability"]["name"]
        want = {"fixed": "fixed", "not_affected": "not_affected"}.get(statement["status"])
        spelled = _spellings(version) if wheel else []
        scanned = [dict(component), *({"bom-ref": s, "purl": s} for s in spelled)]
        for item in scanned:
            assert trivy_cdx_status(cdx, primary, sbom, item) == want, (primary, item, statement["status"])
        for other in others:
            assert trivy_cdx_status(cdx, primary, sbom, {"bom-ref": other, "purl": other}) is None, other
        stale = {**sbom, "serialNumber": "urn:uuid:00000000-0000-4000-8000-000000000000"}
        assert trivy_cdx_status(cdx, primary, stale, component) is None  # another SBOM's component
        checks += 1
    return checks


def check_bundle(bundle: Path) -> int:
    names = ("vex.openvex.json", "sbom.cdx.json", "vex.cdx.json")
    return check_files({n: (Path(bundle) / n).read_bytes() for n in names if (Path(bundle) / n).is_file()})


def check_bundle_files(bundle) -> int:
    """check_files of an in-memory evidence.Bundle (conftest runs it on every bundle a test places)."""
    return check_files(dict(bundle.files))
