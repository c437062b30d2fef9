"""The bundle's VEX as scanners consume it (issue 47 items 2, 3): the reference matcher
(tests/vex_oracle.py, go-vex's and trivy's rules) on the documents `run` writes, with and without
a CVE alias, and vex.cdx.json's BOM-Links into sbom.cdx.json. conftest runs the same matcher on
every bundle any test places; here it also runs on the exported wheel's bundle, and the matcher
itself is held to the rules it follows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from backport import evidence
from backport.evidence import cdxvex, cyclonedx
from backport.evidence.vulnerabilities import add_aliases
from tests import vex_oracle
from tests.test_run_export import exported_run  # noqa: F401 - fixture
from tests.test_vex import classes, vex_run  # noqa: F401 - fixture

CVE = "CVE-2026-12345"


# ---- the matcher follows the rules it is written from ----------------------------------------------

@pytest.mark.parametrize("statement, finding, matches", [
    ("pkg:pypi/sglang@0.5.19%2Bbackport.7", "pkg:pypi/sglang@0.5.19+backport.7", True),
    ("pkg:pypi/sglang@0.5.19+backport.7", "pkg:pypi/sglang@0.5.19%2Bbackport.7", True),
    ("pkg:pypi/sglang@0.5.19%2Bbackport.7", "pkg:pypi/sglang@0.5.19", False),
    ("pkg:pypi/sglang@0.5.19%2Bbackport.7", "pkg:pypi/sglang@0.5.19+backport.8", False),
    ("pkg:pypi/sglang", "pkg:pypi/sglang@0.5.19", True),          # a version-less statement: every version
    ("pkg:pypi/sglang@0.5.19", "pkg:pypi/sglang", False),         # a finding without one: none
    ("pkg:pypi/sglang@0.5.19?arch=x86", "pkg:pypi/sglang@0.5.19", False),  # its qualifiers must be there
    ("pkg:pypi/sglang@0.5.19", "pkg:pypi/sglang@0.5.19?arch=x86", True),
    ("pkg:pypi/vllm@0.5.19", "pkg:pypi/sglang@0.5.19", False),
])
def test_purl_rule(statement, finding, matches):
    assert vex_oracle.purl_matches(statement, finding) is matches


def test_a_statement_matches_by_name_id_or_alias_and_by_purl_or_hash():
    statement = {"vulnerability": {"@id": "https://x/SBP-1", "name": CVE, "aliases": ["SBP-2026-0001"]},
                 "products": [{"@id": "pkg:pypi/sglang@1%2Bb.1", "hashes": {"sha-256": "ab" * 32}}],
                 "status": "fixed"}
    for vid in (CVE, "https://x/SBP-1", "SBP-2026-0001"):
        assert vex_oracle.openvex_matches(statement, vid, "pkg:pypi/sglang@1+b.1")
    assert vex_oracle.openvex_matches(statement, CVE, "ab" * 32)
    assert not vex_oracle.openvex_matches(statement, "CVE-2026-99999", "pkg:pypi/sglang@1+b.1")
    assert not vex_oracle.openvex_matches(statement, CVE, "cd" * 32)


def test_trivy_needs_a_bom_link_to_this_sbom_and_a_suppressing_state():
    sbom = {"serialNumber": "urn:uuid:3f1c2d4e-0000-5000-8000-000000000001", "version": 1}
    component = {"bom-ref": "pkg:pypi/sglang@1%2Bb.1", "purl": "pkg:pypi/sglang@1%2Bb.1"}
    plain = {"vulnerabilities": [{"id": CVE, "analysis": {"state": "resolved_with_pedigree"},
                                  "affects": [{"ref": component["bom-ref"]}]}]}
    assert vex_oracle.trivy_cdx_status(plain, CVE, sbom, component) is None  # what sbom.cdx.json has
    link = {"ref": "urn:cdx:3f1c2d4e-0000-5000-8000-000000000001/1#pkg%3Apypi%2Fsglang%401%252Bb.1"}
    linked = {"vulnerabilities": [{**plain["vulnerabilities"][0], "affects": [link]}]}
    assert vex_oracle.trivy_cdx_status(linked, CVE, sbom, component) == "fixed"
    assert vex_oracle.trivy_cdx_status(linked, CVE, {**sbom, "version": 2}, component) is None
    assert vex_oracle.trivy_cdx_status(linked, "SBP-2026-0001", sbom, component) is None  # by id alone
    triage = {"vulnerabilities": [{**linked["vulnerabilities"][0], "analysis": {"state": "in_triage"}}]}
    assert vex_oracle.trivy_cdx_status(triage, CVE, sbom, component) is None


# ---- the bundles' documents ---------------------------------------------------------------------------

def _aliased(classes):  # noqa: F811
    return add_aliases(classes, {"SBP-2026-0001": [CVE]})  # as `run --vuln-alias SBP-2026-0001=CVE-...`


@pytest.fixture
def aliased_bundle(tmp_path, classes) -> Path:  # noqa: F811
    return evidence.write_bundle(tmp_path / "bundle", vex_run(tmp_path / "run", _aliased(classes)))


def test_an_alias_is_the_primary_id_and_the_sbp_id_an_alias(aliased_bundle):
    openvex = json.loads((aliased_bundle / "vex.openvex.json").read_bytes())
    first = next(s for s in openvex["statements"] if s["vulnerability"]["@id"].endswith("/SBP-2026-0001"))
    assert first["vulnerability"]["name"] == CVE and first["vulnerability"]["aliases"] == ["SBP-2026-0001"]
    for name in ("vex.cdx.json", "sbom.cdx.json"):
        document = json.loads((aliased_bundle / name).read_bytes())
        entry = next(v for v in document["vulnerabilities"] if v["bom-ref"] == "vulnerability:SBP-2026-0001")
        assert entry["id"] == CVE and [r["id"] for r in entry["references"]] == ["SBP-2026-0001"]
    others = [s for s in openvex["statements"] if s is not first]
    assert all(s["vulnerability"]["name"].startswith("SBP-") for s in others)  # no alias: the SBP id
    assert vex_oracle.check_bundle(aliased_bundle) == 2 * len(openvex["statements"])
    assert evidence.verify(aliased_bundle).ok


def test_vex_cdx_links_into_the_bundles_sbom_and_is_listed_and_hashed(aliased_bundle):
    sbom = json.loads((aliased_bundle / "sbom.cdx.json").read_bytes())
    vex = json.loads((aliased_bundle / "vex.cdx.json").read_bytes())
    serial = sbom["serialNumber"].removeprefix("urn:uuid:")
    want = f"urn:cdx:{serial}/{sbom['version']}#"
    assert all(a["ref"].startswith(want) for v in vex["vulnerabilities"] for a in v["affects"])
    assert vex["serialNumber"] != sbom["serialNumber"] and cyclonedx.validation_error(
        (aliased_bundle / "vex.cdx.json").read_bytes()) is None
    receipt = json.loads((aliased_bundle / "receipt.json").read_bytes())
    digest = evidence.sha256_file(aliased_bundle / "vex.cdx.json")
    assert receipt["predicate"]["files"]["vex.cdx.json"] == digest
    assert "  vex.cdx.json\n" in (aliased_bundle / "SHA256SUMS").read_text()


def test_an_edited_vex_cdx_is_named(aliased_bundle):
    path = aliased_bundle / "vex.cdx.json"
    document = json.loads(path.read_bytes())
    document["vulnerabilities"][0]["analysis"]["state"] = "not_affected"
    document["vulnerabilities"][0]["analysis"]["justification"] = "code_not_present"
    path.write_bytes(json.dumps(document).encode())
    receipt_path = aliased_bundle / "receipt.json"
    receipt = json.loads(receipt_path.read_bytes())
    receipt["predicate"]["files"]["vex.cdx.json"] = evidence.sha256_file(path)
    receipt_path.write_bytes(json.dumps(receipt).encode())
    result = evidence.verify(aliased_bundle)
    assert not result.ok and any("vex.cdx.json" in (p.file + p.detail) for p in result.problems)


def test_a_bundle_of_the_layout_before_vex_cdx_still_verifies(tmp_path, classes, monkeypatch):  # noqa: F811
    """A bundle written before vex.cdx.json (the SBP id as `name` even with an alias) is read in
    its own layout: no new format, no failed verify of an honest old bundle."""
    from backport.evidence import vex

    real = vex.bundle_files
    monkeypatch.setattr(vex, "bundle_files", lambda s, st, aliased=True: real(s, st, False))
    old = evidence.write_bundle(tmp_path / "old", vex_run(tmp_path / "run", _aliased(classes)))
    monkeypatch.setattr(vex, "bundle_files", real)
    assert not (old / "vex.cdx.json").exists()
    assert json.loads((old / "vex.openvex.json").read_bytes())["statements"][0]["vulnerability"]["name"] \
        == "SBP-2026-0001"
    assert evidence.verify(old).ok


def test_the_same_inputs_give_the_same_vex_cdx(tmp_path, classes):  # noqa: F811
    a = evidence.write_bundle(tmp_path / "a", vex_run(tmp_path / "r1", classes))
    b = evidence.write_bundle(tmp_path / "b", vex_run(tmp_path / "r2", classes))
    assert (a / cdxvex.VEX_CDX).read_bytes() == (b / cdxvex.VEX_CDX).read_bytes()


@pytest.mark.network
def test_the_exported_wheels_bundle_passes_the_matcher(exported_run):  # noqa: F811
    """The real `run sglang==0.5.19 --export` bundle (stub probes): the wheel's purl in both
    spellings and its sha-256 are matched by each fixed statement; 0.5.19 and another local version not."""
    openvex = json.loads((exported_run / "vex.openvex.json").read_bytes())
    fixed = [s for s in openvex["statements"] if s["status"] == "fixed"]
    purls = [p["@id"] for p in fixed[0]["products"]] if fixed else []
    assert any(p.startswith("pkg:pypi/sglang@0.5.19%2Bbackport.") for p in purls), purls
    assert vex_oracle.check_bundle(exported_run) == 2 * len(openvex["statements"])
    assert evidence.verify(exported_run).ok


@pytest.mark.skipif(not os.environ.get("SGLANG_BACKPORT_TRIVY"),
                    reason="no scanner here: SGLANG_BACKPORT_TRIVY names a trivy binary (and "
                           "SGLANG_BACKPORT_TRIVY_CACHE a cache dir whose DB has an sglang advisory)")
def test_trivy_suppresses_with_the_bundles_vex(aliased_bundle):
    trivy, cache = os.environ["SGLANG_BACKPORT_TRIVY"], os.environ.get("SGLANG_BACKPORT_TRIVY_CACHE", "")
    assert shutil.which(trivy) or Path(trivy).is_file()

    def findings(*extra: str) -> int:
        out = subprocess.run([trivy, "sbom", "--offline-scan", "--skip-db-update", "--cache-dir", cache,
                              "--format", "json", *extra, str(aliased_bundle / "sbom.cdx.json")],
                             capture_output=True, text=True, check=True).stdout
        return sum(len(r.get("Vulnerabilities") or []) for r in json.loads(out).get("Results") or [])

    assert findings() > 0
    assert findings("--vex", str(aliased_bundle / "vex.cdx.json")) == 0
