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

from backport import cli, upstream
from backport.cli import upstream as cli_upstream
from backport.errors import BadInput
from backport.upstream import Fetcher, TestRef, fetch_refs, load_refs, run_upstream_tests

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
Last-Update: 2026-01-01
---
diff --git a/sglang/srt/disaggregation/utils.py b/sglang/srt/disaggregation/utils.py
--- a/sglang/srt/disaggregation/utils.py
+++ b/sglang/srt/disaggregation/utils.py
@@ -8,7 +8,13 @@ class DisaggregationMode(Enum):
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
'''  # noqa: W293 - a diff's blank context line is one space


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
    (root / "series").write_text("pr36988\npr38935\n")
    (root / "fixes.toml").write_text(textwrap.dedent(f'''\
        [[fix]]
        id = "pr38935"
        title = "Do not admit intake-rejected requests to a PD handoff"
        pr = 38935
        upstream_commit = "3f8eb35ead"
        upstream_tests = [
          {{ path = "{UNIT}/test_admission_behaviour.py", rev = "{REV}" }},
          {{ path = "{UNIT}/test_admission_abort_not_enqueued.py", rev = "{REV}" }},
        ]

        [[fix]]
        id = "pr36988"
        title = "Retire aborted disaggregated prefill results"
        pr = 36988
        upstream_commit = "febb360519"
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
    monkeypatch.delenv(upstream.BASE_URL_ENV, raising=False)
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


def test_whole_file_needing_a_newer_module_is_incompatible_unless_it_also_needs_the_fix(server, trees):
    server.put(f"{UNIT}/test_runtime_context.py", NEWER_MODULE)
    ref = TestRef(f"{UNIT}/test_runtime_context.py", REV, "pr38935", frozenset({"is_unadmitted_reject"}))
    document = run_upstream_tests([("pristine", trees["pristine"]), ("patched", trees["patched"])], [ref],
                                  python=PYTHON, base_url=server.url)
    (patched,) = by_nodeid(document, "patched").values()
    assert patched["nodeid"] == ref.path
    assert patched["outcome"] == "incompatible"
    assert "sglang.srt.runtime_context" in patched["reason"]
    assert "is_unadmitted_reject" not in patched["reason"]
    # On pristine the fix's own name is missing too: the tree lacks the fix, which is a failure
    # (never hidden behind the newer module it also lacks, which the reason still names).
    (pristine,) = by_nodeid(document, "pristine").values()
    assert pristine["outcome"] == "failed"
    assert (
        "lacks sglang.srt.disaggregation.utils.is_unadmitted_reject, which the fixes add"
        in pristine["reason"]
    )
    assert "also lacks sglang.srt.runtime_context" in pristine["reason"]


def test_an_unrelated_missing_name_is_incompatible_even_for_a_fix_test(server, trees):
    """Without the series' names every missing name is unrelated: never counted as passed."""
    server.put(f"{UNIT}/test_admission_abort_not_enqueued.py", IMPORTS_FIX_NAME)
    ref = TestRef(f"{UNIT}/test_admission_abort_not_enqueued.py", REV)
    document = run_upstream_tests(
        [("pristine", trees["pristine"])], [ref], python=PYTHON, base_url=server.url
    )
    (only,) = by_nodeid(document, "pristine").values()
    assert only["outcome"] == "incompatible"
    assert "is_unadmitted_reject" in only["reason"]


def test_series_added_names_come_from_the_patches(series):
    names = upstream.series_added_names(series)
    assert "is_unadmitted_reject" in names
    assert "admit" not in names  # a context line, not added


# ---- bad input and unreachable servers -----------------------------------------------------------


def test_404_is_that_files_outcome_and_the_others_still_run(server, trees, series, cache_dir, capsys):
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)  # the other two are missing
    refs = load_refs(series, ["pr38935"])
    document = run_upstream_tests([("patched", trees["patched"])], refs, python=PYTHON, base_url=server.url)
    missing = by_nodeid(document, "patched")[f"{UNIT}/test_admission_abort_not_enqueued.py"]
    assert missing["outcome"] == "unavailable"
    assert "404" in missing["reason"] and REV in missing["reason"] and "not fetched" in missing["reason"]
    assert missing["sha256"] is None
    # Unpinned: kept per server, revision and path.
    server_dir = f"servers/{Fetcher(server.url).server_key()}"
    assert cache_files(cache_dir) == sorted([f"{server_dir}/{REV}/{UNIT}/test_admission_behaviour.py",
                                             f"{server_dir}/{REV}/{UNIT}/test_admission_behaviour.py.sha256"])
    # The CLI runs the file it has and reports the missing ones with their reason (no exit 2).
    code = run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--fix", "pr38935",
                    "--base-url", server.url, "--python", PYTHON, "--json"])
    doc = json.loads(capsys.readouterr().out)
    outcomes = {t["file"].rsplit("/", 1)[-1]: t["outcome"] for t in doc["trees"][0]["tests"]}
    assert outcomes["test_admission_abort_not_enqueued.py"] == "unavailable"
    assert "passed" in {t["outcome"] for t in doc["trees"][0]["tests"] if t["file"].endswith("behaviour.py")}
    assert code == 0  # unavailable is not a pass, but not a failure of the tree either


def test_server_down_skips_with_a_reason(trees, series, closed_port_url, capsys, caplog, cache_dir):
    refs = load_refs(series)
    document = run_upstream_tests([("patched", trees["patched"])], refs, python=PYTHON,
                                  base_url=closed_port_url)
    assert document["trees"] == []
    assert "unreachable" in document["skipped"] and closed_port_url in document["skipped"]
    assert cache_files(cache_dir) == []

    code = run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--json",
                    "--base-url", closed_port_url, "--python", PYTHON])
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out)["skipped"] == document["skipped"]
    logged = [r for r in caplog.records if r.name == "backport.upstream"]
    assert any("section skipped" in r.getMessage() and "unreachable" in r.getMessage() for r in logged)


def test_env_var_base_url_and_cache_when_server_is_down(
    server, trees, closed_port_url, monkeypatch, cache_dir
):
    server.put(f"{UNIT}/test_admission_behaviour.py", BEHAVIOUR)
    ref = TestRef(f"{UNIT}/test_admission_behaviour.py", REV)
    monkeypatch.setenv(upstream.BASE_URL_ENV, server.url)
    first = Fetcher().fetch(ref)
    assert first.source == f"{server.url}/{REV}/{ref.path}" and first.error is None
    # Later that mirror is down: its cached copy (recorded sha256) still runs, recorded unpinned.
    down = Fetcher(server.url)
    down.unreachable = f"{server.url} is unreachable (Connection refused)"
    again = down.fetch(ref)
    assert again.source == "cache" and again.data == BEHAVIOUR.encode() and again.to_json()["pin"] is None
    # An unpinned copy is trusted for the server that served it only, never for another one.
    document = run_upstream_tests([("patched", trees["patched"])], [ref], python=PYTHON,
                                  base_url=closed_port_url)
    assert document["trees"] == [] and "unreachable" in document["skipped"]
    # A pinned copy is the file whichever server served it: offline, any copy matching the pin runs.
    pinned = TestRef(ref.path, REV, sha256=hashlib.sha256(BEHAVIOUR.encode()).hexdigest())
    assert Fetcher(server.url).fetch(pinned).source == f"{server.url}/{REV}/{ref.path}"
    document = run_upstream_tests([("patched", trees["patched"])], [pinned], python=PYTHON,
                                  base_url=closed_port_url)
    assert document["skipped"] is None
    assert document["files"][0]["source"] == "cache" and document["files"][0]["pin"] == pinned.sha256
    outcomes = {t["outcome"] for t in document["trees"][0]["tests"]}
    assert outcomes == {"passed", "skipped"}


def test_html_page_instead_of_python_is_refused(server, cache_dir):
    server.put(f"{UNIT}/test_portal.py", "<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n")
    fetched = Fetcher(server.url).fetch(TestRef(f"{UNIT}/test_portal.py", REV))
    assert fetched.data is None
    assert fetched.refused.endswith("the server returned an HTML page, not a Python file")
    assert "\n" not in fetched.refused
    assert cache_files(cache_dir) == []


def test_file_that_does_not_parse_is_refused(server, trees, cache_dir):
    server.put(f"{UNIT}/test_broken.py", "import unittest\nclass TestX(unittest.TestCase:\n    pass\n")
    ref = TestRef(f"{UNIT}/test_broken.py", REV)
    document = run_upstream_tests([("patched", trees["patched"])], [ref], python=PYTHON, base_url=server.url)
    (only,) = document["trees"][0]["tests"]
    assert only["outcome"] == "refused" and "does not parse as Python (line 2" in only["reason"]
    assert cache_files(cache_dir) == []


def test_cached_file_that_changed_upstream_is_refused(server, cache_dir):
    path = f"{UNIT}/test_admission_behaviour.py"
    server.put(path, BEHAVIOUR)
    ref = TestRef(path, REV)
    assert Fetcher(server.url).fetch(ref).sha256 == hashlib.sha256(BEHAVIOUR.encode()).hexdigest()
    server.put(path, BEHAVIOUR.replace("assertFalse", "assertTrue"))
    again = Fetcher(server.url).fetch(ref)
    assert again.data is None
    assert "content changed upstream" in again.refused and "refusing" in again.refused
    # The cache still holds the first content and its record.
    cached, _ = Fetcher(server.url).cache_paths(ref)
    assert cached.read_text() == BEHAVIOUR
    assert (cached.parent / (cached.name + ".sha256")).read_text().split()[0] == \
        hashlib.sha256(BEHAVIOUR.encode()).hexdigest()


def test_failed_download_leaves_nothing_half_written(server, cache_dir):
    ref = TestRef("x/test_cut.py", REV)
    fetched = Fetcher(f"{server.url}/truncated").fetch(ref)
    assert fetched.data is None and (fetched.error or fetched.unavailable or fetched.refused)
    assert cache_files(cache_dir) == []
    # a corrupted cache file (no matching record) is replaced by a verified download
    server.put("x/test_ok.py", "import unittest\n")
    good = TestRef("x/test_ok.py", REV)
    Fetcher(server.url).fetch(good)
    cached, _ = Fetcher(server.url).cache_paths(good)
    cached.write_text("tampered\n")
    refetched = Fetcher(server.url).fetch(good)
    assert refetched.error is None and refetched.data == b"import unittest\n"
    assert cached.read_text() == "import unittest\n"
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
    code = cli.main(["upstream-tests", str(trees["pristine"]), str(trees["patched"]), "--series", str(series),
                     "--fix", "pr38935", "--base-url", server.url, "--python", PYTHON, "--json"])
    out, err = capsys.readouterr()
    assert code == 1 and "failed, errored or were refused" in err
    document = json.loads(out)  # exactly one JSON document, the results
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
    with pytest.raises(BadInput, match=r"fixes.toml"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(tmp_path / "nowhere")])
    with pytest.raises(BadInput, match="needs --rev"):
        run_cli(["upstream-tests", str(trees["patched"]), "--test", f"{UNIT}/test_x.py"])
    with pytest.raises(BadInput, match="http"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series),
                 "--base-url", "ftp://example.invalid", "--python", PYTHON])
    with pytest.raises(BadInput, match="commit id"):
        run_cli(["upstream-tests", str(trees["patched"]), "--series", str(series), "--rev", "HEAD",
                 "--python", PYTHON, "--base-url", server.url])


# ---- issue 14: a fix's names in any form, and stale tests ------------------------------------------

BASE_CONN = '''\
class BaseKVManager:
    """The transfer backend's manager."""

    enable_deferred_decode_kv_release: bool = False
{capability}

class KVReceiver:
    def __init__(self, kv_mgr, room):
        self.kv_mgr = kv_mgr
        self.room = room

    def poll(self):
        self.kv_mgr.note_abort(self.room, "peer-0")
        return self.kv_mgr.transfer_state

    def ensure_abort_notified(self{keyword}):
        return True

    def abort(self):
        {abort}

    def flush(self):
        return self._drain(1, 2)  # a bug of the tree's own: never a stale test

    def _drain(self, n):
        return n
'''

DECODE_PRISTINE = '''\
def release(req, pool):
    pool.free(req)
'''

DECODE_PATCHED = '''\
def release(req, pool):
    pool.free(req)


def resolve_deferred_releases(pending, drained):
    return [room for room in pending if room in drained]
'''

CAPABILITY_PATCH = '''\
Description: capability flag for deferred decode KV release
Origin: upstream, https://github.com/sgl-project/sglang/pull/41023
Applies-To: >=0.5.19
Depends-On: none
Last-Update: 2026-01-01
---
diff --git a/sglang/srt/disaggregation/base/conn.py b/sglang/srt/disaggregation/base/conn.py
--- a/sglang/srt/disaggregation/base/conn.py
+++ b/sglang/srt/disaggregation/base/conn.py
@@ -2,6 +2,7 @@ class BaseKVManager:
     """The transfer backend's manager."""
 
     enable_deferred_decode_kv_release: bool = False
+    supports_deferred_decode_kv_release: bool = False
 
 
 class KVReceiver:
@@ -15,6 +16,6 @@ class KVReceiver:
         self.kv_mgr.note_abort(self.room, "peer-0")
         return self.kv_mgr.transfer_state
 
-    def ensure_abort_notified(self):
+    def ensure_abort_notified(self, *, force_arm: bool = False):
         return True
 
'''  # noqa: W293 - a diff's blank context line is one space


def make_kv_tree(root: Path, patched: bool) -> Path:
    make_tree(root, UTILS_PATCHED if patched else UTILS_PRISTINE)
    base = root / "sglang/srt/disaggregation/base"
    base.mkdir()
    (base / "__init__.py").write_text("")
    (base / "conn.py").write_text(BASE_CONN.format(
        capability="    supports_deferred_decode_kv_release: bool = False\n" if patched else "",
        keyword=", *, force_arm: bool = False" if patched else "",
        abort="self.kv_mgr.room = self.room" if patched else "pass"))
    (root / "sglang/srt/disaggregation/decode.py").write_text(DECODE_PATCHED if patched else DECODE_PRISTINE)
    return root


@pytest.fixture
def kv_trees(tmp_path):
    return {"pristine": make_kv_tree(tmp_path / "kv-pristine", False),
            "patched": make_kv_tree(tmp_path / "kv-patched", True)}


@pytest.fixture
def kv_pack(tmp_path):
    """pr41023 adds a class attribute and a keyword; pr35049 has no patch here, only its fingerprint."""
    root = tmp_path / "kv-pack"
    (root / "pr41023").mkdir(parents=True)
    (root / "pr41023" / "pr41023-0.5.19.patch").write_text(CAPABILITY_PATCH)
    (root / "series").write_text("pr35049\npr41023\n")
    (root / "fixes.toml").write_text(
        textwrap.dedent(f'''\
        [[fix]]
        id = "pr35049"
        title = "Deferred decode-side KV release for aborts mid-transfer"
        pr = 35049
        upstream_commit = "97dedd1ce9b161c476e0a91106857f210b5bfa41"
        fixed_in = ">=0.5.19"
        fingerprint = [
            {{ file = "sglang/srt/disaggregation/decode.py", pattern = "def resolve_deferred_releases\\\\(" }},
        ]
        upstream_tests = [{{ path = "{UNIT}/test_deferred_release.py", rev = "{REV}" }}]

        [[fix]]
        id = "pr41023"
        title = "Enable deferred decode-side KV release by default"
        pr = 41023
        upstream_commit = "cd1103700941a11901f12536a9a29bf1bd4417cd"
        upstream_tests = [{{ path = "{UNIT}/test_capability.py", rev = "{REV}" }}]
        ''')  # noqa: E501 - a TOML row as a pack writes it
    )
    return root


NEEDS_CLASS_ATTRIBUTE = '''\
import unittest

from sglang.srt.disaggregation.base.conn import BaseKVManager


class TestCapability(unittest.TestCase):
    def test_base_manager_does_not_claim_the_drain_ack(self):
        self.assertFalse(BaseKVManager.supports_deferred_decode_kv_release)
'''

NEEDS_FINGERPRINT_NAME = '''\
import unittest

from sglang.srt.disaggregation.decode import resolve_deferred_releases


class TestDeferredRelease(unittest.TestCase):
    def test_only_drained_rooms_are_released(self):
        self.assertEqual(resolve_deferred_releases([1, 2, 3], {2}), [2])
'''


def test_pack_names_in_every_form(kv_pack):
    from backport.upstream.names import fingerprint_names, pack_fix_names
    from backport.upstream.refs import load_pack

    names = pack_fix_names(load_pack(kv_pack))
    assert {"supports_deferred_decode_kv_release", "force_arm", "resolve_deferred_releases"} <= names
    assert (
        not {"enable_deferred_decode_kv_release", "ensure_abort_notified", "self", "bool"} & names
    )  # context
    assert fingerprint_names(r"^\s+enable_x: bool = False") == {"enable_x"}
    assert fingerprint_names(r"self\.kv_mgr\._maybe_ack\(self\.room\)") == {"kv_mgr", "_maybe_ack", "room"}


def test_missing_class_attribute_and_fingerprint_fixes_are_failed_with_exit_1(
    server, kv_trees, kv_pack, capsys
):
    server.put(f"{UNIT}/test_capability.py", NEEDS_CLASS_ATTRIBUTE)
    server.put(f"{UNIT}/test_deferred_release.py", NEEDS_FINGERPRINT_NAME)
    code = cli.main(["upstream-tests", str(kv_trees["pristine"]), str(kv_trees["patched"]), "--series",
                     str(kv_pack), "--base-url", server.url, "--python", PYTHON, "--json"])
    assert code == 1
    document = json.loads(capsys.readouterr().out)
    pristine = by_nodeid(document, str(kv_trees["pristine"]))
    patched = by_nodeid(document, str(kv_trees["patched"]))
    attribute = f"{UNIT}/test_capability.py::TestCapability::test_base_manager_does_not_claim_the_drain_ack"
    assert pristine[attribute]["outcome"] == "failed"
    assert (
        "BaseKVManager.supports_deferred_decode_kv_release, which the fixes add"
        in pristine[attribute]["reason"]
    )
    whole = pristine[f"{UNIT}/test_deferred_release.py"]
    assert whole["outcome"] == "failed"
    assert "resolve_deferred_releases, which the fixes add" in whole["reason"]
    assert {t["outcome"] for t in patched.values()} == {"passed"}


STALE_STAND_INS = '''\
import unittest

from sglang.srt.disaggregation.base.conn import KVReceiver


class FakeKVManager:
    """Stands in for the transfer backend as it was when the test was written."""

    def note_abort(self, room):
        self.noted = room


class FakeKVManagerWithState(FakeKVManager):
    def note_abort(self, room, peer):
        self.noted = room


class FailingKVManager:
    def note_abort(self, room, peer):
        raise RuntimeError("transfer failed")


class TestReceiver(unittest.TestCase):
    def test_stand_in_signature_is_older_than_the_release(self):
        KVReceiver(FakeKVManager(), 7).poll()

    def test_stand_in_lacks_an_attribute_the_release_reads(self):
        KVReceiver(FakeKVManagerWithState(), 7).poll()

    def test_a_stand_in_raising_on_purpose_is_behaviour(self):
        KVReceiver(FailingKVManager(), 7).poll()

    def test_abort_hands_the_room_back_to_the_manager(self):
        manager = FakeKVManager()
        KVReceiver(manager, 7).abort()
        self.assertEqual(manager.room, 7)

    def test_flush(self):
        KVReceiver(FakeKVManager(), 7).flush()

    def test_keyword_the_fix_adds(self):
        self.assertTrue(KVReceiver(FakeKVManager(), 7).ensure_abort_notified(force_arm=True))

    def test_keyword_newer_than_the_release(self):
        self.assertTrue(KVReceiver(FakeKVManager(), 7).ensure_abort_notified(urgent=True))
'''


def test_stale_tests_are_kept_apart_from_failures(server, kv_trees, kv_pack, capsys):
    server.put(f"{UNIT}/test_receiver.py", STALE_STAND_INS)
    code = cli.main(["upstream-tests", str(kv_trees["pristine"]), str(kv_trees["patched"]), "--series",
                     str(kv_pack), "--test", f"{UNIT}/test_receiver.py", "--rev", REV,
                     "--base-url", server.url, "--python", PYTHON, "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 1  # the raising stand-in and the missing keyword are real failures
    cls = f"{UNIT}/test_receiver.py::TestReceiver"
    for label in ("pristine", "patched"):
        tests = by_nodeid(document, str(kv_trees[label]))
        signature = tests[f"{cls}::test_stand_in_signature_is_older_than_the_release"]
        assert signature["outcome"] == "stale-test"
        assert "stand-in FakeKVManager.note_abort does not take the call made at " \
               "sglang/srt/disaggregation/base/conn.py:" in signature["reason"]
        attribute = tests[f"{cls}::test_stand_in_lacks_an_attribute_the_release_reads"]
        assert attribute["outcome"] == "stale-test"
        assert "stand-in FakeKVManagerWithState has no transfer_state" in attribute["reason"]
        raising = tests[f"{cls}::test_a_stand_in_raising_on_purpose_is_behaviour"]
        assert (raising["outcome"], raising["reason"]) == ("failed", "RuntimeError: transfer failed")
        newer = tests[f"{cls}::test_keyword_newer_than_the_release"]
        assert newer["outcome"] == "stale-test"
        assert "calls KVReceiver.ensure_abort_notified with a signature this release does not have" \
               in newer["reason"]
        flush = tests[f"{cls}::test_flush"]
        assert (flush["outcome"], flush["reason"]) == (
            "failed", "TypeError: KVReceiver._drain() takes 2 positional arguments but 3 were given")
    # The test reading its own stand-in for what the fix's code sets there: a failure, not stale.
    handed = f"{cls}::test_abort_hands_the_room_back_to_the_manager"
    assert by_nodeid(document, str(kv_trees["patched"]))[handed]["outcome"] == "passed"
    assert by_nodeid(document, str(kv_trees["pristine"]))[handed]["outcome"] == "failed"
    keyword = f"{cls}::test_keyword_the_fix_adds"
    assert by_nodeid(document, str(kv_trees["patched"]))[keyword]["outcome"] == "passed"
    missing = by_nodeid(document, str(kv_trees["pristine"]))[keyword]
    assert missing["outcome"] == "failed"
    assert "has no keyword force_arm, which the fixes add" in missing["reason"]


def test_only_stale_tests_exit_0_and_are_never_counted_as_passed(server, kv_trees, kv_pack, capsys):
    only_stale = STALE_STAND_INS.split("    def test_stand_in_lacks")[0]
    server.put(f"{UNIT}/test_stale_only.py", only_stale)
    code = cli.main(["upstream-tests", str(kv_trees["patched"]), "--series", str(kv_pack),
                     "--test", f"{UNIT}/test_stale_only.py", "--rev", REV,
                     "--base-url", server.url, "--python", PYTHON])
    out = capsys.readouterr().out
    assert code == 0
    assert out.rstrip().endswith(f"{kv_trees['patched']}: 1 stale-test")


NEEDS_A_COORDINATOR = '''\
import unittest
from unittest.mock import MagicMock

from sglang.srt.disaggregation.base.conn import KVReceiver


class TestBeamGroups(unittest.TestCase):
    def test_abort_retires_the_beam_group(self):
        coordinator = MagicMock()
        receiver = KVReceiver(MagicMock(), 7)
        receiver.coordinator = coordinator
        receiver.abort()
        coordinator.retire_group.assert_called_once_with(7)
'''


def test_a_mock_the_tree_never_calls_because_it_has_no_such_code_is_incompatible(server, kv_trees):
    server.put(f"{UNIT}/test_beam_groups.py", NEEDS_A_COORDINATOR)
    ref = TestRef(
        f"{UNIT}/test_beam_groups.py", REV, None, frozenset({"supports_deferred_decode_kv_release"})
    )
    document = run_upstream_tests(
        [("patched", kv_trees["patched"])], [ref], python=PYTHON, base_url=server.url
    )
    (only,) = by_nodeid(document, "patched").values()
    assert only["outcome"] == "incompatible"
    assert only["reason"].startswith(
        "the tree has no retire_group: the test needs code this tree does not have"
    )
    # The same expectation on a name a fix adds is the fix missing.
    named = TestRef(ref.path, REV, None, frozenset({"retire_group"}))
    document = run_upstream_tests(
        [("patched", kv_trees["patched"])], [named], python=PYTHON, base_url=server.url
    )
    (only,) = by_nodeid(document, "patched").values()
    assert only["outcome"] == "failed" and "lacks retire_group, which the fixes add" in only["reason"]
