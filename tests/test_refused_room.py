"""The pack's own fix `sbp-refused-room` (issue 41 item 2): its scope and variants, where its cases
run, and on real releases that it alone makes a refused room's reservation go, on both manager
layouts, on 0.4.8.post1 - 0.4.9's three-frame status messages, and on 0.4.5.post1 - 0.4.6.post4,
whose decode had no failure branch (the pack gives it a release for a refused room only).

Where the cases are not-applicable must never hide the exposure (a class read as fixed or
not_affected while the fix is missing): the cases' release range is exactly the pinned releases
whose decode has no waiting timeout, read from each release's own code."""

from __future__ import annotations

from pathlib import Path

import pytest

import probes
from backport import expectations
from backport.evidence.vulnerabilities import class_status, load_classes
from backport.pack import load_pack
from backport.releases import load_pins

REPO = Path(__file__).resolve().parent.parent
FIX = "sbp-refused-room"
CLASS = "SBP-2026-0001"
SERVED = ("0.4.5.post1", "0.4.5.post2", "0.4.5.post3", "0.4.6", "0.4.6.post1", "0.4.6.post2", "0.4.6.post3",
          "0.4.6.post4", "0.4.6.post5", "0.4.7", "0.4.7.post1", "0.4.8", "0.4.8.post1", "0.4.9")
VARIANTS = ("0.4.5.post1", "0.4.5.post2", "0.4.5.post3", "0.4.6", "0.4.6.post2", "0.4.6.post3", "0.4.6.post4",
            "0.4.6.post5", "0.4.7", "0.4.7.post1", "0.4.8.post1")
CASES = ("prefill_reports_refused_room", "decode_releases_refused_room")
# must-preserve where the pack gives decode its release (0.4.5.post1 - 0.4.6.post4): a transfer's own
# Failed is not taken for a refusal
PRESERVE_CASE = "transfer_failure_not_released_as_refused"
# there too: two decode ranks release together, once both heard the report
RANKS_CASE = "refused_room_released_on_every_rank_together"
# sbp-twin-timeout (the same releases): prefill's twin of a request decode's door refused leaves the
# bootstrap queue at the bootstrap timeout, and a decode rank registering after that is told refused
TWIN_FIX = "sbp-twin-timeout"
TWIN_CASE = "decode_refused_twin_released_at_bootstrap_timeout"
TWIN_VARIANTS = ("0.4.5.post1", "0.4.6", "0.4.6.post5", "0.4.7", "0.4.8.post1")
# sbp-refused-hold (0.4.9.post1 - 0.5.12.post1): the same report ends sbp-abort-hold's hold at once (on
# 0.4.7 - 0.4.9 sbp-refused-room reports and sbp-abort-hold's variants there count it)
HOLD_FIX = "sbp-refused-hold"
HOLD_CASE = "refused_room_ends_decode_hold"
HOLD_VARIANTS = ("0.4.9.post1", "0.4.10", "0.5.1.post2", "0.5.3.post2", "0.5.3.post3", "0.5.4", "0.5.5.post2",
                 "0.5.9", "0.5.10", "0.5.12")
# the disaggregation sources a decode waiting timeout lives in (Mooncake's receiver, or the common
# receiver it inherits from on later releases)
TIMEOUT_HOMES = ("mooncake/conn.py", "common/conn.py", "base/conn.py")


@pytest.fixture(scope="module")
def pack():
    return load_pack(REPO / "patches")


def _applicable(version: str) -> bool:
    return not any(expectations.outside_release(f"refused_room/{name}", version) for name in CASES)


def test_scope_and_variants(pack):
    fix = pack.fixes[FIX]
    pins = load_pins()
    assert fix.is_vendor and tuple(fix.depends_on) == ("pr38935",)
    assert [v for v in pins if fix.in_scope(v)] == list(SERVED)
    assert sorted(v.name for v in pack.variants[FIX]) == [f"{FIX}-{v}.patch" for v in VARIANTS]
    assert [c.name for c in probes.cases_of("refused_room")] == [*CASES, PRESERVE_CASE, RANKS_CASE, TWIN_CASE,
                                                                 HOLD_CASE]


def test_the_twin_fix_serves_the_report_s_releases(pack):
    """sbp-twin-timeout reports a room prefill gives up through sbp-refused-room's report: the same
    releases (those whose decode has no waiting timeout), after it in the series, one variant each;
    its case runs exactly where the report's cases do."""
    fix, room = pack.fixes[TWIN_FIX], pack.fixes[FIX]
    pins = load_pins()
    assert fix.is_vendor and tuple(fix.depends_on) == (FIX,)
    assert [v for v in pins if fix.in_scope(v)] == [v for v in pins if room.in_scope(v)] == list(SERVED)
    assert pack.series.index(TWIN_FIX) == pack.series.index(FIX) + 1
    names = sorted(v.name for v in pack.variants[TWIN_FIX])
    assert names == sorted(f"{TWIN_FIX}-{v}.patch" for v in TWIN_VARIANTS)
    assert all(pack.variant_for(TWIN_FIX, v) is not None for v in SERVED)
    twin_runs = [v for v in pins if not expectations.outside_release(f"refused_room/{TWIN_CASE}", v)]
    assert twin_runs == [v for v in pins if _applicable(v)]


def test_the_hold_fix_serves_exactly_the_hold_s_releases(pack):
    """Wherever sbp-abort-hold holds, a refused room is reported and the report ends the hold: by
    sbp-refused-hold (its decode side counts the report in the hold's own record; after the hold in
    the series, with a variant for every release of its scope), or, below it, by sbp-refused-room,
    whose report the hold's variants there count. Never both on one release."""
    fix, hold, room = pack.fixes[HOLD_FIX], pack.fixes["sbp-abort-hold"], pack.fixes[FIX]
    pins = load_pins()
    assert fix.is_vendor and tuple(fix.depends_on) == ("pr38935", "sbp-abort-hold")
    held = [v for v in pins if hold.in_scope(v)]
    assert [v for v in held if fix.in_scope(v) or room.in_scope(v)] == held
    assert not [v for v in pins if fix.in_scope(v) and room.in_scope(v)]
    for v in held:  # below sbp-refused-hold the hold's variant counts sbp-refused-room's report
        if room.in_scope(v):
            assert "sbp-refused-room" in pack.variant_for("sbp-abort-hold", v).depends_on, v
    assert pack.series.index(HOLD_FIX) == pack.series.index("sbp-abort-hold") + 1
    names = sorted(v.name for v in pack.variants[HOLD_FIX])
    assert names == sorted(f"{HOLD_FIX}-{v}.patch" for v in HOLD_VARIANTS)
    assert all(pack.variant_for(HOLD_FIX, v) is not None for v in pins if fix.in_scope(v))
    # sbp-refused-room's fingerprint must not read the hold fix's decode branch as its own
    text = "elif status == ROOM_REFUSED:"
    import re

    assert not any(re.search(rule.pattern, text) for rule in pack.fixes[FIX].fingerprint
                   if "ROOM_REFUSED" in rule.pattern)


def test_a_missing_fix_reads_affected_never_fixed(pack):
    """The class with refused_room unsafe on the patched tree (0.4.8.post1 before its variant, had
    the cases run there) is affected; with the cases not-applicable it reads fixed, which is why
    not-applicable must stay where decode releases the reservation by itself."""
    row = next(c for c in load_classes(REPO / "patches", list(pack.fixes)) if c.id == CLASS)

    def rows(patched: str) -> list[dict]:
        pair = {"safe": "fixed", "unsafe": "still-unsafe", "not-applicable": "not-applicable"}[patched]
        pristine = "not-applicable" if patched == "not-applicable" else "unsafe"
        return [{"probe": "refused_room", "case": name, "must_preserve": False,
                 "verdicts": {"pristine": pristine, "patched": patched}, "pair": pair} for name in CASES]

    assert class_status(row, rows("unsafe")).status == "affected"
    assert class_status(row, rows("safe")).status == "fixed"


@pytest.mark.network
def test_cases_are_not_applicable_exactly_where_decode_has_a_waiting_timeout(release_tree):
    """Read from every pinned release with a Mooncake manager: the cases' `needs` range holds the
    releases whose decode has no waiting timeout (nothing but a report from prefill ends the
    reservation), and only those. A release outside it is one where the timeout fails the room and
    releases its pages, as 0.5.22 does."""
    checked = []
    for version in load_pins():
        root = release_tree(version).package_root / "sglang" / "srt" / "disaggregation"
        if not (root / "mooncake" / "conn.py").is_file():
            continue
        has_timeout = any("waiting_timeout" in (root / home).read_text()
                          for home in TIMEOUT_HOMES if (root / home).is_file())
        assert _applicable(version) == (not has_timeout), version
        checked.append(version)
    # the range today: 0.4.5.post1 - 0.4.9 (0.4.9.post1 brings SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
    assert [v for v in checked if _applicable(v)][-1] == "0.4.9"
    assert "0.4.9.post1" in checked and not _applicable("0.4.9.post1")


# ---------------------------------------------------------------------------
# real releases


@pytest.mark.probe_env
@pytest.mark.network
@pytest.mark.parametrize("version", ["0.4.8.post1", "0.4.9"])
def test_three_frame_releases_unsafe_pristine_safe_patched(version, probe_cases, pack):
    """0.4.8.post1 - 0.4.9: decode holds the refused room's pages on the pristine tree (no report,
    no timeout); on the patched tree prefill reports it in the release's own three frames, decode
    releases at once (sbp-abort-hold's hold counts the report as the rank's last word: nothing to
    hold) and still serves the next valid request."""
    pristine = probe_cases("refused_room", version, "pristine")
    patched = probe_cases("refused_room", version, "patched")
    assert {n: c["verdict"] for n, c in pristine.items()} == {**dict.fromkeys([*CASES, TWIN_CASE], "unsafe"),
                                                            PRESERVE_CASE: "not-applicable",
                                                            RANKS_CASE: "not-applicable",
                                                            HOLD_CASE: "not-applicable"}
    # the release's own timeout gives the twin up; nothing told a decode rank registering after it
    assert pristine[TWIN_CASE]["details"]["late_registration_told"] == []
    assert {n: c["verdict"] for n, c in patched.items()} == {**dict.fromkeys([*CASES, TWIN_CASE], "safe"),
                                                           PRESERVE_CASE: "not-applicable",
                                                           RANKS_CASE: "not-applicable",
                                                           HOLD_CASE: "safe"}  # the hold counts the report
    held = pristine["decode_releases_refused_room"]["details"]
    assert held["reports_from_prefill"] == 0 and held["refused_after_report"]["pages_held"] > 0
    assert held["valid_served"]  # the pristine decode still reads a real three-frame Success
    released = patched["decode_releases_refused_room"]["details"]
    assert released["reports_from_prefill"] == 1 and released["pages_free_vs_baseline_after_report"] == 0
    assert released["refused_after_report"]["metadata_frees"] == 1 and released["valid_served"]
    row = next(c for c in load_classes(REPO / "patches", list(pack.fixes)) if c.id == CLASS)
    rows = [{"probe": "refused_room", "case": n, "must_preserve": False, "pair": "fixed",
             "verdicts": {"pristine": pristine[n]["verdict"], "patched": patched[n]["verdict"]}}
            for n in CASES]
    assert class_status(row, rows).status == "fixed"


@pytest.mark.probe_env
@pytest.mark.network
@pytest.mark.parametrize("version, stops", [("0.4.5.post1", True), ("0.4.6.post4", False)])
def test_decode_without_a_failure_branch_releases_a_refused_room_only(version, stops, probe_cases):
    """0.4.5.post1 - 0.4.6.post4: the pristine decode holds a refused room's pages forever (and a Failed
    poll raised "Transfer failed", stopping decode); patched, decode releases a room prefill reported
    refused, slot by slot what pre-allocation reserved, on every rank together, and still serves the
    next request, while a
    failed chunk's own Failed keeps the room's pages. 0.4.5.post1's decode thread stores that Failed
    (its queue stops decode, as the release does); 0.4.6.post4's folds it with max() (decode waits)."""
    pristine = probe_cases("refused_room", version, "pristine")
    patched = probe_cases("refused_room", version, "patched")
    expected = {PRESERVE_CASE: "safe", HOLD_CASE: "not-applicable"}
    assert {n: c["verdict"] for n, c in pristine.items()} == {
        **dict.fromkeys([*CASES, RANKS_CASE, TWIN_CASE], "unsafe"), **expected}
    assert {n: c["verdict"] for n, c in patched.items()} == {
        **dict.fromkeys([*CASES, RANKS_CASE, TWIN_CASE], "safe"), **expected}
    stuck = pristine[TWIN_CASE]["details"]["steps"][-1]  # the failed poll stopped prefill, or nothing failed
    assert stuck["raised"] or stuck["queued"]
    freed = patched[TWIN_CASE]["details"]["steps"][-1]
    assert not freed["raised"] and not freed["queued"] and len(freed["streamed"]) == 1
    ranks = patched[RANKS_CASE]["details"]  # between the two reports both ranks hold; then both release
    assert all(v["pages_held"] and v["queued"] == 1 for v in ranks["one_rank_heard"])
    assert all(not v["pages_held"] and v["queued"] == 0 for v in ranks["both_heard"])
    released = patched["decode_releases_refused_room"]["details"]
    assert released["pages_free_vs_baseline_after_report"] == 0 and released["refused_streams"] == 1
    assert released["refused_after_report"]["metadata_frees"] == 1 and released["valid_served"]
    kept = patched[PRESERVE_CASE]["details"]
    assert kept["after_failed"]["pages_held"] > 0 and kept["streams"] == 0
    assert (kept["decode_stopped_with"] == "Transfer failed") is stops


@pytest.mark.probe_env
@pytest.mark.network
def test_not_applicable_where_the_waiting_timeout_releases(probe_cases):
    cases = probe_cases("refused_room", "0.4.9.post1", "pristine")
    assert cases.pop(HOLD_CASE)["verdict"] == "not-applicable"  # no hold on 0.4.9.post1 either
    # decode releases a failed transfer itself there: nothing of the pack's to preserve
    assert cases.pop(PRESERVE_CASE)["verdict"] == "not-applicable"
    assert cases.pop(RANKS_CASE)["verdict"] == "not-applicable"
    for case in cases.values():
        assert case["verdict"] == "not-applicable"
        assert "SGLANG_DISAGGREGATION_WAITING_TIMEOUT" in case["details"]["reason"]


@pytest.mark.probe_env
@pytest.mark.network
@pytest.mark.parametrize("version", ["0.4.10.post2", "0.5.9"])
def test_the_report_ends_the_hold_and_only_it(version, probe_cases, probe_python, release_tree, tmp_path):
    """The same release three ways: pristine, no hold (the case is not-applicable: decode releases a
    failed transfer at once); the pack without sbp-refused-hold, the hold keeps the refused room's
    reservation (unsafe, both orders); the whole pack, prefill reports the room once per order and decode
    releases at its next poll."""
    import shutil

    from backport.engine import apply_series
    from backport.probing import run_harness
    from backport.tree import clone_tree

    assert probe_cases("refused_room", version, "pristine")[HOLD_CASE]["verdict"] == "not-applicable"
    patched = probe_cases("refused_room", version, "patched")[HOLD_CASE]
    assert patched["verdict"] == "safe", patched
    *runs, ranks = patched["details"]["runs"]  # both orders, then two prefill ranks that both refuse
    assert [r["reports"] for r in runs] == [1, 1]
    assert [r["client_answers"] for r in [*runs, ranks]] == [1, 1, 1]
    assert all(r["steps"][-1]["pages_held"] == 0 and r["steps"][-1]["release_calls"] == 1
               for r in [*runs, ranks])
    assert runs[1]["steps"][0]["pages_held"] > 0  # the abort came first: held until the report
    assert ranks["steps"][0]["pages_held"] > 0  # one rank's report: held for the other's

    series = tmp_path / "patches"
    shutil.copytree(REPO / "patches", series)
    lines = (series / "series").read_text().splitlines()
    (series / "series").write_text("\n".join(x for x in lines if x.strip() != HOLD_FIX) + "\n")
    dest = tmp_path / "tree"
    tree = clone_tree(release_tree(version), dest.parent, dest)
    assert apply_series(dest, load_pack(series), version).status == "applied"
    doc = run_harness(probe_python, tree.package_root, ["refused_room"], label=f"hold only {version}")
    held = next(c for c in doc["cases"] if c["case"] == HOLD_CASE)
    assert held["verdict"] == "unsafe", held
    *runs, ranks = held["details"]["runs"]
    assert all(r["reports"] == 0 and r["steps"][-1]["pages_held"] > 0 for r in runs)
    assert ranks["steps"][-1]["pages_held"] > 0  # the hold alone ignores the reports decode gets
