"""VEX per bundle: the vulnerability classes (patches/vulnerabilities.toml), the status each class's
cases support, the OpenVEX 0.2.0 document against the schema this project wrote from the spec,
the CycloneDX 1.6 document validated strictly by cyclonedx-python-lib, and `verify` on both."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from backport import cli, evidence, resources
from backport.errors import BadInput
from backport.evidence import cyclonedx, vex
from backport.evidence.table import attached_from
from backport.evidence.vulnerabilities import VulnClass, add_aliases, class_status, load_classes, pack_classes
from backport.pack import load_pack
from backport.records import LiveResult, ScenarioResult
from backport.vocab import TreeVerdict
from tests.test_evidence import _files, _receipt, fixture_run
from tests.test_sign import keys  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def classes() -> list[VulnClass]:
    return pack_classes(load_pack(resources.pack_dir()))


def vex_run(tmp: Path, classes, **kwargs) -> evidence.Bundle:
    """The evidence fixture run, with the pack's classes (as the main job passes them)."""
    return fixture_run(tmp, vulnerabilities=classes, **kwargs)


@pytest.fixture
def bundle(tmp_path, classes) -> Path:
    return evidence.write_bundle(tmp_path / "bundle", vex_run(tmp_path / "run", classes))


def _row(probe, case, pristine, patched, *, must_preserve=False, pair=None):
    from backport.evidence.verdicts import pair_verdict

    return {"probe": probe, "case": case, "must_preserve": must_preserve,
            "verdicts": {"pristine": pristine, "patched": patched},
            "pair": pair or pair_verdict(pristine, patched)}


# ---- the classes --------------------------------------------------------------------------------


def test_every_fix_and_every_probe_belongs_to_exactly_one_class(classes):
    pack = load_pack(resources.pack_dir())
    fixes = [f for c in classes for f in c.fixes]
    assert sorted(fixes) == sorted(pack.fixes)
    # a probe is a module of probes/ or a package of scenario modules (probes/prefill_drain/): its top-level
    # name
    cases_dir = REPO / "probes" / "cases"
    probe_modules = sorted({p.relative_to(cases_dir).parts[0].removesuffix(".py")
                            for p in cases_dir.rglob("*.py") if "\n@case(" in p.read_text()})
    assert sorted(p for c in classes for p in c.probes) == probe_modules
    for c in (
        classes
    ):  # each fix's report (its patches' Bug:), where it names one, is one of its class's references
        assert {pack.fixes[f].bug for f in c.fixes} - {""} <= set(c.references), c.id
    by_name = {c.name: c for c in classes}
    # sbp-abort-hold (ours, below 0.5.13 only) is not needed where upstream's chain is: 0.5.22 still ships
    # every fix the class needs there
    assert by_name["page-lifetime-release-race"].upstream_fixed_in == "0.5.22"
    assert by_name["page-lifetime-release-race"].pack_reach == "0.5.13"
    assert by_name["rejected-request-handoff"].pack_reach == "0.4.5.post1"
    assert by_name["rejected-request-handoff"].upstream_fixed_in is None  # the coverage check is ours
    assert by_name["flush-during-deferred-hold"].upstream_fixed_in is None  # ours (0.5.23: an exception)


def test_a_bad_classes_file_is_bad_input(tmp_path):
    good = (resources.pack_dir() / "vulnerabilities.toml").read_text()
    for bad, message in [
        (good.replace('id = "SBP-2026-0002"', 'id = "X-1"'), "SBP-YYYY-NNNN"),
        (good.replace('"prefill_drain"]', '"prefill_drain", "handoff"]'), "already belongs to SBP-2026-0001"),
        (good.replace('aliases = []', 'aliases = ["not-a-cve"]', 1), "not a CVE"),
        (good.replace('"sbp-layer-drain"]', '"sbp-layer-drain", "pr99999"]'), "not in fixes.toml"),
        (good.replace('"sbp-abort-hold", "sbp-layer-drain"]', '"sbp-abort-hold"]'), "belongs to no"),
    ]:
        (tmp_path / "vulnerabilities.toml").write_text(bad)
        with pytest.raises(BadInput, match=message):
            load_classes(tmp_path, list(load_pack(resources.pack_dir()).fixes))


def test_aliases_are_added_by_class_id_or_name_and_checked(classes):
    more = add_aliases(
        classes, {"SBP-2026-0001": ["CVE-2026-12345"], "page-lifetime-release-race": ["GHSA-c3g4-8h2j-mpqr"]}
    )
    assert [list(c.aliases) for c in more] == [["CVE-2026-12345"], ["GHSA-c3g4-8h2j-mpqr"]] + [[]] * (
        len(more) - 2
    )
    with pytest.raises(BadInput, match="no vulnerability class 'nope'"):
        add_aliases(classes, {"nope": ["CVE-2026-1"]})
    with pytest.raises(BadInput, match="not a CVE"):
        add_aliases(classes, {"SBP-2026-0001": ["CVE-26"]})


def test_run_checks_vuln_alias_before_anything_runs(capsys):
    code = cli.main(["run", "sglang==0.5.19", "--vuln-alias", "SBP-2026-0009=CVE-2026-12345", "--json"])
    assert (
        code == 2
        and "no vulnerability class 'SBP-2026-0009'"
        in json.loads(capsys.readouterr().out)["error"]["message"]
    )
    code = cli.main(["run", "sglang==0.5.19", "--vuln-alias", "SBP-2026-0001", "--json"])
    assert code == 2 and "expected CLASS=ID" in capsys.readouterr().out


# ---- status from the cases -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, status",
    [
        (
            [
                _row("page_lifetime", "a", "unsafe", "safe"),
                _row("page_lifetime", "b", "safe", "safe", must_preserve=True),
            ],
            "fixed",
        ),
        (
            [
                _row("page_lifetime", "a", "not-applicable", "safe"),
                _row("prefill_drain", "b", "safe", "safe"),
            ],
            "fixed",
        ),
        # 0.5.16: the pack carries no page-lifetime backport; the failed transfer still frees pages at once
        (
            [
                _row("page_lifetime", "a", "unsafe", "unsafe"),
                _row("page_lifetime", "b", "not-applicable", "not-applicable"),
            ],
            "affected",
        ),
        (
            [_row("page_lifetime", "a", "unsafe", "safe"), _row("prefill_drain", "b", "safe", "error")],
            "under_investigation",
        ),
        (
            [
                _row("page_lifetime", "a", "unsafe", "safe"),
                _row("page_lifetime", "b", "safe", "unsafe", must_preserve=True),
            ],
            "under_investigation",
        ),
        ([_row("page_lifetime", "a", "not-applicable", "not-applicable")], "under_investigation"),
        ([_row("admission", "a", "unsafe", "unsafe")], "under_investigation"),  # another class's case only
    ],
)
def test_class_status_follows_from_the_cases(classes, rows, status):
    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    assert class_status(page, rows).status == status


def test_an_unsafe_case_shows_the_exposure_whatever_else_errored(classes):
    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    status = class_status(
        page, [_row("page_lifetime", "a", "unsafe", "unsafe"), _row("prefill_drain", "b", "safe", "error")]
    )
    assert status.status == "affected" and "1 case(s) could not be judged" in status.notes


def _live(patched: str) -> dict:
    return {"scenarios": [
        {"scenario": "aborted_transfer_pages_not_reused", "must_preserve": False,
         "verdicts": {"pristine": "unsafe", "patched": patched, "reference": "safe"}, "pair": "fixed"},
        {"scenario": "over_pool_prompt_rejected", "must_preserve": False,
         "verdicts": {"pristine": "safe", "patched": "unsafe"}, "pair": "regressed"}]}


def test_every_live_scenario_a_class_names_exists(classes):
    """A misspelt name would never be cited: each is a registered 1P1D scenario or the 2P1D race."""
    from backport.live import race
    from backport.live.scenarios import REGISTRY

    known = {s.name for s in REGISTRY} | {race.NAME}
    named = [name for c in classes for name in (c.live or [])]
    assert named and set(named) <= known, set(named) - known


def test_the_live_race_is_cited_and_an_unsafe_one_is_an_exposure(classes):
    """The page-lifetime class names its live scenario: cited where it ran, affected when the patched
    deployment was unsafe though every probe case was fixed; another class's scenario counts not here."""
    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    rows = [_row("page_lifetime", "a", "unsafe", "safe")]
    assert class_status(page, rows).status == "fixed"
    cited = class_status(page, rows, live=_live("safe"))
    assert (
        cited.status == "fixed"
        and "aborted_transfer_pages_not_reused pristine unsafe, patched safe" in cited.notes
    )
    exposed = class_status(page, rows, live=_live("unsafe"))
    assert exposed.status == "affected" and exposed.unsafe == ("live/aborted_transfer_pages_not_reused",)


def test_live_notes_do_not_depend_on_the_order_the_receipt_keeps_verdicts_in(classes):
    """`run` builds the notes from verdicts in pristine, patched, reference order; the receipt is
    written with sorted keys and `verify` rebuilds them from it: a live bundle of format 4 once failed
    its own verify on that order alone."""
    import json

    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    rows = [_row("page_lifetime", "a", "unsafe", "safe")]
    written = class_status(page, rows, live=_live("safe")).notes
    read_back = class_status(page, rows, live=json.loads(json.dumps(_live("safe"), sort_keys=True))).notes
    assert written == read_back and "pristine unsafe, patched safe, reference safe" in written


def _race_document(verdict: str, *, timeout: bool = False) -> LiveResult:
    """One tree's live result with the race's row as run_race writes it: three valid trials, both
    controls safe."""
    from backport.live.race import TOPOLOGY

    unsafe = verdict == "unsafe"
    trials = [{"b_matches_reference": not unsafe, "b_wait_seconds": 20.0} for _ in range(3)]
    row = ScenarioResult(
        scenario="aborted_transfer_pages_not_reused", must_preserve=False, expect="",
        verdict=TreeVerdict(verdict), observed="",
        details={"topology": TOPOLOGY, "trials": trials, "released_through_timeout": timeout,
                 "controls": {"b_alone": {"b_matches_reference": True},
                              "held_back": {"b_matches_reference": True}}})
    return LiveResult(tree="t", version="0.5.10", startup_seconds=0.0, server={}, scenarios=(row,))


def test_a_live_race_unsafe_where_the_pack_claims_nothing_keeps_the_class_open(classes):
    """0.5.10 - 0.5.12.post1: no page-lifetime chain, so the race is unsafe on pristine and patched;
    the run fails on it (still-unsafe), the class stays affected and the VEX cites the live run."""
    from backport.evidence import live as live_evidence

    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    section = live_evidence.section({"pristine": _race_document("unsafe"),
                                     "patched": _race_document("unsafe")})
    row = section["scenarios"][0]
    assert row["pair"] == "still-unsafe" and row["runs"]["patched"]["trials"]["unsafe"] == 3
    folded = live_evidence.fold_summary({"result": "pass"}, section)
    assert folded["result"] == "fail" and folded["live"]["findings"][0]["pair"] == "still-unsafe"
    rows = [_row("page_lifetime", "a", "unsafe", "unsafe")]  # the probes: the engine applied no chain
    status = class_status(page, rows, live=section)
    cited = "aborted_transfer_pages_not_reused pristine unsafe, patched unsafe"
    assert status.status == "affected" and cited in status.notes
    # probes that could not judge do not hide the live exposure either
    unjudged = class_status(page, [_row("page_lifetime", "a", "unsafe", "error")], live=section)
    assert unjudged.status == "affected" and unjudged.unsafe == ("live/aborted_transfer_pages_not_reused",)


def test_a_race_safe_only_through_the_timeout_is_not_cited_as_a_drain_ack(classes):
    """Pristine 0.5.19 with SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1: safe, but decode's
    timeout released A's pages; the predicate carries it and the class's notes say so."""
    from backport.evidence import live as live_evidence

    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    section = live_evidence.section({"pristine": _race_document("unsafe"),
                                     "patched": _race_document("safe", timeout=True)})
    assert section["scenarios"][0]["runs"]["patched"]["released_through_timeout"] is True
    status = class_status(page, [_row("page_lifetime", "a", "unsafe", "safe")], live=section)
    assert "patched safe (through decode's deferred-release timeout, not a drain ACK)" in status.notes
    assert "pristine unsafe (through" not in status.notes
    report = "\n".join(live_evidence.render({"live": section}))
    assert "| patched | 3 (3) | 0 | b_alone safe, held_back safe | yes |" in report


def test_an_exposure_run_speaks_for_the_pristine_tree(classes):
    """No patched tree (the pack cannot serve the release): the pristine tree is the product, its own head."""
    from backport.engine.report import ApplyReport
    from backport.evidence.scope import exposure_line
    from backport.evidence.verdicts import case_rows

    docs = {
        "pristine": {
            "cases": [
                {"probe": "page_lifetime", "case": "a", "verdict": "unsafe"},
                {"probe": "page_lifetime", "case": "b", "verdict": "safe", "must_preserve": True},
            ]
        }
    }
    rows = case_rows(docs)
    assert [r["pair"] for r in rows] == ["still-unsafe", "held"]
    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    status = class_status(page, rows)
    assert (
        status.status == "affected" and status.tree == "pristine" and "on the pristine tree" in status.notes
    )
    apply = {"status": "failed", "patches": [{"fix": "pr36988", "variant": None, "status": "failed"},
                                             {"fix": "pr38935", "variant": "v.patch", "status": "failed",
                                              "reason": "missing dependency: pr36988"}]}
    line = exposure_line("0.5.9", ApplyReport.from_json(apply))
    assert line.startswith("sglang 0.5.9 stays exposed: ") and "no variant of pr36988" in line
    assert "None" not in line and "pr38935 depend(s) on it" in line
    # read back from a receipt: the same line; a report outside the vocabulary is a finding, not a traceback
    from backport.errors import Finding
    from backport.evidence.scope import receipt_apply

    assert exposure_line("0.5.9", receipt_apply({"apply": apply})) == line
    assert receipt_apply({"apply": None}) is None
    with pytest.raises(Finding, match="apply report does not read as one"):
        receipt_apply({"apply": {**apply, "status": "half-applied"}})


def test_an_exposed_release_gets_an_action_statement(tmp_path, classes):
    apply_report = {
        "patches": [{"fix": "pr35049", "status": "not-applicable", "reason": "0.5.12 is outside scope"}]
    }
    rows = [_row("page_lifetime", "failed_transfer_holds_pages_until_drain", "unsafe", "unsafe")]
    page = next(c for c in classes if c.name == "page-lifetime-release-race")
    from backport.evidence.vulnerabilities import action_statement

    text = action_statement(page, class_status(page, rows), "0.5.12", apply_report)
    assert "sglang 0.5.12 stays exposed" in text and "no backport of pr35049" in text
    assert "sglang 0.5.13 or later" in text and "upstream sglang 0.5.22" in text


FLUSH_CASE = "flush_during_deferred_hold_frees_nothing_twice"


@pytest.mark.parametrize("pr35049, status", [
    ({"status": "not-applicable", "reason": "no backport for sglang 0.5.9: the pack carries it for >=0.5.17"},
     "not_affected"),
    ({"status": "failed", "variant": None, "reason": "no variant applies"}, "not_affected"),
    ({"status": "applied", "reason": ""}, "under_investigation"),  # the code is there: a case must run
    ({"status": "not-applicable", "reason": "0.5.19 is in fixed_in >=0.5.19"}, "under_investigation"),
    (None, "under_investigation"),  # the apply report does not say: nothing is known absent
    # the engine's cause decides, not its prose
    ({"status": "not-applicable", "cause": "shipped", "reason": "renamed"}, "under_investigation"),
    ({"status": "not-applicable", "cause": "out-of-scope", "reason": "renamed: fixed_in"}, "not_affected"),
])
def test_a_class_whose_code_is_absent_is_not_affected(classes, pr35049, status):
    """SBP-2026-0003 is `introduced_with` #35049's code: where the tree has none, no case can run
    and the vulnerable code is not present; anywhere else a case that did not run proves nothing."""
    flush = next(c for c in classes if c.name == "flush-during-deferred-hold")
    assert flush.introduced_with == "pr35049"
    apply = {"patches": [] if pr35049 is None else [{"fix": "pr35049", **pr35049}]}
    got = class_status(flush, [_row("flush_holds", FLUSH_CASE, "not-applicable", "not-applicable")], apply)
    assert got.status == status, got
    if status == "not_affected":
        assert "vulnerable code not present" in got.notes and "no pr35049 code" in got.notes
    ran = class_status(flush, [_row("flush_holds", FLUSH_CASE, "unsafe", "unsafe")], apply)
    assert ran.status == "affected"  # a case that ran decides, whatever the apply report says


def test_not_affected_is_valid_openvex_and_cyclonedx(bundle, classes):
    receipt = attached_from(bundle, _receipt(bundle))  # the apply report read back into the receipt
    receipt["predicate"]["apply"]["patches"].append(
        {
            "fix": "pr35049",
            "status": "not-applicable",
            "reason": "no backport for sglang 0.5.16",
            "variant": None,
        }
    )
    standards = json.loads((bundle / "standards.json").read_text())
    document = vex.build_vex(receipt, standards)
    assert vex.schema_errors(document) is None
    [flush] = [s for s in document["statements"] if s["vulnerability"]["name"] == "SBP-2026-0003"]
    assert flush["status"] == "not_affected" and flush["justification"] == "vulnerable_code_not_present"
    bom = cyclonedx.build_bytes(receipt, standards)
    assert cyclonedx.validation_error(bom) is None
    [analysis] = [v["analysis"] for v in json.loads(bom)["vulnerabilities"] if v["id"] == "SBP-2026-0003"]
    assert analysis["state"] == "not_affected" and analysis["justification"] == "code_not_present"


def test_introduced_with_must_name_a_fix(tmp_path):
    text = (resources.pack_dir() / "vulnerabilities.toml").read_text()
    (tmp_path / "vulnerabilities.toml").write_text(text.replace('introduced_with = "pr35049"',
                                                                'introduced_with = "pr99999"'))
    fixes = list(load_pack(resources.pack_dir()).fixes)
    with pytest.raises(BadInput, match=r"introduced_with 'pr99999' is not in fixes.toml"):
        load_classes(tmp_path, fixes)


# ---- the documents in a bundle -------------------------------------------------------------------


def test_a_bundle_holds_valid_openvex_and_cyclonedx(bundle):
    assert {"standards.json", "vex.openvex.json", "sbom.cdx.json"} <= set(_files(bundle))
    receipt = _receipt(bundle)
    assert {"standards.json", "vex.openvex.json", "sbom.cdx.json"} <= set(receipt["predicate"]["files"])
    sums = (bundle / "SHA256SUMS").read_text()
    assert "  vex.openvex.json\n" in sums and "  sbom.cdx.json\n" in sums
    document = json.loads((bundle / "vex.openvex.json").read_text())
    assert vex.schema_errors(document) is None
    assert document["@context"] == "https://openvex.dev/ns/v0.2.0"
    # the pack's date (the newest Last-Update of the classes' patches), not the run's: same inputs, same bytes
    standards = json.loads((bundle / "standards.json").read_text())
    assert document["timestamp"] == max(c["last_update"] for c in standards["classes"]) + "T00:00:00+00:00"
    assert document["timestamp"] != receipt["predicate"]["timestamps"]["started"]
    statuses = {s["vulnerability"]["name"]: s["status"] for s in document["statements"]}
    # the fixture's admission cases are fixed or held; its one page-lifetime case ran on no tree, and
    # no case of any other class is in it: one statement per class of the pack
    class_ids = {c.id for c in load_classes(resources.pack_dir())}
    assert statuses == {i: "under_investigation" for i in class_ids} | {"SBP-2026-0001": "fixed"}
    tree = receipt["predicate"]["inputs"]["trees"]["patched"]["tree_digest"]
    references = {c.id: c.references for c in load_classes(resources.pack_dir())}
    for statement in document["statements"]:
        # no export: the patched tree is the only product, and no purl speaks for upstream's build
        assert statement["products"] == [{"@id": f"urn:sglang-backport:tree:dirHash1:{tree}"}]
        # the notes cite the class's references (an upstream issue or pull request)
        assert all(r in statement["status_notes"] for r in references[statement["vulnerability"]["name"]])
    sbom = (bundle / "sbom.cdx.json").read_bytes()
    assert cyclonedx.validation_error(sbom) is None
    bom = json.loads(sbom)
    assert bom["specVersion"] == "1.6"
    component = bom["metadata"]["component"]
    assert component["pedigree"]["ancestors"][0]["purl"] == "pkg:pypi/sglang@0.5.19"
    assert {p["type"] for p in component["pedigree"]["patches"]} == {"backport"}
    resolved = {i["id"] for p in component["pedigree"]["patches"] for i in p["resolves"]}
    assert resolved == {"pr36988", "pr38935", "SBP-2026-0001"}
    states = {v["id"]: v["analysis"]["state"] for v in bom["vulnerabilities"]}
    assert states == {i: "in_triage" for i in class_ids} | {"SBP-2026-0001": "resolved_with_pedigree"}
    assert evidence.verify(bundle).ok


def test_the_documents_are_a_function_of_the_inputs(tmp_path, classes):
    one = vex_run(tmp_path / "a", classes)
    two = vex_run(tmp_path / "b", classes)
    for name in ("standards.json", "vex.openvex.json", "sbom.cdx.json"):
        assert one.files[name] == two.files[name], name


def test_a_status_the_cases_do_not_support_is_named(bundle):
    """Someone turns the page-lifetime statement into `fixed` and reseals every digest."""
    from tests.test_evidence import _reseal

    path = bundle / "vex.openvex.json"
    document = json.loads(path.read_text())
    document["statements"][1]["status"] = "fixed"
    path.write_bytes(evidence.canonical_json(document))
    receipt = _receipt(bundle)
    receipt["predicate"]["files"]["vex.openvex.json"] = evidence.sha256_file(path)
    _reseal(bundle, receipt)
    result = evidence.verify(bundle)
    assert (not result.ok and "vex.openvex.json" in {p.file for p in result.problems} | {result.first.file}) \
        or "vex.openvex.json" in result.first.detail


def test_an_edited_standards_file_is_named(bundle):
    from tests.test_evidence import _reseal

    path = bundle / "standards.json"
    standards = json.loads(path.read_text())
    standards["classes"][1]["probes"] = ["admission"]  # claim the admission cases prove page lifetime
    path.write_bytes(evidence.canonical_json(standards))
    receipt = _receipt(bundle)
    receipt["predicate"]["files"]["standards.json"] = evidence.sha256_file(path)
    _reseal(bundle, receipt)
    result = evidence.verify(bundle)
    assert not result.ok


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(status="affected"), "action_statement"),
    (lambda s: s.update(status="not_affected"), "status rule .*justification"),
    (lambda s: s.update(status="not_affected", justification="vulnerable_code_not_present"), None),
    (lambda s: s.update(status="not_affected", justification="it is fine"), "is not one of"),
    (lambda s: s.update(action_statement="upgrade"), "status rule"),
    (lambda s: s.update(status="patched"), "is not one of"),
    (lambda s: s.pop("products"), "products"),
    (lambda s: s["vulnerability"].pop("name"), "name"),
    (lambda s: s["products"][0].update(hashes={"sha256": "ab"}), "sha256"),
])
def test_the_schema_holds_the_specs_status_rules(bundle, edit, message):
    document = json.loads((bundle / "vex.openvex.json").read_text())
    broken = copy.deepcopy(document)
    edit(broken["statements"][0])
    error = vex.schema_errors(broken)
    if message is None:
        assert error is None
    else:
        assert error is not None and re.search(message, error), error
    assert vex.schema_errors({**document, "@context": "https://openvex.dev/ns/v0.1.0"}) is not None
    assert vex.schema_errors({k: v for k, v in document.items() if k != "timestamp"}) is not None


@pytest.mark.parametrize(
    "edit, said",
    [
        (
            lambda d: d["statements"][0]["products"][0].update({"@id": "pkg:pypi/sglang@0.5.19"}),
            "a product changed",
        ),
        (lambda d: d["statements"][1].update(status="fixed"), "a status changed"),
    ],
)
def test_a_vex_tamper_is_named_by_what_changed(bundle, edit, said):
    """A product swapped for another (and every digest resealed) is reported as a product change,
    not as wrong statuses; a status changed is reported as such."""
    from tests.test_evidence import _reseal

    path = bundle / "vex.openvex.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_bytes(evidence.canonical_json(document))
    receipt = _receipt(bundle)
    receipt["predicate"]["files"]["vex.openvex.json"] = evidence.sha256_file(path)
    _reseal(bundle, receipt)
    result = evidence.verify(bundle)
    vex_problems = [p for p in result.problems if p.file == "vex.openvex.json"]
    assert vex_problems and said in vex_problems[0].detail, result.problems
    assert ("status" in vex_problems[0].detail) == (said == "a status changed")


def test_two_runs_of_the_same_inputs_differ_only_in_the_timestamps_field(tmp_path, classes, keys):  # noqa: F811
    """Every file of two bundles of the same inputs (run at other times, from other paths, with
    other import times) is byte-identical but receipt.json, which differs only in
    predicate.timestamps, and SHA256SUMS, which lists it; the VEX documents speak as of the pack's
    date, not the run's. Folders and files are readable by the group as the umask allows."""
    import os
    import stat

    from backport.evidence import sign

    old = os.umask(0o022)
    try:
        one = evidence.write_bundle(
            tmp_path / "a",
            vex_run(tmp_path / "r1", classes, started="2026-01-01T00:00:00+00:00", import_seconds=8.1),
        )
        two = evidence.write_bundle(
            tmp_path / "b",
            vex_run(tmp_path / "run2", classes, started="2026-03-04T05:06:07+00:00", import_seconds=12.7),
        )
        assert _files(one) == _files(two) and {"vex.openvex.json", "sbom.cdx.json"} <= set(_files(one))
        assert [n for n in _files(one) if (one / n).read_bytes() != (two / n).read_bytes()] == ["SHA256SUMS",
                                                                                              "receipt.json"]
        r1, r2 = (json.loads((b / "receipt.json").read_bytes()) for b in (one, two))
        assert r1["predicate"].pop("timestamps") != r2["predicate"].pop("timestamps") and r1 == r2
        issued = json.loads((one / "vex.openvex.json").read_bytes())["timestamp"]
        assert issued == max(c.last_update for c in classes) + "T00:00:00+00:00"
        assert json.loads((one / "sbom.cdx.json").read_bytes())["metadata"]["timestamp"] == issued
        sign.sign_bundle(one, keys[0])
        assert cli.main(["merge", str(one), "--out", str(tmp_path / "merged")]) == 0
        for top in (one, tmp_path / "merged"):
            for path in [top, *top.rglob("*")]:
                mode = stat.S_IMODE(path.stat().st_mode)
                assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
    finally:
        os.umask(old)
