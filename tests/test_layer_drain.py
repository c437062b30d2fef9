"""The pack's own fix `sbp-layer-drain` (issue 41): sbp-abort-hold's prefill half on 0.4.6 - 0.4.9.post6.
Its scope ends where the hold carries its own prefill half (0.4.10), its fingerprint reads only its
own lines, and on a real release it alone
turns the per-layer send case safe and keeps the manager's pool up after a failed layer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backport.engine import apply_series
from backport.engine.detect import fingerprint_match
from backport.pack import load_pack
from backport.releases import load_pins
from backport.tree import clone_tree

REPO = Path(__file__).resolve().parent.parent
FIX = "sbp-layer-drain"
VARIANTS = ("0.4.6", "0.4.6.post4", "0.4.7", "0.4.8.post1")
CASE = "prefill_drain/per_layer_send_reports_failure_after_every_write"
CONN = "sglang/srt/disaggregation/mooncake/conn.py"


@pytest.fixture(scope="module")
def pack():
    return load_pack(REPO / "patches")


def test_scope_meets_the_hold_and_each_release_has_one_variant(pack):
    fix, hold = pack.fixes[FIX], pack.fixes["sbp-abort-hold"]
    pins = list(load_pins())
    served = [v for v in pins if fix.in_scope(v)]
    assert served[0] == "0.4.6" and pins[pins.index(served[-1]) + 1] == "0.4.10"
    # the hold's decode side reaches down to 0.4.7; where both serve, the hold's variant carries no
    # prefill wait of its own and depends on this fix (its prefill half there)
    both = [v for v in served if hold.in_scope(v)]
    assert both[0] == "0.4.7" and both[-1] == served[-1] and hold.in_scope("0.4.10")
    for v in both:
        variant = pack.variant_for("sbp-abort-hold", v)
        assert FIX in variant.depends_on and "concurrent.futures.wait" not in variant.path.read_text(), v
    assert sorted(v.name for v in pack.variants[FIX]) == sorted(f"{FIX}-{v}.patch" for v in VARIANTS)
    for v in served:
        assert len([pv for pv in pack.variants[FIX] if pv.applies(v)]) == 1, v
    # before the hold in the series: on 0.4.10+ its identical wait must not read as this fix
    assert pack.series.index(FIX) < pack.series.index("sbp-abort-hold")


def test_the_fingerprint_reads_this_fix_s_lines_only(pack, release_tree):
    """0.5.23 ships a `concurrent.futures.wait(futures)` of its own, and sbp-abort-hold adds the same
    wait on 0.4.10 - 0.5.12.post1: neither reads as this fix."""
    fix = pack.fixes[FIX]
    text = (release_tree("0.5.23").package_root / CONN).read_text()
    assert "concurrent.futures.wait(futures)" in text
    assert fingerprint_match(fix, lambda rel: text if rel == CONN else None)[0] is False
    hold_patches = "".join(pv.path.read_text() for pv in pack.variants["sbp-abort-hold"])
    assert "concurrent.futures.wait(futures)" in hold_patches
    assert not any(re.search(rule.pattern, hold_patches) for rule in fix.fingerprint)


@pytest.mark.probe_env
@pytest.mark.network
def test_the_fix_alone_drains_the_per_layer_send(release_tree, probe_python, tmp_path, pack):
    """0.4.6.post5: pristine, the send reports the failed layer while the sibling layer still writes and
    shuts the manager's shared pool down; with this fix alone, it waits for the write and the pool stays."""
    from backport.probing import run_harness

    version = "0.4.6.post5"
    pristine = release_tree(version)
    tree = clone_tree(pristine, tmp_path, tmp_path / "only")
    report = apply_series(tree.path, pack, version, only=[FIX])
    assert [(p.fix, p.status) for p in report.patches] == [(FIX, "applied")]
    probe = CASE.split("/")[0]

    def verdict(root) -> str:
        doc = run_harness(probe_python, root, probes=[probe], label=str(root))
        return next(c["verdict"] for c in doc["cases"] if f"{c['probe']}/{c['case']}" == CASE)

    assert (verdict(pristine.path), verdict(tree.path)) == ("unsafe", "safe")
    before = (pristine.package_root / CONN).read_text()
    after = (tree.package_root / CONN).read_text()
    assert "self.executor.shutdown(wait=False)" in before
    assert "self.executor.shutdown(wait=False)" not in after
