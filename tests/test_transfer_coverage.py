"""The pack's own fix `sbp-transfer-coverage` (a vendor fix, design reference #38704):
its pack metadata, the loader's vendor rules, its commits, its probes, and on real
releases that it alone turns the handoff incident safe with every must-preserve case safe."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import git
import pytest
from packaging.version import Version

from backport.engine import apply_series
from backport.engine.write import commit_message
from backport.errors import BadInput
from backport.job.plan import default_reference
from backport.pack import load_pack
from backport.releases import load_pins
from backport.tree import clone_tree
from tests.engine_helpers import FIX_COMMIT, make_fix_table

REPO = Path(__file__).resolve().parent.parent
FIX = "sbp-transfer-coverage"
# every release with the metadata slot the check uses (cached_tokens, 0.5.3 on)
SUPPORTED = tuple(v for v in load_pins() if Version(v) >= Version("0.5.3"))
# below 0.5.13 the variants extend sbp-abort-hold's failure branch (their own Depends-On)
HOLD_RELEASES = tuple(v for v in SUPPORTED if Version(v) < Version("0.5.13"))
NEW_CASES = {
    "short_coverage_refused": False,
    "unpatched_peer_refused": False,
    "tp_ranks_refuse_together": False,
    "full_coverage_committed": True,
    "cached_prefix_committed": True,
    "chunked_prefill_committed": True,
    "rebootstrap_output_tokens_committed": True,
    "retracted_request_committed": True,
    "speculative_transfer_committed": True,
    "tp_ranks_commit_together": True,
    "host_staged_short_coverage_refused": False,
    "host_staged_full_coverage_committed": True,
    "refusal_during_pending_restore_keeps_restore_pages": False,
    "restored_handoff_committed": True,
}


@pytest.fixture(scope="module")
def pack():
    return load_pack(REPO / "patches")


def test_vendor_fix_is_last_in_the_series_and_in_no_release(pack):
    fix = pack.fixes[FIX]
    # after every upstream fix: only the pack's own fixes follow it
    assert all(pack.fixes[f].is_vendor for f in pack.series[pack.series.index(FIX):])
    assert fix.is_vendor and fix.pr is None and fix.url.endswith("/pull/38704")
    pins = load_pins()
    assert not any(fix.is_fixed_in(v) for v in pins)  # no release has it
    assert [v for v in pins if fix.in_scope(v)] == list(SUPPORTED)
    # the reference is the first release with every upstream fix (0.5.23 has them too)
    assert default_reference(pack, pins) == "sglang==0.5.22"


def test_exactly_one_variant_per_supported_release(pack):
    variants = pack.variants[FIX]
    for v in SUPPORTED:
        assert len([pv for pv in variants if pv.applies(v)]) == 1, v
    for pv in variants:
        header = pv.header
        assert header["Origin"].startswith("vendor") and "38704" in header["Origin"]
        notes = header["Backport-Notes"]
        assert "cannot see" in notes and "lands after the check" in notes
        assert "SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK" in header["Description"]


def test_vendor_commit_names_the_fix_and_its_design(pack):
    variant = pack.variants[FIX][0]
    message = commit_message(pack.fixes[FIX], variant)
    assert message.startswith(f"sglang-backport {FIX}: ")
    assert f"Vendor-Fix: {FIX}" in message
    assert "Design-Reference: https://github.com/sgl-project/sglang/pull/38704" in message
    assert "Backport-Of:" not in message and "Upstream-Commit:" not in message
    assert f"Backport-Variant: {variant.name}" in message


def _vendor_pack(
    tmp_path: Path, extra: str = "", origin_line: str = "Origin: vendor, https://example.org/design"
) -> Path:
    root = tmp_path / "pack"
    (root / "v1").mkdir(parents=True)
    (root / "series").write_text("v1\n")
    (root / "fixes.toml").write_text(
        '[fixes.v1]\ntitle = "ours"\norigin = "vendor"\nurl = "https://example.org/design"\nfixed_in = ""\n'
        + extra
    )
    (root / "v1" / "v1-1.patch").write_text(
        f"Description: d\n{origin_line}\nApplies-To: >=0.5.17\nDepends-On: none\n"
        "Last-Update: 2026-12-01\n---\n"
        "diff --git a/sglang/a.py b/sglang/a.py\n--- a/sglang/a.py\n+++ b/sglang/a.py\n"
        "@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    )
    return root


def test_loader_accepts_a_vendor_fix(tmp_path):
    fix = load_pack(_vendor_pack(tmp_path)).fixes["v1"]
    assert fix.is_vendor and fix.pr is None and not fix.is_fixed_in("0.5.22")


@pytest.mark.parametrize("extra, says", [
    ("pr = 5\n", "has no pr"),
    ('upstream_commit = "abcdef1"\n', "has no upstream_commit"),
])
def test_loader_refuses_upstream_fields_on_a_vendor_fix(tmp_path, extra, says):
    with pytest.raises(BadInput, match=says):
        load_pack(_vendor_pack(tmp_path, extra))


def test_loader_refuses_a_vendor_fix_in_a_release(tmp_path):
    root = _vendor_pack(tmp_path)
    toml = root / "fixes.toml"
    toml.write_text(toml.read_text().replace('fixed_in = ""', 'fixed_in = ">=0.5.22"'))
    with pytest.raises(BadInput, match="fixed_in must be empty"):
        load_pack(root)


def test_header_origin_must_agree_with_the_fix(tmp_path):
    with pytest.raises(BadInput, match="Origin says upstream"):
        load_pack(_vendor_pack(tmp_path, origin_line="Origin: upstream, https://example.org/design"))
    root = tmp_path / "up"
    (root / "pr7").mkdir(parents=True)
    (root / "series").write_text("pr7\n")
    (root / "fixes.toml").write_text(make_fix_table("pr7"))
    (root / "pr7" / "pr7.patch").write_text(
        "Description: d\nOrigin: vendor, https://github.com/sgl-project/sglang/pull/7\nApplies-To: >=0.5.17\n"
        "Depends-On: none\nLast-Update: 2026-12-01\n---\n"
        "diff --git a/sglang/a.py b/sglang/a.py\n--- a/sglang/a.py\n+++ b/sglang/a.py\n"
        "@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    )
    assert FIX_COMMIT  # the helper's commit stands in the table
    with pytest.raises(BadInput, match="Origin says vendor"):
        load_pack(root)


def test_probe_module_registers_its_cases_with_the_standard_library_only():
    sources = [p.read_text() for p in sorted((REPO / "probes" / "cases" / "transfer_coverage").glob("*.py"))]
    top = [n for s in sources for n in ast.parse(s).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    # a relative import (`from ...rigs.coverage import ...`) stays inside the probe package
    roots = {("probes" if n.level else (n.module or "").split(".")[0]) if isinstance(n, ast.ImportFrom)
             else a.name.split(".")[0] for n in top for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert roots <= {"__future__", "importlib", "inspect", "threading", "types", "typing", "probes"}, roots
    # the registry reads without torch or sglang (a fresh interpreter of the toolkit)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; from probes import PROBE_NAMES, cases_of; "
                "assert 'transfer_coverage' in PROBE_NAMES; "
                "print(*[f'{c.name}={c.must_preserve}' for c in cases_of('transfer_coverage')]); "
                "assert 'torch' not in sys.modules and 'sglang' not in sys.modules"
            ),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert dict(x.split("=") for x in out) == {k: str(v) for k, v in NEW_CASES.items()}


# ---------------------------------------------------------------------------
# real releases


def _verdicts(doc: dict) -> dict[str, str]:
    assert "error" not in doc, doc.get("error")
    return {f"{c['probe']}/{c['case']}": c["verdict"] for c in doc["cases"]}


@pytest.mark.probe_env
@pytest.mark.network
@pytest.mark.parametrize("version", ["0.5.17", "0.5.19"])
def test_the_fix_alone_refuses_the_incident_handoff(version, release_tree, probe_python, tmp_path, pack):
    from backport.probing import run_harness

    pristine = release_tree(version)
    tree = clone_tree(pristine, tmp_path, tmp_path / "only")
    report = apply_series(tree.path, pack, version, only=[FIX])
    assert [(p.fix, p.status) for p in report.patches] == [(FIX, "applied")]
    head = git.Repo(tree.path).head.commit
    assert f"Vendor-Fix: {FIX}" in head.message
    probes = ["handoff", "transfer_coverage"]
    before = _verdicts(run_harness(probe_python, pristine.path, probes=probes, label="pristine"))
    after_doc = run_harness(probe_python, tree.path, probes=probes, label="only")
    after = _verdicts(after_doc)
    assert before["handoff/oversized_prompt_handoff_not_started"] == "unsafe"
    assert after["handoff/oversized_prompt_handoff_not_started"] == "safe"
    incident = next(c for c in after_doc["cases"] if c["case"] == "oversized_prompt_handoff_not_started")
    assert incident["details"]["decode_refused"] and not incident["details"]["decode_committed"]
    for name in ("short_coverage_refused", "unpatched_peer_refused", "tp_ranks_refuse_together"):
        assert before[f"transfer_coverage/{name}"] == "unsafe"
        assert after[f"transfer_coverage/{name}"] == "safe"
    must = [c for c in after_doc["cases"] if c["must_preserve"]]
    # decode host receive arrived in 0.5.21: its must-preserve case has no code here
    absent = {c["case"] for c in must if c["verdict"] == "not-applicable"}
    assert absent == {"host_staged_full_coverage_committed"}, absent
    assert all(c["verdict"] == "safe" for c in must if c["case"] not in absent), [
        c["case"] for c in must if c["verdict"] != "safe"]
    refused = next(c for c in after_doc["cases"] if c["case"] == "short_coverage_refused")["details"]
    assert refused["refusal_counter"] == 1 and int(refused["finish"]["status_code"]) == 500


def test_the_variants_below_0_5_13_build_on_the_hold(pack):
    for v in SUPPORTED:
        (variant,) = [pv for pv in pack.variants[FIX] if pv.applies(v)]
        assert variant.depends_on == (("sbp-abort-hold",) if v in HOLD_RELEASES else ()), (v, variant.name)


@pytest.mark.probe_env
@pytest.mark.network
def test_below_0_5_13_the_check_runs_in_the_poll(release_tree, probe_python, tmp_path, pack):
    """0.5.9 (no metadata gate before the polls' all-reduce): the fix needs sbp-abort-hold, whose
    failure branch it extends; with it, the coverage cases turn safe and a short handoff is a 500 on
    both attention-TP ranks, its pages released at once."""
    from backport.probing import run_harness

    version = "0.5.9"
    pristine = release_tree(version)
    alone = apply_series(clone_tree(pristine, tmp_path, tmp_path / "alone").path, pack, version, only=[FIX])
    assert [(p.fix, p.status) for p in alone.patches] == [(FIX, "failed")]
    assert "missing dependency: sbp-abort-hold" in alone.patches[0].reason, alone.patches[0].reason
    tree = clone_tree(pristine, tmp_path, tmp_path / "with-hold")
    report = apply_series(tree.path, pack, version, only=["sbp-abort-hold", FIX])
    assert [(p.fix, p.status) for p in report.patches] == [("sbp-abort-hold", "applied"), (FIX, "applied")]
    probes = ["transfer_coverage"]
    before = _verdicts(run_harness(probe_python, pristine.path, probes=probes, label="pristine"))
    after_doc = run_harness(probe_python, tree.path, probes=probes, label="patched")
    after = _verdicts(after_doc)
    for name in ("short_coverage_refused", "unpatched_peer_refused", "tp_ranks_refuse_together"):
        assert (before[f"transfer_coverage/{name}"], after[f"transfer_coverage/{name}"]) == ("unsafe", "safe")
    for name in ("full_coverage_committed", "chunked_prefill_committed", "tp_ranks_commit_together"):
        assert after[f"transfer_coverage/{name}"] == "safe", name
    two = next(c for c in after_doc["cases"] if c["case"] == "tp_ranks_refuse_together")["details"]["ranks"]
    assert [(r["committed"], r["pages_held"], r["release_calls"]) for r in two] == [(False, 0, 1)] * 2
    assert [r["refusal_counter"] for r in two] == [0, 1]  # rank 1 saw the short coverage


@pytest.mark.probe_env
@pytest.mark.network
def test_turning_the_check_off_restores_upstream_behaviour(release_tree, probe_python, tmp_path, pack):
    """SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK=0 on decode: the short handoff is committed
    again (the operator's choice); unset or 1: refused."""
    import json

    from backport.probing.harness import probe_environ

    version = "0.5.19"
    tree = clone_tree(release_tree(version), tmp_path, tmp_path / "only")
    apply_series(tree.path, pack, version, only=[FIX])
    script = (
        "import json, sys\n"
        "from probes import ProbeContext\n"
        "from probes.rigs.coverage_run import one_handoff\n"
        "for value in (None, '1', '0'):\n"
        "    ctx = ProbeContext()\n"
        "    obs = one_handoff(ctx, decode_tokens=640, prefill_tokens=1, rid=f'env-{value}', room=9,\n"
        "                      check_env=value)\n"
        "    ctx.close()\n"
        "    print(json.dumps({'value': value, 'committed': obs['committed'],\n"
        "                      'coverage': obs['recorded_coverage']}))\n"
    )
    out = subprocess.run([probe_python, "-c", script], env=probe_environ(probe_python, tree.path, REPO),
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["value"], r["committed"], r["coverage"]) for r in rows] == [
        (None, False, 1), ("1", False, 1), ("0", True, 1)]
