"""Upstream-style unit tests, served from 127.0.0.1, against the real pristine and patched 0.5.19.

The test file is written here in upstream's style (a unittest class importing SGLang names from
the tree under test) and served at the revision and path that `patches/fixes.toml` names for
#38935, so both `upstream-tests` and `run` obtain it exactly as they would from upstream.
"""

from __future__ import annotations

import json
import shutil
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from backport import cli
from backport.upstream import Fetcher, load_refs
from tests.conftest import REPO

pytestmark = [pytest.mark.probe_env, pytest.mark.network]

ADMISSION_TEST = '''\
import unittest

from sglang.srt.disaggregation.utils import is_unadmitted_reject
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
from sglang.srt.sampling.sampling_params import SamplingParams


def make_req(rid):
    return Req(rid=rid, origin_input_text="hi", origin_input_ids=[1, 2, 3],
               sampling_params=SamplingParams(max_new_tokens=4))


class TestUnadmittedReject(unittest.TestCase):
    def test_intake_rejected_request_is_unadmitted(self):
        req = make_req("rejected")
        req.to_finish = FINISH_ABORT("prompt too long", status_code=400)
        self.assertTrue(is_unadmitted_reject(req))

    def test_valid_request_is_admitted(self):
        self.assertFalse(is_unadmitted_reject(make_req("valid")))

    def test_retracted_request_is_not_retired(self):
        req = make_req("retracted")
        req.to_finish = FINISH_ABORT("abort while running", status_code=400)
        req.is_retracted = True
        self.assertFalse(is_unadmitted_reject(req))


if __name__ == "__main__":
    unittest.main()
'''


AD_HOC_REV = "5" * 40  # a revision fixes.toml does not name: `--test PATH --rev` runs the file unpinned


@pytest.fixture
def upstream_server(tmp_path, shared_cache):
    """A real HTTP server on 127.0.0.1 laid out like `{base_url}/{rev}/{path}`. Its files are cached
    per server (they are unpinned): that cache entry is removed afterwards, so the shared cache
    never keeps a stand-in test file."""
    ref = next(r for r in load_refs(REPO / "patches", ["pr38935"]))
    for rev in (ref.rev, AD_HOC_REV):  # the pinned revision (refused: not its bytes) and an unpinned one
        served = tmp_path / "served" / rev / ref.path
        served.parent.mkdir(parents=True)
        served.write_text(ADMISSION_TEST)
    # a pinned copy of upstream's real file in the shared cache would be served without asking the server
    shutil.rmtree(shared_cache / "upstream-tests" / "sha256" / ref.sha256, ignore_errors=True)
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path / "served"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    yield url, ref
    server.shutdown()
    server.server_close()
    shutil.rmtree(shared_cache / "upstream-tests" / "servers" / Fetcher(url).server_key(), ignore_errors=True)


def test_upstream_tests_fail_on_pristine_and_pass_on_patched(upstream_server, release_tree, patched_tree,
                                                             probe_python, shared_cache, monkeypatch, capsys):
    base_url, ref = upstream_server
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    pristine, patched = release_tree("0.5.19"), patched_tree("0.5.19")[0]
    code = cli.main(["upstream-tests", str(pristine.path), str(patched.path), "--test", ref.path,
                     "--rev", AD_HOC_REV, "--base-url", base_url, "--python", probe_python, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1  # a failure on the pristine tree is a finding
    outcomes = {
        t["tree"]: {x["nodeid"].split("::")[-1]: x["outcome"] for x in t["tests"]} for t in doc["trees"]
    }
    before, after = outcomes[str(pristine.path)], outcomes[str(patched.path)]
    assert set(before.values()) == {"failed"}, before  # is_unadmitted_reject is a name the pack adds
    assert after == {"test_intake_rejected_request_is_unadmitted": "passed",
                     "test_valid_request_is_admitted": "passed",
                     "test_retracted_request_is_not_retired": "passed"}
    assert all(t["file"] == ref.path and t["rev"] == AD_HOC_REV and len(t["sha256"]) == 64
               for tree in doc["trees"] for t in tree["tests"])


def test_run_bundle_carries_the_upstream_section(upstream_server, probe_python, shared_cache, monkeypatch,
                                                 tmp_path, capsys):
    base_url, ref = upstream_server
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    out = tmp_path / "bundle"
    cli.main(["run", "sglang==0.5.19", "--out", str(out), "--python", probe_python, "--reference", "none",
              "--upstream-base-url", base_url, "--json"])
    capsys.readouterr()
    section = json.loads((out / "upstream-tests.json").read_text())
    # fixes.toml pins the admission file: bytes that are not upstream's are refused, never run
    ours = {t["tree"]: {x["outcome"] for x in t["tests"] if x["file"] == ref.path} for t in section["trees"]}
    assert ours == {"pristine": {"refused"}, "patched": {"refused"}}, section
    report = (out / "REPORT.md").read_text()
    assert "refused" in report and ref.rev[:12] in report
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["predicate"]["summary"]["result"] == "fail"  # a refused file is a finding
