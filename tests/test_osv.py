"""merge's advisory feed (issue 47 item 4) and its aggregate CycloneDX VEX (item 2): OSV records
validated against OSV's own schema and read the way osv-scanner reads an ECOSYSTEM range (PEP 440
order: `0.5.19 < 0.5.19+backport.N < 0.5.19.post1`), and the merged vex.cdx.json applied by the
reference matcher to each bundle's own SBOM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from packaging.version import Version

from backport import cli, evidence
from backport.evidence import cyclonedx, osv
from backport.evidence.vulnerabilities import add_aliases
from tests import vex_oracle
from tests.test_run_export import exported_run  # noqa: F401 - fixture
from tests.test_vex import classes, vex_run  # noqa: F401 - fixture

CVE = "CVE-2026-12345"


def affected(record: dict, version: str) -> bool:
    """Whether an OSV record lists `version` of sglang, by the schema's ECOSYSTEM range rules
    (introduced <= v < fixed, or <= last_affected; each range on its own)."""
    v = Version(version)
    for entry in record["affected"]:
        if entry["package"]["ecosystem"] != "PyPI" or entry["package"]["name"] != "sglang":
            continue
        for r in entry["ranges"]:
            events = {k: val for e in r["events"] for k, val in e.items()}
            start = Version("0") if events["introduced"] == "0" else Version(events["introduced"])
            if v < start:
                continue
            if "fixed" in events and v < Version(events["fixed"]):
                return True
            if "last_affected" in events and v <= Version(events["last_affected"]):
                return True
    return False


@pytest.fixture
def merged(tmp_path, classes, exported_run, capsys) -> tuple[Path, list[Path]]:  # noqa: F811
    """merge of the exported wheel's bundle and a tree-only bundle whose classes carry a CVE alias."""
    wheel = Path(shutil.copytree(exported_run, tmp_path / "all" / "wheel"))
    aliased = add_aliases(classes, {"SBP-2026-0001": [CVE]})
    tree = evidence.write_bundle(tmp_path / "all" / "tree", vex_run(tmp_path / "run", aliased))
    out = tmp_path / "merged"
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["osv_records"] == sorted(p.name for p in (out / "osv").iterdir())
    return out, [wheel, tree]


@pytest.mark.network
def test_merge_writes_one_valid_osv_record_per_exposed_class(merged):
    out, (wheel, _) = merged
    product = json.loads((wheel / "receipt.json").read_bytes())["predicate"]["export"]["wheel"]["version"]
    record = json.loads((out / "osv" / "x_SBP-2026-0001.json").read_bytes())
    assert osv.schema_error(record) is None
    assert record["aliases"] == [CVE] and record["modified"].endswith("Z")
    # the fixture's cases show SBP-2026-0001 on pristine 0.5.19: the release is listed, its wheel fixed
    assert affected(record, "0.5.19") and not affected(record, product)
    assert not affected(record, "0.5.18") and not affected(record, "0.5.20")
    assert {"introduced": "0.5.19"} in record["affected"][0]["ranges"][0]["events"]
    assert any(r["type"] == "FIX" for r in record["references"])
    for path in (out / "osv").iterdir():  # every record validates; none for a class no bundle showed
        document = json.loads(path.read_bytes())
        assert osv.schema_error(document) is None and document["affected"]


@pytest.mark.network
def test_the_merged_cdx_vex_suppresses_each_bundles_fixed_product(merged):
    out, bundles = merged
    aggregate = json.loads((out / "vex.cdx.json").read_bytes())
    assert cyclonedx.validation_error((out / "vex.cdx.json").read_bytes()) is None
    checked = 0
    for bundle in bundles:
        sbom = json.loads((bundle / "sbom.cdx.json").read_bytes())
        own = json.loads((bundle / "vex.cdx.json").read_bytes())
        for entry in own["vulnerabilities"]:
            if entry["analysis"]["state"] == "resolved_with_pedigree":
                component = sbom["metadata"]["component"]
                status = vex_oracle.trivy_cdx_status(aggregate, entry["id"], sbom, component)
                assert status == "fixed", (bundle.name, entry["id"])
                checked += 1
    assert checked >= 2
    ids = [v["id"] for v in aggregate["vulnerabilities"]]
    assert CVE in ids and "SBP-2026-0001" in ids  # the aliased bundle by its CVE, the other by its SBP id


def test_the_schema_refuses_what_osv_does_not_allow():
    good = {"schema_version": osv.SCHEMA_VERSION, "id": "x_SBP-2026-0001", "modified": "2026-11-30T00:00:00Z",
            "affected": [{"package": dict(osv.PACKAGE),
                          "ranges": [{"type": "ECOSYSTEM", "events": [{"introduced": "0.5.19"}]}]}]}
    assert osv.schema_error(good) is None
    assert "id" in (osv.schema_error({**good, "id": "SBP-2026-0001"}) or "")  # no unregistered prefix
    assert osv.schema_error({**good, "modified": "2026-11-30T00:00:00+00:00"})  # UTC with a Z only
    bad = json.loads(json.dumps(good))
    bad["affected"][0]["ranges"][0]["events"] = [{"fixed": "0.5.20"}]  # a range needs `introduced`
    assert osv.schema_error(bad)


def test_a_merge_out_folder_with_osv_records_can_be_merged_into_again(tmp_path, classes, capsys):  # noqa: F811
    bundle = evidence.write_bundle(tmp_path / "all" / "b", vex_run(tmp_path / "run", classes))
    out = tmp_path / "merged"
    (out / "osv").mkdir(parents=True)
    (out / "osv" / "x_SBP-2026-0099.json").write_text("{}")  # an earlier merge's record of another class
    for _ in range(2):
        assert cli.main(["merge", str(bundle), "--out", str(out), "--json"]) == 0
        capsys.readouterr()
    assert sorted(p.name for p in (out / "osv").iterdir()) == ["x_SBP-2026-0001.json"]
