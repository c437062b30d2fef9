"""`upstream-tests`: upstream-style test files served by a real HTTP server, run on synthetic trees.

The trees are small SGLang-shaped packages built here (no torch), and the "probe
interpreter" is this interpreter, so every pytest subprocess is fast. The test files are
written here in upstream's style (unittest classes importing SGLang names from the tree).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import socket
import sys
import textwrap
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import git
import pytest

from backport import cli_upstream, upstream_tests
from backport.errors import BadInput, Finding
from backport.upstream_tests import Fetcher, TestRef, fetch_refs, load_refs, run_upstream_tests

REV = "8f3d6944b76c428d884582cb6c82a39db1465360"
UNIT = "test/registered/unit/disaggregation"
PYTHON = sys.executable

# ---- synthetic trees ---------------------------------------------------------------------------

UTILS_PRISTINE = '''\
from enum import Enum


class DisaggregationMode(Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def admit(queue, req):
    """Admit a request to the PD handoff queue."""
    queue.append(req)
    return True
'''

UTILS_PATCHED = '''\
from enum import Enum


class DisaggregationMode(Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


def is_unadmitted_reject(req):
    return req.get("to_finish") is not None and not req.get("is_retracted")


def admit(queue, req):
    """Admit a request to the PD handoff queue."""
    if is_unadmitted_reject(req):
        return False
    queue.append(req)
    return True
'''

SCHEDULER = '''\
class Scheduler:
    def process_input_requests(self, reqs):
        return list(reqs)
'''

PATCH = '''\
Description: do not admit intake-rejected requests to a PD handoff
Origin: upstream, https://github.com/sgl-project/sglang/pull/38935, commit 3f8eb35ead
Applies-To: >=0.5.19
Depends-On: none
---
diff --git a/sglang/srt/disaggregation/utils.py b/sglang/srt/disaggregation/utils.py
--- a/sglang/srt/disaggregation/utils.py
+++ b/sglang/srt/disaggregation/utils.py
@@ -8,7 +8,14 @@ class DisaggregationMode(Enum):
     DECODE = "decode"
 
 
+def is_unadmitted_reject(req):
+    return req.get("to_finish") is not None and not req.get("is_retracted")
+
+
 def admit(queue, req):
     """Admit a request to the PD handoff queue."""
+    if is_unadmitted_reject(req):
+        return False
     queue.append(req)
     return True
'''


def make_tree(root: Path, utils: str) -> Path:
    pkg = root / "sglang"
    for sub in ("", "srt", "srt/disaggregation", "srt/managers"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "version.py").write_text('__version__ = "0.5.19"\n')
    (pkg / "srt/disaggregation/utils.py").write_text(utils)
    (pkg / "srt/managers/scheduler.py").write_text(SCHEDULER)
    return root


@pytest.fixture
def trees(tmp_path):
    return {"pristine": make_tree(tmp_path / "pristine", UTILS_PRISTINE),
            "patched": make_tree(tmp_path / "patched", UTILS_PATCHED)}


@pytest.fixture
def series(tmp_path):
    """A pack with one fix whose patch adds `is_unadmitted_reject` and two upstream tests."""
    root = tmp_path / "patches"
    (root / "pr38935").mkdir(parents=True)
    (root / "pr38935" / "pr38935-0.5.19.patch").write_text(PATCH)
    (root / "fixes.toml").write_text(textwrap.dedent(f'''\
        [[fix]]
        id = "pr38935"
        pr = 38935
        upstream_tests = [
          {{ path = "{UNIT}/test_admission_behaviour.py", rev = "{REV}" }},
          {{ path = "{UNIT}/test_admission_abort_not_enqueued.py", rev = "{REV}" }},
        ]

        [[fix]]
        id = "pr36988"
        upstream_tests = [{{ path = "{UNIT}/test_newer_runtime.py", rev = "{REV}" }}]
        '''))
    return root


# ---- upstream-style test files -----------------------------------------------------------------

BEHAVIOUR = '''\
"""A request rejected at intake must not be admitted to a PD handoff."""

import unittest

from sglang.srt.disaggregation.utils import DisaggregationMode, admit


class TestAdmissionBehaviour(unittest.TestCase):
    def test_rejected_request_is_not_enqueued(self):
        queue = []
        self.assertFalse(admit(queue, {"to_finish": "abort: 400"}))
        self.assertEqual(queue, [])

    def test_valid_request_still_admitted(self):
        queue = []
        self.assertTrue(admit(queue, {}))
        self.assertEqual(len(queue), 1)

    @unittest.skipIf(DisaggregationMode.NULL.value == "null", "NULL mode is deliberately untouched")
    def test_null_mode(self):
        pass


if __name__ == "__main__":
    unittest.main()
'''

IMPORTS_FIX_NAME = '''\
import unittest

from sglang.srt.disaggregation.utils import DisaggregationMode, is_unadmitted_reject


class TestAdmissionAbortNotEnqueued(unittest.TestCase):
    def test_retracted_request_is_not_a_reject(self):
        self.assertFalse(is_unadmitted_reject({"to_finish": "abort", "is_retracted": True}))

    def test_rejected_request_is_a_reject(self):
        self.assertTrue(is_unadmitted_reject({"to_finish": "abort"}))
'''

NEWER_RUNTIME = '''\
import unittest
from unittest.mock import patch

from sglang.srt.disaggregation.utils import admit
from sglang.srt.managers.scheduler import Scheduler


class TestNeedsNewerCode(unittest.TestCase):
    def test_patches_a_function_the_tree_lacks(self):
        with patch("sglang.srt.disaggregation.utils.get_parallel", return_value=None):
            admit([], {})

    def test_calls_a_method_the_tree_lacks(self):
        Scheduler.retire_detached_session_slots(object())

    def test_valid_request_still_admitted(self):
        self.assertTrue(admit([], {}))
'''

NEWER_MODULE = '''\
import unittest

from sglang.srt.disaggregation.utils import is_unadmitted_reject
from sglang.srt.runtime_context import publish, reset_context


class TestWithRuntimeContext(unittest.TestCase):
    def test_anything(self):
        reset_context()
'''


class Handler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        if self.path.startswith("/truncated/"):
            self.send_response(200)
            self.send_header("Content-Type", "text/x-python")
            self.send_header("Content-Length", "5000")
            self.end_headers()
            self.wfile.write(b"import unittest\n")
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    """A real HTTP server on 127.0.0.1 serving `<root>/<rev>/<path>` like raw.githubusercontent.com."""
    root = tmp_path / "served"
    root.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    class Served:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"

        @staticmethod
        def put(path: str, text: str | bytes, rev: str = REV) -> None:
            target = root / rev / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode() if isinstance(text, str) else text)

    yield Served
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(path))
    monkeypatch.delenv(upstream_tests.BASE_URL_ENV, raising=False)
    return path / "upstream-tests"


@pytest.fixture
def closed_port_url():
    with contextlib.closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def serve_pack(server):
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)
    server.put(f"{UNIT}/test_admission_abort_not_enqueued.py", IMPORTS_FIX_NAME)
    server.put(f"{UNIT}/test_newer_runtime.py", NEWER_RUNTIME)


def by_nodeid(document: dict, tree: str) -> dict[str, dict]:
    (entry,) = [t for t in document["trees"] if t["tree"] == tree]
    return {test["nodeid"]: test for test in entry["tests"]}


def cache_files(cache_dir: Path) -> list[str]:
    if not cache_dir.exists():
        return []
    return sorted(str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*") if p.is_file())


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang-backport")
    sub = parser.add_subparsers(dest="command", required=True)
    cli_upstream.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


# ---- the differential result ---------------------------------------------------------------------


def test_fails_on_pristine_passes_on_patched(server, trees, series):
    serve_pack(server)
    refs = load_refs(series, ["pr38935"])
    document = run_upstream_tests([("pristine", trees["pristine"]), ("patched", trees["patched"])], refs,
                                  python=PYTHON, base_url=server.url)
    assert document["skipped"] is None
    behaviour = f"{UNIT}/test_admission_behaviour.py::TestAdmissionBehaviour"
    pristine, patched = by_nodeid(document, "pristine"), by_nodeid(document, "patched")

    assert pristine[f"{behaviour}::test_rejected_request_is_not_enqueued"]["outcome"] == "failed"
    assert "AssertionError" in pristine[f"{behaviour}::test_rejected_request_is_not_enqueued"]["reason"]
    assert patched[f"{behaviour}::test_rejected_request_is_not_enqueued"]["outcome"] == "passed"
    assert patched[f"{behaviour}::test_rejected_request_is_not_enqueued"]["reason"] is None
    for tree in (pristine, patched):
        assert tree[f"{behaviour}::test_valid_request_still_admitted"]["outcome"] == "passed"
        skipped = tree[f"{behaviour}::test_null_mode"]
        assert (skipped["outcome"], skipped["reason"]) == ("skipped", "NULL mode is deliberately untouched")

    # The fix's own name is missing on the pristine tree: the tree lacks the fix -> failed, not incompatible.
    whole = pristine[f"{UNIT}/test_admission_abort_not_enqueued.py"]
    assert whole["outcome"] == "failed"
    assert "sglang.srt.disaggregation.utils.is_unadmitted_reject" in whole["reason"]
    assert "which the fixes add" in whole["reason"]
    abort_cls = f"{UNIT}/test_admission_abort_not_enqueued.py::TestAdmissionAbortNotEnqueued"
    assert patched[f"{abort_cls}::test_rejected_request_is_a_reject"]["outcome"] == "passed"
    assert patched[f"{abort_cls}::test_retracted_request_is_not_a_reject"]["outcome"] == "passed"

    sha = hashlib.sha256(BEHAVIOUR.encode()).hexdigest()
    test = patched[f"{behaviour}::test_valid_request_still_admitted"]
    assert test == {"file": f"{UNIT}/test_admission_behaviour.py", "rev": REV, "sha256": sha,
                    "nodeid": f"{behaviour}::test_valid_request_still_admitted",
                    "outcome": "passed", "reason": None}
    assert set(document) >= {"trees", "skipped"}
    json.dumps(document)  # one JSON document


def test_incompatible_names_what_the_tree_lacks(server, trees, series):
    serve_pack(server)
    refs = load_refs(series, ["pr36988"])
    document = run_upstream_tests([("patched", trees["patched"])], refs, python=PYTHON, base_url=server.url)
    tests = by_nodeid(document, "patched")
    cls = f"{UNIT}/test_newer_runtime.py::TestNeedsNewerCode"
    patched_fn = tests[f"{cls}::test_patches_a_function_the_tree_lacks"]
    assert patched_fn["outcome"] == "incompatible"
    assert "sglang.srt.disaggregation.utils.get_parallel" in patched_fn["reason"]
    method = tests[f"{cls}::test_calls_a_method_the_tree_lacks"]
    assert method["outcome"] == "incompatible"
    assert "retire_detached_session_slots" in method["reason"]
    assert tests[f"{cls}::test_valid_request_still_admitted"]["outcome"] == "passed"


def test_whole_file_incompatible_when_it_needs_a_newer_module(server, trees):
    server.put(f"{UNIT}/test_runtime_context.py", NEWER_MODULE)
    ref = TestRef(f"{UNIT}/test_runtime_context.py", REV, "pr38935", frozenset({"is_unadmitted_reject"}))
    document = run_upstream_tests([("pristine", trees["pristine"]), ("patched", trees["patched"])], [ref],
                                  python=PYTHON, base_url=server.url)
    for label in ("pristine", "patched"):
        (only,) = by_nodeid(document, label).values()
        assert only["nodeid"] == ref.path
        assert only["outcome"] == "incompatible"
        assert "sglang.srt.runtime_context" in only["reason"]
    # On pristine the fix's own name is also missing; the file still cannot run there -> incompatible.
    (pristine,) = by_nodeid(document, "pristine").values()
    assert "is_unadmitted_reject" in pristine["reason"]


def test_an_unrelated_missing_name_is_incompatible_even_for_a_fix_test(server, trees):
    """Without the series' names every missing name is unrelated: never counted as passed."""
    server.put(f"{UNIT}/test_admission_abort_not_enqueued.py", IMPORTS_FIX_NAME)
    ref = TestRef(f"{UNIT}/test_admission_abort_not_enqueued.py", REV)
    document = run_upstream_tests([("pristine", trees["pristine"])], [ref], python=PYTHON, base_url=server.url)
    (only,) = by_nodeid(document, "pristine").values()
    assert only["outcome"] == "incompatible"
    assert "is_unadmitted_reject" in only["reason"]


def test_series_added_names_come_from_the_patches(series):
    names = upstream_tests.series_added_names(series)
    assert "is_unadmitted_reject" in names
    assert "admit" not in names  # a context line, not added


# ---- bad input and unreachable servers -----------------------------------------------------------


def test_404_is_a_per_file_error_and_bad_input_in_the_cli(server, trees, series, cache_dir):
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)  # the other two are missing
    refs = load_refs(series, ["pr38935"])
    document = run_upstream_tests([("patched", trees["patched"])], refs, python=PYTHON, base_url=server.url)
    missing = by_nodeid(document, "patched")[f"{UNIT}/test_admission_abort_not_enqueued.py"]
    assert missing["outcome"] == "error"
    assert "404" in missing["reason"] and REV in missing["reason"]
    assert missing["sha256"] is None
    assert cache_files(cache_dir) == sorted([f"{REV}/{UNIT}/test_admission_behaviour.py",
                                             f"{REV}/{UNIT}/test_admission_behaviour.py.sha256"])
    with pytest.raises(BadInput, match="404 Not Found"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--fix", "pr38935",
                 "--base-url", server.url, "--python", PYTHON])


def test_server_down_skips_with_a_reason(trees, series, closed_port_url, capsys, cache_dir):
    refs = load_refs(series)
    document = run_upstream_tests([("patched", trees["patched"])], refs, python=PYTHON,
                                  base_url=closed_port_url)
    assert document["trees"] == []
    assert "unreachable" in document["skipped"] and closed_port_url in document["skipped"]
    assert cache_files(cache_dir) == []

    code = run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--json",
                    "--base-url", closed_port_url, "--python", PYTHON])
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["skipped"] == document["skipped"]
    assert "section skipped" in err and "unreachable" in err


def test_env_var_base_url_and_cache_when_server_is_down(server, trees, closed_port_url, monkeypatch, cache_dir):
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)
    ref = TestRef(f"{UNIT}/test_admission_behaviour.py", REV)
    monkeypatch.setenv(upstream_tests.BASE_URL_ENV, server.url)
    first = Fetcher().fetch(ref)
    assert first.source == f"{server.url}/{REV}/{ref.path}" and first.error is None
    # Later the mirror is gone: the cached copy (recorded sha256) still runs.
    document = run_upstream_tests([("patched", trees["patched"])], [ref], python=PYTHON,
                                  base_url=closed_port_url)
    assert document["skipped"] is None
    assert document["files"][0]["source"] == "cache"
    outcomes = {t["outcome"] for t in document["trees"][0]["tests"]}
    assert outcomes == {"passed", "skipped"}


def test_html_page_instead_of_python_is_refused(server, cache_dir):
    server.put(f"{UNIT}/test_portal.py", "<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n")
    fetched = Fetcher(server.url).fetch(TestRef(f"{UNIT}/test_portal.py", REV))
    assert fetched.data is None
    assert fetched.error.endswith("the server returned an HTML page, not a Python file")
    assert "\n" not in fetched.error
    assert cache_files(cache_dir) == []


def test_file_that_does_not_parse_is_refused(server, trees, cache_dir):
    server.put(f"{UNIT}/test_broken.py", "import unittest\nclass TestX(unittest.TestCase:\n    pass\n")
    ref = TestRef(f"{UNIT}/test_broken.py", REV)
    document = run_upstream_tests([("patched", trees["patched"])], [ref], python=PYTHON, base_url=server.url)
    (only,) = document["trees"][0]["tests"]
    assert only["outcome"] == "error" and "does not parse as Python (line 2" in only["reason"]
    assert cache_files(cache_dir) == []


def test_cached_file_that_changed_upstream_is_refused(server, cache_dir):
    path = f"{UNIT}/test_admission_behaviour.py"
    server.put(path, BEHAVIOUR)
    ref = TestRef(path, REV)
    assert Fetcher(server.url).fetch(ref).sha256 == hashlib.sha256(BEHAVIOUR.encode()).hexdigest()
    server.put(path, BEHAVIOUR.replace("assertFalse", "assertTrue"))
    again = Fetcher(server.url).fetch(ref)
    assert again.data is None
    assert "content changed upstream" in again.error and "refusing" in again.error
    # The cache still holds the first content and its record.
    cached = cache_dir / REV / path
    assert cached.read_text() == BEHAVIOUR
    assert (cached.parent / (cached.name + ".sha256")).read_text().split()[0] == \
        hashlib.sha256(BEHAVIOUR.encode()).hexdigest()


def test_failed_download_leaves_nothing_half_written(server, cache_dir):
    ref = TestRef("x/test_cut.py", REV)
    fetched = Fetcher(f"{server.url}/truncated").fetch(ref)
    assert fetched.data is None and (fetched.error or fetched.unavailable)
    assert cache_files(cache_dir) == []
    # a corrupted cache file (no matching record) is replaced by a verified download
    server.put("x/test_ok.py", "import unittest\n")
    good = TestRef("x/test_ok.py", REV)
    Fetcher(server.url).fetch(good)
    (cache_dir / REV / "x/test_ok.py").write_text("tampered\n")
    refetched = Fetcher(server.url).fetch(good)
    assert refetched.error is None and refetched.data == b"import unittest\n"
    assert (cache_dir / REV / "x/test_ok.py").read_text() == "import unittest\n"
    assert not [p for p in cache_dir.rglob("*") if ".partial" in p.name]


@pytest.mark.parametrize("ref, message", [
    (TestRef("../../etc/passwd.py", REV), "repository-relative"),
    (TestRef("test/x.txt", REV), ".py file"),
    (TestRef("test/test_x.py", "main; rm -rf /"), "commit id"),
])
def test_malformed_refs_are_refused_before_any_request(ref, message, closed_port_url):
    fetched = Fetcher(closed_port_url).fetch(ref)
    assert message in fetched.error


def test_upstream_checkout_supplies_its_own_test_files(tmp_path, closed_port_url):
    checkout = tmp_path / "sglang-checkout"
    make_tree(checkout / "python", UTILS_PATCHED)
    test_file = checkout / UNIT / "test_admission_behaviour.py"
    test_file.parent.mkdir(parents=True)
    test_file.write_text(BEHAVIOUR)
    repo = git.Repo.init(checkout)
    repo.git.add("-A")
    with repo.git.custom_environment(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                                     GIT_COMMITTER_EMAIL="t@t"):
        repo.git.commit("-q", "-m", "upstream")
    rev = repo.head.commit.hexsha
    test_file.write_text("# a later local edit that must not be used\n")
    ref = TestRef(f"{UNIT}/test_admission_behaviour.py", rev)
    (fetched,) = fetch_refs([("checkout", checkout / "python")], [ref], base_url=closed_port_url)
    assert fetched.data == BEHAVIOUR.encode()
    assert fetched.source.startswith("git:") and rev in fetched.source
    document = run_upstream_tests([("checkout", checkout / "python")], [ref], python=PYTHON,
                                  base_url=closed_port_url, fetched=[fetched])
    assert {t["outcome"] for t in document["trees"][0]["tests"]} == {"passed", "skipped"}


# ---- the command ----------------------------------------------------------------------------------


def test_cli_json_and_exit_codes(server, trees, series, capsys):
    serve_pack(server)
    with pytest.raises(Finding, match="failed or errored"):
        run_cli(["upstream-tests", str(trees["pristine"]), str(trees["patched"]), "--series", str(series),
                 "--fix", "pr38935", "--base-url", server.url, "--python", PYTHON, "--json"])
    document = json.loads(capsys.readouterr().out)
    assert [t["tree"] for t in document["trees"]] == [str(trees["pristine"]), str(trees["patched"])]
    patched = document["trees"][1]["tests"]
    assert {t["outcome"] for t in patched} == {"passed", "skipped"}
    for test in patched:
        assert set(test) == {"file", "rev", "sha256", "nodeid", "outcome", "reason"}

    # Only the patched tree, human output: exit 0.
    code = run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--fix", "pr38935",
                    "--base-url", server.url, "--python", PYTHON])
    out = capsys.readouterr().out
    assert code == 0
    assert "test_rejected_request_is_not_enqueued" in out and "passed" in out


def test_cli_bad_input(trees, series, tmp_path, server):
    with pytest.raises(BadInput, match="not a fix"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--fix", "pr99999"])
    with pytest.raises(BadInput, match="not an SGLang tree"):
        run_cli(["upstream-tests", str(tmp_path), "--series", str(series)])
    with pytest.raises(BadInput, match="fixes.toml"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(tmp_path / "nowhere")])
    with pytest.raises(BadInput, match="needs --rev"):
        run_cli(["upstream-tests", str(trees["patched"]), "--test", f"{UNIT}/test_x.py"])
    with pytest.raises(BadInput, match="http"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series),
                 "--base-url", "ftp://example.invalid", "--python", PYTHON])
    with pytest.raises(BadInput, match="commit id"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--rev", "HEAD",
                 "--python", PYTHON, "--base-url", server.url])
