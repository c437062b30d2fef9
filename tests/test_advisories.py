"""What else is open on a release (patches/advisories.toml, backport/advisories.py).

Fast tests: OSV range evaluation with `packaging` versions, the loader's refusals, the conditions
on /server_info-shaped documents, the audit's JSON rows against a stdlib HTTP server on 127.0.0.1,
and REPORT.md's section. The slow tests hold every range to the real release trees: for each
release a part names in `checked_on`, "in range" must equal "the tree check holds", so a wrong
range or a wrong rule fails here; and the field names the conditions read must be those of a
real `/server_info` document built by the tree's own code.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from packaging.version import Version

from backport import advisories, evidence
from backport.advisories import EXPOSED_IF, NOT_APPLICABLE, OPEN, UNKNOWN, Part, Rule
from backport.audit.advisories import parse_launch_flags
from backport.audit.advisories import rows as audit_rows
from backport.errors import BadInput
from backport.pack import load_pack
from tests.test_audit import build_server_info, code_facts, run_cli, serve, server_doc

REPO = Path(__file__).resolve().parent.parent
PACK = load_pack(REPO / "patches")
KNOWN = advisories.load(REPO / "patches")
BY_ID = {a.id: a for a in KNOWN}
SHADOWMQ, LOGITS, BOOTSTRAP, LORA = "CVE-2026-3059", "CVE-2026-7304", "sgl-project/sglang#39400", \
    "sgl-project/sglang#26789"
CHECKED = sorted({v for a in KNOWN for p in a.parts for v in p.checked_on},
                 key=Version)


def part(events, exceptions=()):
    return Part("p", tuple(events), tuple(exceptions), (Rule("f", "x"),), ())


# ---- ranges ------------------------------------------------------------------------------------


def test_introduced_fixed_is_half_open_and_post_releases_sort_before_the_fix():
    p = part([("introduced", "0.5.7"), ("fixed", "0.5.13")])
    assert [p.in_range(v) for v in ("0.5.6", "0.5.7", "0.5.12.post1", "0.5.13", "0.5.23")] == \
        [False, True, True, False, False]


def test_introduced_zero_last_affected_and_exceptions():
    p = part([("introduced", "0"), ("last_affected", "0.5.10")], [("0.5.9", False, "backported")])
    assert p.in_range("0.4.5.post1") and p.in_range("0.5.10") and not p.in_range("0.5.10.post1")
    assert not p.in_range("0.5.9")   # the exception, whatever the rule says


def test_a_labelled_backport_build_is_its_release():
    p = part([("introduced", "0.5.8"), ("fixed", "0.5.22")])
    assert p.in_range("0.5.19+backport.3") and not p.in_range("0.5.22+backport.1")


def test_reintroduced_after_a_fix():
    p = part([("introduced", "0.5.1"), ("fixed", "0.5.3"), ("introduced", "0.5.5")])
    assert [p.in_range(v) for v in ("0.5.2", "0.5.4", "0.5.5", "0.5.9")] == [True, False, True, True]


def test_shipped_file_states_what_the_trees_showed():
    assert set(BY_ID) == {BOOTSTRAP, LORA, LOGITS, SHADOWMQ}
    assert BY_ID[SHADOWMQ].aliases == ("CVE-2026-3060", "CVE-2026-3989")
    # every release up to the newest pinned one lacks #39400's fix and CVE-2026-7304's
    assert all(p.in_range("0.5.23") for p in BY_ID[BOOTSTRAP].parts + BY_ID[LOGITS].parts)
    assert [p.in_range(v) for p in BY_ID[LORA].parts for v in ("0.5.7", "0.5.17", "0.5.21", "0.5.22")] == \
        [False, True, True, False]
    # the pack's own fix for #39400 (sbp-bootstrap-auth) is its class SBP-2026-0005
    assert BY_ID[BOOTSTRAP].pack_class == "SBP-2026-0005"


ENTRY = """[[advisory]]
id = "x"
aliases = []
title = "t"
references = ["https://a"]
affects = { package = "sglang", component = "c" }
pack = "none"
exposed_when = { release = true, why = "w" }
[[advisory.part]]
name = "n"
events = [{ introduced = "0" }]
exceptions = []
affected_when = [{ file = "f", pattern = "p" }]
checked_on = []
"""


@pytest.mark.parametrize("old, new, message", [
    ('aliases = []\n', "", "needs exactly the keys"),
    ('pack = "none"', 'pack = "SBP-2026-0999"', "not a class of vulnerabilities.toml"),
    ("{ release = true, why = \"w\" }", '{ flag = "enable_custom_logit_processor" }', "exposed_when is"),
    ('{ introduced = "0" }', '{ fixed = "soon" }', "not a version"),
    ('pattern = "p"', 'pattern = "("', "pattern"),
])
def test_loader_refuses_a_malformed_entry(tmp_path, old, new, message):
    (tmp_path / "advisories.toml").write_text(ENTRY)
    assert advisories.load(tmp_path, ["SBP-2026-0001"])[0].id == "x"
    assert old in ENTRY
    (tmp_path / "advisories.toml").write_text(ENTRY.replace(old, new))
    with pytest.raises(BadInput, match=message):
        advisories.load(tmp_path, ["SBP-2026-0001"])


# ---- conditions on server documents ------------------------------------------------------------


def settings(**kw):
    return advisories.settings_of(server_doc(**kw))


def test_custom_logit_processor_flag():
    adv = BY_ID[LOGITS]
    assert advisories.condition(adv, settings(enable_custom_logit_processor=True)) == \
        (OPEN, "--enable-custom-logit-processor set")
    assert advisories.condition(adv, settings(enable_custom_logit_processor=False))[0] == NOT_APPLICABLE
    assert advisories.condition(adv, settings())[0] == UNKNOWN          # an older document without the field
    assert advisories.condition(adv, None)[0] == EXPOSED_IF


@pytest.mark.parametrize("doc, status, words", [
    ({"host": "0.0.0.0", "disaggregation_bootstrap_port": 8998}, OPEN, "beyond loopback (0.0.0.0:8998)"),
    ({"host": "10.0.0.7", "disaggregation_bootstrap_port": 8998}, OPEN, "no token"),
    ({"host": "127.0.0.1", "disaggregation_bootstrap_port": 8998}, NOT_APPLICABLE, "loopback"),
    ({"host": "::1"}, NOT_APPLICABLE, "loopback"),
    ({"host": "0.0.0.0", "mode": "decode"}, NOT_APPLICABLE, "decode server runs no bootstrap"),
    ({"host": "0.0.0.0", "mode": "decode", "enable_pd_role_switch": True}, OPEN, "beyond loopback"),
    ({"host": "0.0.0.0", "disaggregation_transfer_backend": "fake"}, NOT_APPLICABLE, "fake has no bootstrap"),
    ({}, UNKNOWN, "host not reported"),
])
def test_bootstrap_listener(doc, status, words):
    got = advisories.condition(BY_ID[BOOTSTRAP], settings(**doc))
    assert got[0] == status and words in got[1]


def test_admin_key_is_kept_as_configured_only():
    s = settings(admin_api_key="s3cret")
    assert s["admin_api_key"] is True and "s3cret" not in json.dumps(s)
    assert advisories.condition(BY_ID[LORA], s)[0] == OPEN
    assert advisories.condition(BY_ID[LORA], settings(admin_api_key=None))[0] == NOT_APPLICABLE


def test_launch_flags_are_read_as_server_arguments():
    s = parse_launch_flags("--disaggregation-mode prefill --host=0.0.0.0 --enable-custom-logit-processor")
    assert s["enable_custom_logit_processor"] is True
    assert s["host"] == "0.0.0.0"
    assert s["admin_api_key"] is False
    plain = parse_launch_flags("--model-path m")
    assert plain["host"] == "127.0.0.1"   # launch_server's default
    no_bootstrap = (NOT_APPLICABLE, "a non-PD server runs no bootstrap server")
    assert advisories.condition(BY_ID[BOOTSTRAP], plain) == no_bootstrap
    with pytest.raises(BadInput, match="not a --flag"):
        parse_launch_flags("prefill")


def test_rows_by_release_when_no_tree_is_given():
    shadow = advisories.row(BY_ID[SHADOWMQ], "s", version="0.5.12.post1", settings={})
    assert shadow.status == OPEN
    assert "release below the ShadowMQ fix" in shadow.reason
    assert "EPD encoder" in shadow.reason
    assert advisories.row(BY_ID[SHADOWMQ], "s", version="0.5.13", settings={}).status == NOT_APPLICABLE
    assert advisories.row(BY_ID[LORA], "s", version=None, settings={}).status == UNKNOWN


def test_a_linked_pack_class_in_the_tree_is_fixed_by_the_pack(tmp_path):
    adv = advisories.Advisory(
        "x", (), "t", ("https://a",), "c", "SBP-2026-0003", {"release": True, "why": "w"}, BY_ID[LOGITS].parts
    )
    got = advisories.row(adv, "patched", version="0.5.19", root=tmp_path,
                         pack_fixed=lambda c: c == "SBP-2026-0003")
    assert got.status == advisories.FIXED_BY_PACK and "SBP-2026-0003" in got.reason


def test_a_pack_without_advisories_or_classes_has_no_table(tmp_path):
    from types import SimpleNamespace

    trees = {"pristine": (tmp_path, "0.5.19")}
    assert advisories.bundle_section(SimpleNamespace(root=tmp_path), trees) is None
    (tmp_path / "advisories.toml").write_text(ENTRY)      # no vulnerabilities.toml: no class to link
    section = advisories.bundle_section(SimpleNamespace(root=tmp_path, fixes={}), trees)
    assert [r["status"] for r in section["pristine"]] == [NOT_APPLICABLE]   # the tree lacks file f


# ---- the audit ---------------------------------------------------------------------------------


def test_audit_json_names_the_open_advisories_per_server(capsys):
    prefill = server_doc(
        host="0.0.0.0",
        disaggregation_bootstrap_port=8998,
        enable_custom_logit_processor=True,
        admin_api_key=None,
    )
    decode = server_doc(mode="decode", host="0.0.0.0", enable_custom_logit_processor=False, admin_api_key="k")
    with serve({"/server_info": prefill}) as p, serve({"/server_info": decode}) as d:
        code, doc = run_cli(["--server", p, "--server", d, "--allow-unknown"], capsys)
    rows = {(r["advisory"], r["subject"].split()[0]): r for r in doc["advisories"]}
    assert rows[(LOGITS, "prefill")]["status"] == OPEN
    assert rows[(LOGITS, "prefill")]["reason"].startswith("--enable-custom-logit-processor set")
    assert rows[(LOGITS, "decode")]["status"] == NOT_APPLICABLE
    assert rows[(BOOTSTRAP, "prefill")]["status"] == OPEN
    assert rows[(BOOTSTRAP, "decode")]["status"] == NOT_APPLICABLE
    assert rows[(LORA, "decode")]["status"] == OPEN                  # 0.5.19 with an admin key
    assert rows[(SHADOWMQ, "prefill")]["status"] == NOT_APPLICABLE   # 0.5.19 has both parts of the fix
    assert "k" not in {str(v) for r in doc["advisories"] for v in r.values()}
    # information, not a gate: the same servers without the flag leave the exit code where it was
    with serve({"/server_info": server_doc(enable_custom_logit_processor=False)}) as p2, \
            serve({"/server_info": decode}) as d2:
        code2, _ = run_cli(["--server", p2, "--server", d2, "--allow-unknown"], capsys)
    assert code == code2


def test_audit_report_and_terminal_carry_the_table(capsys, tmp_path):
    from backport.cli import main

    with serve({"/server_info": server_doc(enable_custom_logit_processor=True, host="127.0.0.1")}) as p:
        main(["audit", "--server", p, "--report", str(tmp_path / "r.md"), "--allow-unknown"])
    out = capsys.readouterr().out
    assert f"open: {LOGITS} on prefill {p}: --enable-custom-logit-processor set" in out
    report = (tmp_path / "r.md").read_text()
    assert "## What else is open on this release" in report and f"| {LOGITS}: " in report


def test_audit_of_bad_launch_flags_is_bad_input(capsys):
    from backport.cli import main

    assert main(["audit", "--server", "http://127.0.0.1:9", "--launch-flags", "'unclosed"]) == 2


@pytest.mark.network
def test_audit_rows_of_a_tree_with_the_flag(release_tree):
    """The tree audit: the code decides which advisories it has, the launch flags the condition."""
    root = release_tree("0.5.19").package_root
    facts = code_facts("0.5.19")
    code = type(facts)(**{**facts.__dict__, "package_root": root})
    flags = parse_launch_flags("--disaggregation-mode prefill --enable-custom-logit-processor")
    got = {r.advisory: r for r in audit_rows(PACK, code, (), flags)}
    assert got[LOGITS].status == OPEN and got[LOGITS].reason.startswith("--enable-custom-logit-processor set")
    assert "this tree's code has: dill.loads" in got[LOGITS].reason
    assert got[BOOTSTRAP].status == NOT_APPLICABLE and "loopback" in got[BOOTSTRAP].reason
    unflagged = {r.advisory: r for r in audit_rows(PACK, code, ())}
    assert unflagged[LOGITS].status == EXPOSED_IF


# ---- the trees ---------------------------------------------------------------------------------


@pytest.mark.network
@pytest.mark.parametrize("version", CHECKED)
def test_every_range_agrees_with_the_tree_check(version, release_tree):
    root = release_tree(version).package_root
    for adv in KNOWN:
        for p in adv.parts:
            assert p.in_range(version) == p.tree_affected(root), (
                f"{adv.id} / {p.name}: on {version} the range says {p.in_range(version)}, the tree check "
                f"({'; '.join(r.describe() for r in p.affected_when)}) says {p.tree_affected(root)}")


@pytest.mark.network
def test_report_md_section_from_real_trees(tmp_path, monkeypatch, release_tree):
    from tests import test_evidence

    root19 = release_tree("0.5.19").package_root
    section = advisories.bundle_section(PACK, {"pristine": (root19, "0.5.19"), "patched": (root19, "0.5.19"),
                                               "reference": (release_tree("0.5.22").package_root, "0.5.22")})
    bundle = evidence.write_bundle(tmp_path / "bundle",
                                   test_evidence.fixture_run(tmp_path / "run", advisories=section))
    statement = json.loads((bundle / "receipt.json").read_text())
    jsonschema.Draft202012Validator(test_evidence.SCHEMA).validate(statement)
    report = (bundle / "REPORT.md").read_text()
    assert "## What else is open on this release" in report
    lora_row = f"| {LORA}: /load_lora_adapter_from_tensors lacks the admin auth decorator"
    assert f"{lora_row} | pristine | exposed-if |" in report
    assert (
        f"{lora_row} | reference | not-applicable |"
        in report
    )
    assert f"| {SHADOWMQ} (CVE-2026-3060, CVE-2026-3989): " in report
    # the trees in the run's order, though the receipt's canonical JSON sorts its keys
    table = report.split("## What else is open on this release")[1].split("## Summary")[0]
    assert table.index("| pristine |") < table.index("| patched |") < table.index("| reference |")
    assert evidence.verify(bundle).ok, evidence.verify(bundle).problems


@pytest.mark.probe_env
@pytest.mark.network
def test_conditions_read_real_server_info_fields(probe_python, release_tree):
    """The field names the conditions read are those of a /server_info built by 0.5.19's own code."""
    prefill, decode = build_server_info(probe_python, release_tree("0.5.19").package_root,
                                        "prefill:681280", "decode:681280")
    s = advisories.settings_of(prefill)
    assert set(advisories.SETTINGS) - {"enable_pd_role_switch"} <= set(s)
    unset = (NOT_APPLICABLE, "--enable-custom-logit-processor not set")
    assert advisories.condition(BY_ID[LOGITS], s) == unset
    assert advisories.condition(BY_ID[BOOTSTRAP], s)[0] == NOT_APPLICABLE          # launch_server's 127.0.0.1
    assert advisories.condition(BY_ID[BOOTSTRAP], advisories.settings_of(decode))[0] == NOT_APPLICABLE
