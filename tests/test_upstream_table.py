"""The write-up's table as a regression test of the toolkit, with upstream-STYLE files written here.

Three synthetic trees stand for the releases of the table: `pristine` lacks the admission fix,
`patched` has it (the pack's patch), `newer` has it too but its queue reads an attribute the
test's `types.SimpleNamespace` double was never given (0.5.21's `token_to_kv_pool_allocator`).
Files served from 127.0.0.1 (`{base}/{rev}/{path}`), each pinned in fixes.toml:

- an admission file with subtests: failed on pristine (the fix's name is missing), passed with
  its subtests counted on patched, stale-test on newer (never failed, never a pass);
- a behaviour file: failed on pristine (the behaviour is missing), passed on patched;
- a tampered file (the server's bytes do not match the pin): refused on first use, never run;
- a file the server does not have: unavailable, and the others' results stay intact.

Then the verdict: pristine failed -> patched passed is `fixed`, a refused file is a finding, a
patched failure where the fix is applied is a finding, and stale-test never counts as a pass.
"""

from __future__ import annotations

import hashlib
import json
import textwrap

import pytest

from backport import cli
from backport.evidence import upstream_section
from backport.evidence.upstream_verdicts import evidence_summary, file_rows
from backport.upstream import load_refs, run_upstream_tests
from tests import test_upstream_tests as shared
from tests.test_upstream_tests import (
    BEHAVIOUR,
    PATCH,
    PYTHON,
    REV,
    UNIT,
    UTILS_PATCHED,
    UTILS_PRISTINE,
    cache_files,
)

server, cache_dir = shared.server, shared.cache_dir

DECODE_0519 = '''\
from sglang.srt.disaggregation import utils


class DecodePreallocQueue:
    def add(self, req):
        if hasattr(utils, "is_unadmitted_reject") and utils.is_unadmitted_reject(req):
            self.scheduler.retire(req)
            return
        self.pending_reqs.append(req)
'''

# A later release: the same door, and a read of an allocator its queue now carries.
DECODE_NEWER = '''\
from sglang.srt.disaggregation import utils


class DecodePreallocQueue:
    def add(self, req):
        if utils.is_unadmitted_reject(req):
            self.scheduler.retire(req)
            return
        if self.token_to_kv_pool_allocator is not None:
            req["allocator_checked"] = True
        self.pending_reqs.append(req)
'''

ADMISSION = '''\
"""A rejected request is retired at the decode door; a valid one is enqueued (upstream style)."""

import unittest
from types import SimpleNamespace
from unittest.mock import MagicMock

from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.utils import is_unadmitted_reject


def _decode_queue():
    return SimpleNamespace(scheduler=MagicMock(), pending_reqs=[])


class TestAdmission(unittest.TestCase):
    def test_rejected_request_is_retired(self):
        for status in (400, 413, 503):
            with self.subTest(status=status):
                q = _decode_queue()
                req = {"to_finish": f"abort {status}"}
                self.assertTrue(is_unadmitted_reject(req))
                DecodePreallocQueue.add(q, req)
                self.assertEqual(q.pending_reqs, [])
                q.scheduler.retire.assert_called_once_with(req)

    def test_valid_request_is_enqueued(self):
        for n in range(2):
            with self.subTest(n=n):
                q = _decode_queue()
                DecodePreallocQueue.add(q, {"n": n})
                self.assertEqual(len(q.pending_reqs), 1)
'''

TAMPERED_GENUINE = BEHAVIOUR.replace("TestAdmissionBehaviour", "TestMirror")
TAMPERED_SERVED = TAMPERED_GENUINE.replace("assertFalse", "assertTrue")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


FILES = {  # name -> (fix, what the server serves, the pin)
    "test_admission_abort_not_enqueued.py": ("pr38935", ADMISSION, _sha(ADMISSION)),
    "test_admission_behaviour.py": ("pr38935", BEHAVIOUR, _sha(BEHAVIOUR)),
    "test_mirror_copy.py": ("pr36988", TAMPERED_SERVED, _sha(TAMPERED_GENUINE)),
    "test_never_served.py": ("pr36988", None, _sha("never served")),
}


def _tree(root, utils: str, decode: str):
    tree = shared.make_tree(root, utils)
    (tree / "sglang/srt/disaggregation/decode.py").write_text(decode)
    return tree


@pytest.fixture
def table(tmp_path, server):
    series = tmp_path / "patches"
    (series / "pr38935").mkdir(parents=True)
    (series / "pr38935" / "pr38935-0.5.19.patch").write_text(PATCH)
    (series / "series").write_text("pr36988\npr38935\n")
    entries = {fix: [] for fix, _, _ in FILES.values()}
    for name, (fix, text, pin) in FILES.items():
        entries[fix].append(f'{{ path = "{UNIT}/{name}", rev = "{REV}", sha256 = "{pin}" }}')
        if text is not None:
            server.put(f"{UNIT}/{name}", text)
    (series / "fixes.toml").write_text("\n".join(textwrap.dedent(f'''\
        [[fix]]
        id = "{fix}"
        title = "{fix}"
        pr = {fix[2:]}
        upstream_commit = "3f8eb35ead"
        upstream_tests = [{", ".join(listed)}]
        ''') for fix, listed in entries.items()))
    trees = {"pristine": _tree(tmp_path / "pristine", UTILS_PRISTINE, DECODE_0519),
             "patched": _tree(tmp_path / "patched", UTILS_PATCHED, DECODE_0519),
             "newer": _tree(tmp_path / "newer", UTILS_PATCHED, DECODE_NEWER)}
    document = run_upstream_tests(list(trees.items()), load_refs(series), python=PYTHON, base_url=server.url)
    return series, trees, document


def _cells(document: dict) -> dict[str, dict[str, dict[str, int]]]:
    """file name -> tree -> outcome counts: the write-up's table."""
    cells: dict = {}
    for tree in document["trees"]:
        for test in tree["tests"]:
            per = cells.setdefault(test["file"].rsplit("/", 1)[-1], {}).setdefault(tree["tree"], {})
            per[test["outcome"]] = per.get(test["outcome"], 0) + 1
    return cells


def test_the_table_missing_fix_failed_drifted_double_stale_refused_pin_and_a_missing_file(table, cache_dir):
    _, _, document = table
    assert _cells(document) == {
        "test_admission_abort_not_enqueued.py": {"pristine": {"failed": 1}, "patched": {"passed": 2},
                                                 "newer": {"passed": 1, "stale-test": 1}},
        "test_admission_behaviour.py": {"pristine": {"failed": 1, "passed": 1, "skipped": 1},
                                        "patched": {"passed": 2, "skipped": 1},
                                        "newer": {"passed": 2, "skipped": 1}},
        "test_mirror_copy.py": {tree: {"refused": 1} for tree in ("pristine", "patched", "newer")},
        "test_never_served.py": {tree: {"unavailable": 1} for tree in ("pristine", "patched", "newer")},
    }
    tests = {t["tree"]: {x["nodeid"].rsplit("::", 1)[-1]: x for x in t["tests"]} for t in document["trees"]}
    # The missing fix is a failure, named by what the fix adds.
    assert (
        "is_unadmitted_reject" in tests["pristine"][f"{UNIT}/test_admission_abort_not_enqueued.py"]["reason"]
    )
    # The drifted double: the attribute, the double (its helper and type) and where the release read it.
    assert tests["newer"]["test_rejected_request_is_retired"]["outcome"] == "passed"  # the door returns first
    stale = tests["newer"]["test_valid_request_is_enqueued"]
    assert stale["outcome"] == "stale-test"
    for part in ("`_decode_queue`", "types.SimpleNamespace", "token_to_kv_pool_allocator",
                 "DecodePreallocQueue.add", "sglang/srt/disaggregation/decode.py:"):
        assert part in stale["reason"], part
    # Subtests are counted per file (pytest: "2 passed, 5 subtests passed").
    key = f"{UNIT}/test_admission_abort_not_enqueued.py@{REV}"
    by_tree = {t["tree"]: t.get("subtests", {}) for t in document["trees"]}
    assert by_tree["patched"][key] == {"passed": 5}
    # The tampered copy: refused with both digests, never run, never cached; the missing one says why.
    mirror = tests["patched"][f"{UNIT}/test_mirror_copy.py"]
    assert _sha(TAMPERED_SERVED) in mirror["reason"] and _sha(TAMPERED_GENUINE) in mirror["reason"]
    assert "404" in tests["patched"][f"{UNIT}/test_never_served.py"]["reason"]
    files = {f["path"].rsplit("/", 1)[-1]: f for f in document["files"]}
    assert (
        files["test_mirror_copy.py"]["pinned"] is False
        and files["test_admission_behaviour.py"]["pinned"] is True
    )
    assert not any("mirror" in name or "never" in name for name in cache_files(cache_dir))


def test_one_missing_file_leaves_the_others_results_intact(table, server, tmp_path):
    series, trees, document = table
    # Remove the admission file from the server (and from a fresh cache): only it changes.
    (tmp_path / "served" / REV / UNIT / "test_admission_abort_not_enqueued.py").unlink()
    fresh = tmp_path / "fresh-cache"
    again = run_upstream_tests(list(trees.items()), load_refs(series), python=PYTHON, base_url=server.url,
                               cache_dir=fresh)
    before, after = _cells(document), _cells(again)
    assert after.pop("test_admission_abort_not_enqueued.py") == {t: {"unavailable": 1} for t in trees}
    before.pop("test_admission_abort_not_enqueued.py")
    assert after == before


def test_the_verdict_joins_them_per_fix(table):
    _, _, document = table
    as_run = {**document, "trees": [t for t in document["trees"] if t["tree"] in ("pristine", "patched")]}
    applied = {"patches": [{"fix": "pr38935", "status": "applied"}, {"fix": "pr36988", "status": "applied"}]}
    rows = {r["file"].rsplit("/", 1)[-1]: r for r in file_rows(as_run, applied)}
    assert rows["test_admission_abort_not_enqueued.py"]["pair"] == "fixed"
    assert rows["test_admission_abort_not_enqueued.py"]["trees"]["patched"]["subtests"] == {"passed": 5}
    assert rows["test_admission_behaviour.py"]["pair"] == "fixed"
    assert (rows["test_mirror_copy.py"]["pair"], rows["test_mirror_copy.py"]["finding"]) == ("refused", True)
    assert (rows["test_never_served.py"]["pair"], rows["test_never_served.py"]["finding"]) == (
        "inconclusive",
        False,
    )
    summary = evidence_summary(as_run, applied)
    assert summary["with_evidence"] == ["pr38935"]
    assert "test_mirror_copy.py" in summary["without_evidence"]["pr36988"]
    assert [f["pair"] for f in summary["findings"]] == ["refused"]

    # The newer tree as the patched one: stale-test is never a pass (the admission file is inconclusive).
    newer = {**document, "trees": [dict(t, tree="patched") if t["tree"] == "newer" else t
                                   for t in document["trees"] if t["tree"] in ("pristine", "newer")]}
    rows = {r["file"].rsplit("/", 1)[-1]: r for r in file_rows(newer, applied)}
    assert rows["test_admission_abort_not_enqueued.py"]["pair"] == "inconclusive"
    assert not rows["test_admission_abort_not_enqueued.py"]["finding"]

    # A patched tree that fails where the fix is applied is a finding; where the pack does not carry the
    # fix to the release, the row says so and it is not one.
    broken = {**document, "trees": [dict(t, tree="patched") if t["tree"] == "pristine" else t
                                    for t in document["trees"] if t["tree"] == "pristine"]}
    row = next(r for r in file_rows(broken, applied) if r["file"].endswith("behaviour.py"))
    assert (row["pair"], row["finding"]) == ("still-failing", True)
    skipped = {"patches": [{"fix": "pr38935", "status": "not-applicable"}]}
    row = next(r for r in file_rows(broken, skipped) if r["file"].endswith("behaviour.py"))
    assert (row["pair"], row["finding"], row["fix_status"]) == ("still-failing", False, "not-applicable")

    # REPORT.md's section: every outcome with its reason and revision; "pinned" only for matched bytes.
    lines = "\n".join(upstream_section.render(as_run, {"upstream_evidence": summary}))
    assert "Upstream evidence for 1 of 2 fixes (pr38935)." in lines
    assert f"`{UNIT}/test_mirror_copy.py` at `{REV}`: **refused**, never run" in lines
    assert f"`{UNIT}/test_admission_behaviour.py` at `{REV}`: pinned (sha256 `{_sha(BEHAVIOUR)}`" in lines
    assert f"`{UNIT}/test_never_served.py` at `{REV}`: **unavailable**, not fetched:" in lines
    assert "+ 5 subtests passed" in lines and "| **refused** |" in lines


def test_the_cli_runs_every_file_and_exits_1_on_the_refused_one(table, server, capsys):
    series, trees, _ = table
    code = cli.main(
        [
            "upstream-tests",
            str(trees["patched"]),
            "--series",
            str(series),
            "--base-url",
            server.url,
            "--python",
            PYTHON,
            "--json",
        ]
    )
    document = json.loads(capsys.readouterr().out)
    assert code == 1
    outcomes: dict[str, set[str]] = {}
    for test in document["trees"][0]["tests"]:
        outcomes.setdefault(test["file"].rsplit("/", 1)[-1], set()).add(test["outcome"])
    assert outcomes == {"test_admission_abort_not_enqueued.py": {"passed"},
                        "test_admission_behaviour.py": {"passed", "skipped"},
                        "test_mirror_copy.py": {"refused"}, "test_never_served.py": {"unavailable"}}
