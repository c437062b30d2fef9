"""`audit`: the four operator gates, on documents real SGLang code builds, served over HTTP.

The fast tests drive the gate logic on small documents shaped like `/server_info` and on code
facts built directly; each fails if its rule breaks. The `probe_env` tests build the
`/server_info` documents with each tree's own code (`probes/runtime/server_info.py`: its ServerArgs,
worker and scheduler start-up report, and HTTP handler) in the CPU probe environment, serve them
from 127.0.0.1 and run `sglang-backport audit` on them, with the real trees as the code.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from backport.audit import gates
from backport.audit.code import CodeFacts, Setting, capable_backends, deferred_settings
from backport.audit.gates import FAIL, NOT_PROVEN, PASS, UNKNOWN, WARN
from backport.audit.report import exit_code, markdown, terminal
from backport.audit.servers import facts_from_documents, fetch_server
from backport.cli import main
from backport.engine import Detection
from backport.pack import load_pack

REPO = Path(__file__).resolve().parent.parent
PACK = load_pack(REPO / "patches")
INCIDENT_POOL, INCIDENT_CONTEXT, FIXED_POOL = 681_280, 1_048_576, 2_040_000


# ---- helpers ----------------------------------------------------------------------------------


def server_doc(mode="prefill", pool=FIXED_POOL, context=INCIDENT_CONTEXT, version="0.5.19", **extra):
    """The gate fields of a /server_info document (a full one has ~500 ServerArgs keys)."""
    doc = {"model_path": "m", "disaggregation_mode": mode, "disaggregation_transfer_backend": "mooncake",
           "max_total_num_tokens": pool, "max_req_input_len": 4096,
           "context_length": context, "page_size": 64, "version": version}
    doc.update(extra)
    return {k: v for k, v in doc.items() if v is not ...}


def facts(url="http://p:1", **kw):
    return facts_from_documents(url, "/server_info", server_doc(**kw), None)


def code_facts(version="0.5.19", missing=(), probes="safe", deferred=True, timeout=30.0,
               capable=("ascend", "mooncake", "nixl"), how="tree /t", coverage=None):
    detections = tuple(Detection(f, f not in missing, "fingerprint: test")
                       for f in ("pr36988", "pr38935", "pr35049", "pr37454", "pr40645", "pr41023",
                                 "pr41402", "pr41404"))
    detections += (Detection("sbp-transfer-coverage", coverage is not None, "fingerprint: test"),)
    cases = None if probes is None else {"cases": [
        {"probe": "admission", "case": "prefill_door_rejected_not_enqueued", "must_preserve": False,
         "observed": "o", "verdict": probes},
        {"probe": "admission", "case": "prefill_door_valid_admitted", "must_preserve": True,
         "observed": "o", "verdict": "safe"},
        {"probe": "prefill_retire", "case": "final_aborted_result_retired", "must_preserve": False,
         "observed": "o", "verdict": "safe"}]}
    return CodeFacts(how=how, package_root=Path("/t"), version=version, detections=detections,
                     probes=cases, probe_error=None if probes else "harness crashed", harness="test",
                     deferred_release=Setting("D", deferred, "test"), timeout=Setting("T", timeout, "test"),
                     capable_backends=capable, has_checksum_flag=False,
                     coverage_check=None if coverage is None else Setting("C", coverage, "test"))


@contextmanager
def serve(routes: dict[str, dict], seconds: float = 300):
    """A stdlib HTTP server on 127.0.0.1 answering GET path -> JSON; stops by itself after `seconds`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = routes.get(self.path)
            payload = json.dumps(body).encode() if body is not None else b'{"detail":"Not Found"}'
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    stop = threading.Timer(seconds, server.shutdown)
    stop.daemon = True
    stop.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop.cancel()
        server.shutdown()
        server.server_close()


def run_cli(args, capsys) -> tuple[int, dict]:
    code = main(["audit", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def gate(document: dict, number: int) -> dict:
    return next(g for g in document["gates"] if g["gate"] == number)


# ---- gate 1 -----------------------------------------------------------------------------------


def test_gate1_incident_pool_fails_with_both_numbers():
    result = gates.gate_pool_versus_context((facts(pool=INCIDENT_POOL), facts("http://d:2", mode="decode")))
    assert result.verdict == FAIL
    failing = [s for s in result.servers if s.verdict == FAIL]
    assert [s.url for s in failing] == ["http://p:1"]
    assert "681,280" in failing[0].evidence and "1,048,576" in failing[0].evidence
    assert result.servers[1].verdict == PASS


def test_gate1_fitting_pool_passes_and_equal_is_enough():
    assert gates.gate_pool_versus_context((facts(), facts("http://d:2", mode="decode"))).verdict == PASS
    assert gates.gate_pool_versus_context((facts(pool=INCIDENT_CONTEXT),)).verdict == PASS


@pytest.mark.parametrize("change, reason", [
    ({"pool": ...}, "max_total_num_tokens: missing"),
    ({"pool": "681280"}, "max_total_num_tokens: not an integer"),
    ({"context": None}, "context_length: not set"),
    ({"mode": ...}, "role unknown"),
])
def test_gate1_missing_fields_are_unknown_with_reason(change, reason):
    result = gates.gate_pool_versus_context((facts(**change),))
    assert result.verdict == UNKNOWN
    assert reason in result.servers[0].evidence


def test_gate1_context_from_model_info_when_server_args_leave_it_to_the_model():
    s = facts_from_documents("http://p:1", "/server_info", server_doc(context=None, pool=INCIDENT_POOL),
                             {"context_length": INCIDENT_CONTEXT})
    result = gates.gate_pool_versus_context((s,))
    assert result.verdict == FAIL and "/model_info context_length" in result.servers[0].evidence


def test_gate1_non_pd_node_small_pool_warns_not_fails():
    assert gates.gate_pool_versus_context((facts(mode="null", pool=INCIDENT_POOL),)).verdict == WARN


def test_gate1_without_servers_is_unknown():
    assert gates.gate_pool_versus_context(()).verdict == UNKNOWN


# ---- gate 2 -----------------------------------------------------------------------------------


def test_gate2_missing_fix_fails_and_names_the_backport_command():
    result = gates.gate_rejection_at_admission(
        code_facts(missing=("pr36988", "pr38935"), probes="unsafe"), PACK
    )
    assert result.verdict == FAIL
    assert "#36988" in result.remedy and "#38935" in result.remedy
    assert "sglang-backport run sglang==0.5.19" in result.remedy
    assert "sglang-backport run sglang==0.5.19 --export" in result.remedy
    assert "prefill node first" in result.remedy
    assert any("unsafe: admission/prefill_door_rejected_not_enqueued" in e for e in result.evidence)


def test_gate2_release_without_backport_says_upgrade():
    result = gates.gate_rejection_at_admission(code_facts(version="0.4.5", missing=("pr38935",)), PACK)
    assert result.verdict == FAIL and "upgrade to SGLang 0.5.22" in result.remedy


def test_gate2_present_but_probe_unsafe_fails():
    assert gates.gate_rejection_at_admission(code_facts(probes="unsafe"), PACK).verdict == FAIL
    assert gates.gate_rejection_at_admission(code_facts(probes="error"), PACK).verdict == FAIL


def test_gate2_passes_only_with_fingerprints_and_safe_probes():
    assert gates.gate_rejection_at_admission(code_facts(), PACK).verdict == PASS
    assert gates.gate_rejection_at_admission(code_facts(probes=None), PACK).verdict == UNKNOWN
    assert gates.gate_rejection_at_admission(code_facts(probes="not-applicable"), PACK).verdict == UNKNOWN
    assert gates.gate_rejection_at_admission(None, PACK).verdict == UNKNOWN


def test_gate2_code_other_than_what_the_server_runs_is_unknown():
    result = gates.gate_rejection_at_admission(code_facts(), PACK, (facts(version="0.5.20"),))
    assert result.verdict == UNKNOWN and any("runs sglang 0.5.20" in e for e in result.evidence)


# ---- gate 3 -----------------------------------------------------------------------------------


def test_gate3_checksum_on_both_sides_passes():
    pair = (facts(disaggregation_enable_kv_checksum=True),
            facts("http://d:2", mode="decode", disaggregation_enable_kv_checksum=True))
    assert gates.gate_transfer_covers_read(pair, None).verdict == PASS


def test_gate3_checksum_on_one_side_fails():
    pair = (facts(disaggregation_enable_kv_checksum=False),
            facts("http://d:2", mode="decode", disaggregation_enable_kv_checksum=True))
    result = gates.gate_transfer_covers_read(pair, None)
    assert result.verdict == FAIL and "passes silently" in result.servers[0].evidence


def test_gate3_release_without_checksum_warns_that_200_proves_nothing():
    pair = (facts(), facts("http://d:2", mode="decode"))
    result = gates.gate_transfer_covers_read(pair, None)
    assert result.verdict == WARN and NOT_PROVEN in result.evidence
    assert "has no --disaggregation-enable-kv-checksum" in result.servers[0].evidence


def test_gate3_only_one_side_given_is_not_a_pass():
    result = gates.gate_transfer_covers_read((facts(disaggregation_enable_kv_checksum=True),), None)
    assert result.verdict == UNKNOWN


def test_gate3_this_packs_coverage_check_passes_only_when_on_and_both_sides_run_the_code():
    pair = (facts(), facts("http://d:2", mode="decode"))
    on = gates.gate_transfer_covers_read(pair, code_facts(coverage=True))
    assert on.verdict == PASS and "transferred-coverage check is on" in on.evidence[0]
    assert NOT_PROVEN not in on.evidence
    assert gates.gate_transfer_covers_read(pair, code_facts(coverage=False)).verdict == WARN
    assert gates.gate_transfer_covers_read(pair[:1], code_facts(coverage=True)).verdict == UNKNOWN
    other = (facts(version="0.5.20"), facts("http://d:2", mode="decode"))
    assert gates.gate_transfer_covers_read(other, code_facts(coverage=True)).verdict == UNKNOWN
    one_sided = (facts(disaggregation_enable_kv_checksum=True),
                 facts("http://d:2", mode="decode", disaggregation_enable_kv_checksum=False))
    assert gates.gate_transfer_covers_read(one_sided, code_facts(coverage=True)).verdict == FAIL


# ---- gate 4 -----------------------------------------------------------------------------------

PAIR = (facts(), facts("http://d:2", mode="decode"))


def test_gate4_passes_with_fixes_default_on_capable_backend_both_sides():
    result = gates.gate_page_lifetime(code_facts(), PACK, PAIR)
    assert result.verdict == PASS
    assert any("timeout 30 s" in e and "does not prove" in e for e in result.evidence)


@pytest.mark.parametrize("kw, servers, verdict", [
    ({"missing": ("pr41404",)}, PAIR, FAIL),
    ({"deferred": False}, PAIR, FAIL),
    ({"deferred": None}, PAIR, UNKNOWN),
    ({"capable": ("nixl",)}, PAIR, FAIL),
    ({"capable": None}, PAIR, FAIL),
    ({"timeout": 0.0}, PAIR, WARN),
    ({}, PAIR[:1], UNKNOWN),
    ({}, (), UNKNOWN),
])
def test_gate4_each_condition(kw, servers, verdict):
    assert gates.gate_page_lifetime(code_facts(**kw), PACK, servers).verdict == verdict


def test_gate4_fails_on_mooncake_legacy_tcp_completion():
    """MC_TCP_PROTO=1: Mooncake calls a transfer complete once it left prefill's socket buffer; the live
    race showed the drain ACK then protects nothing (patched 0.5.19 and 0.5.22 unsafe)."""
    code = code_facts()
    code.extra["mooncake_tcp_proto"] = "1"
    result = gates.gate_page_lifetime(code, PACK, PAIR)
    assert result.verdict == FAIL
    assert any("MC_TCP_PROTO=1" in e and "drain ACK" in e for e in result.evidence)
    code.extra["mooncake_tcp_proto"] = "0"
    assert gates.gate_page_lifetime(code, PACK, PAIR).verdict == PASS


def test_gate4_missing_fix_names_the_command():
    result = gates.gate_page_lifetime(code_facts(missing=("pr41023",)), PACK, PAIR)
    assert "#41023" in result.remedy and "sglang-backport run sglang==0.5.19" in result.remedy


def test_capability_is_inherited_and_absent_attribute_means_none(tmp_path):
    disagg = tmp_path / "sglang" / "srt" / "disaggregation"
    for backend, body in {
        "base": "class BaseKVManager:\n    supports_deferred_decode_kv_release: bool = False\n",
        "mooncake": "class MooncakeKVManager(CommonKVManager):\n    supports_deferred_decode_kv_release = "
                    "True\n",
        "common": "class CommonKVManager(BaseKVManager):\n    pass\n",
        "ascend": "class AscendKVManager(MooncakeKVManager):\n    pass\n",
        "mori": "class MoriKVManager(CommonKVManager):\n    pass\n",
    }.items():
        (disagg / backend).mkdir(parents=True)
        (disagg / backend / "conn.py").write_text(body)
    assert capable_backends(tmp_path) == ("ascend", "mooncake")
    (disagg / "base" / "conn.py").write_text("class BaseKVManager:\n    pass\n")
    (disagg / "mooncake" / "conn.py").write_text("class MooncakeKVManager(CommonKVManager):\n    pass\n")
    assert capable_backends(tmp_path) is None


def test_deferred_setting_from_code_default_or_the_audit_environment(tmp_path):
    environ_py = tmp_path / "sglang" / "srt" / "environ.py"
    environ_py.parent.mkdir(parents=True)
    environ_py.write_text(
        "class Envs:\n    SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE = EnvBool(False)\n"
        "    SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT = EnvFloat(30.0)\n"
    )
    on, timeout = deferred_settings(tmp_path, {})
    assert on.value is False and "default" in on.source and timeout.value == 30.0
    on, timeout = deferred_settings(
        tmp_path,
        {
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5",
        },
    )
    assert on.value is True and timeout.value == 5.0 and "environment" in on.source


# ---- report, exit codes, HTTP, bad input --------------------------------------------------------


def test_unknown_exits_1_unless_allowed_and_is_never_shown_as_pass():
    results = gates.evaluate(None, (facts(),), PACK)
    assert exit_code(results) == 1 and exit_code(results, allow_unknown=True) == 0
    text = terminal(results)
    assert "overall: UNKNOWN" in text and "not verified: gate 2" in text
    assert "**unknown**" in markdown(results, None, (facts(),))
    assert exit_code(gates.evaluate(None, (facts(pool=INCIDENT_POOL),), PACK)) == 1


def test_fetch_falls_back_to_get_server_info_and_reads_model_info():
    with serve(
        {"/get_server_info": server_doc(context=None), "/model_info": {"context_length": 4096}}
    ) as url:
        s = fetch_server(url)
    assert s.endpoint == "/get_server_info" and s.context_length == 4096 and s.error is None


def test_unreachable_server_is_unknown_not_pass(capsys):
    with serve({}) as url:
        pass  # closed: nothing listens on that port any more
    code, document = run_cli(["--server", url], capsys)
    assert code == 1 and document["verdict"] == UNKNOWN and document["exit_code"] == 1
    code, allowed = run_cli(["--server", url, "--allow-unknown"], capsys)
    assert code == 0 and allowed["verdict"] == UNKNOWN and allowed["exit_code"] == 0
    assert all(gate(document, n)["verdict"] == UNKNOWN for n in (1, 2, 4))
    assert document["servers"][0]["error"]


@pytest.mark.parametrize("args, message", [
    ([], "nothing to audit"),
    (["--server", "ftp://h"], "not an http(s)"),
    (["/nonexistent-tree"], "not a directory"),
    (["--python", "/bin/true", "/tmp"], "not both"),
    (["--server", "http://h:1", "--server", "http://h:1"], "twice"),
])
def test_bad_input_exits_2_with_one_json_error(args, message, capsys):
    code, document = run_cli(args, capsys)
    assert code == 2 and message in document["error"]["message"] and document["error"]["code"] == 2


def test_bad_input_without_json_is_one_line(capsys):
    assert main(["audit", "--server", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--server nope" in err


# ---- the real thing: documents from each tree's own code ----------------------------------------


def build_server_info(python: str, tree: Path, *nodes: str, backend: str = "mooncake") -> list[dict]:
    """tests/server_info.py for one tree in the probe environment: one document per node."""
    from backport.probing.harness import probe_environ

    with tempfile.TemporaryDirectory(prefix="audit-probe-") as tmp:
        cmd = [python, str(REPO / "tests" / "server_info.py"), "--tree", str(tree), "--context-length",
               str(INCIDENT_CONTEXT), "--page-size", "64", "--backend", backend]
        for node in nodes:
            cmd += ["--node", node]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600, cwd=tmp,
                              env=probe_environ(python, tree))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return [n["server_info"] for n in json.loads(proc.stdout)["nodes"]]


def routes(info: dict) -> dict:
    return {"/server_info": info, "/get_server_info": info}


@pytest.fixture(scope="module")
def documents(probe_python, release_tree, patched_tree):
    """{(release, role, pool or tag): /server_info document} built by each tree's own code."""
    pristine19 = release_tree("0.5.19").package_root
    patched19 = patched_tree("0.5.19")[0].package_root
    tree22 = release_tree("0.5.22").package_root
    docs = {}
    a, b, c, d = build_server_info(probe_python, pristine19, f"prefill:{INCIDENT_POOL}",
                                   f"decode:{INCIDENT_POOL}", f"prefill:{FIXED_POOL}", f"decode:{FIXED_POOL}")
    docs.update({("0.5.19", "prefill", "incident"): a, ("0.5.19", "decode", "incident"): b,
                 ("0.5.19", "prefill", "fixed"): c, ("0.5.19", "decode", "fixed"): d})
    p, q = build_server_info(probe_python, patched19, f"prefill:{FIXED_POOL}", f"decode:{FIXED_POOL}")
    docs.update({("patched", "prefill", "fixed"): p, ("patched", "decode", "fixed"): q})
    r, s, t = build_server_info(probe_python, tree22, f"prefill:{FIXED_POOL}:kv-checksum",
                                f"decode:{FIXED_POOL}:kv-checksum", f"decode:{FIXED_POOL}")
    docs.update({("0.5.22", "prefill", "checksum"): r, ("0.5.22", "decode", "checksum"): s,
                 ("0.5.22", "decode", "no-checksum"): t})
    return docs


@pytest.mark.probe_env
def test_real_documents_carry_what_the_tree_computed(documents):
    incident = documents[("0.5.19", "prefill", "incident")]
    assert incident["max_total_num_tokens"] == INCIDENT_POOL
    assert incident["context_length"] == INCIDENT_CONTEXT and incident["version"] == "0.5.19"
    assert incident["max_req_input_len"] == INCIDENT_POOL - 6   # the tree's own min(context, pool) - 1 - 5
    assert "disaggregation_enable_kv_checksum" not in incident
    assert documents[("0.5.22", "decode", "checksum")]["disaggregation_enable_kv_checksum"] is True
    assert documents[("0.5.22", "decode", "no-checksum")]["disaggregation_enable_kv_checksum"] is False


@pytest.mark.probe_env
def test_audit_incident_configuration_fails_gate1_with_both_numbers(documents, capsys, tmp_path):
    report = tmp_path / "audit.md"
    with serve(routes(documents[("0.5.19", "prefill", "incident")])) as p, \
            serve(routes(documents[("0.5.19", "decode", "incident")])) as d:
        code, document = run_cli(["--server", p, "--server", d, "--report", str(report)], capsys)
    assert code == 1, document
    g1 = gate(document, 1)
    assert g1["verdict"] == FAIL
    assert {s["role"] for s in g1["servers"] if s["verdict"] == FAIL} == {"prefill", "decode"}
    assert all("681,280" in s["evidence"] and "1,048,576" in s["evidence"] for s in g1["servers"])
    assert "681,280" in report.read_text() and "Gate 1: pool versus context: fail" in report.read_text()


@pytest.mark.probe_env
def test_audit_patched_0519_with_fitting_pool_passes_1_2_4_and_warns_on_3(documents, patched_tree, capsys):
    tree = patched_tree("0.5.19")[0].path
    with serve(routes(documents[("patched", "prefill", "fixed")])) as p, \
            serve(routes(documents[("patched", "decode", "fixed")])) as d:
        code, document = run_cli([str(tree), "--server", p, "--server", d], capsys)
    verdicts = {g["gate"]: g["verdict"] for g in document["gates"]}
    # Gate 3's honest verdict: no release before 0.5.21 has the handoff checksum; it passes only
    # when the pack's own coverage check is in the patched tree (and on by default).
    coverage = next((f for f in document["code"]["fixes"] if f["fix"] == "sbp-transfer-coverage"), None)
    gate3 = PASS if coverage and coverage["present"] else WARN
    assert verdicts == {1: PASS, 2: PASS, 3: gate3, 4: PASS}, json.dumps(document["gates"], indent=1)
    assert code == 0
    if gate3 == WARN:
        assert NOT_PROVEN in gate(document, 3)["evidence"]
    else:
        assert "transferred-coverage check is on" in gate(document, 3)["evidence"][0]
    assert any("probe admission: " in e and "unsafe" not in e for e in gate(document, 2)["evidence"])


@pytest.mark.probe_env
def test_audit_pristine_0519_fails_gate2_and_names_fix_and_command(documents, release_tree, capsys):
    tree = release_tree("0.5.19").path
    with serve(routes(documents[("0.5.19", "prefill", "fixed")])) as p, \
            serve(routes(documents[("0.5.19", "decode", "fixed")])) as d:
        code, document = run_cli([str(tree), "--server", p, "--server", d], capsys)
    assert code == 1
    g2 = gate(document, 2)
    assert g2["verdict"] == FAIL and gate(document, 1)["verdict"] == PASS
    assert "#38935" in g2["remedy"] and "#36988" in g2["remedy"]
    assert "sglang-backport run sglang==0.5.19" in g2["remedy"]
    assert any(e.startswith("  unsafe: admission/") for e in g2["evidence"])
    assert gate(document, 4)["verdict"] == FAIL   # no page-lifetime fixes, default off


@pytest.mark.probe_env
def test_audit_0522_checksum_both_sides_passes_gate3_one_side_fails(documents, capsys):
    with serve(routes(documents[("0.5.22", "prefill", "checksum")])) as p, \
            serve(routes(documents[("0.5.22", "decode", "checksum")])) as d, \
            serve({"/get_server_info": documents[("0.5.22", "decode", "no-checksum")]}) as d2:
        _, both = run_cli(["--server", p, "--server", d], capsys)
        code, one = run_cli(["--server", p, "--server", d2], capsys)
    assert gate(both, 3)["verdict"] == PASS
    assert gate(one, 3)["verdict"] == FAIL and code == 1
    assert one["servers"][1]["endpoint"] == "/get_server_info"


def serving_python(tmp_path: Path, python: str, tree: Path) -> str:
    """An interpreter whose environment has `tree`'s sglang installed, as an operator's would."""
    exe = tmp_path / "serving-python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{tree}" exec {python} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.probe_env
@pytest.mark.parametrize("interpreter", ["operator-with-torch", "operator-without-torch"])
def test_audit_python_exe_finds_its_sglang_and_says_where_probes_ran(
        interpreter, patched_tree, probe_python, tmp_path, capsys):
    import sys

    tree = patched_tree("0.5.19")[0].package_root
    base = probe_python if interpreter == "operator-with-torch" else sys.executable  # the toolkit's: no torch
    exe = serving_python(tmp_path, base, tree)
    code, document = run_cli(["--python", exe], capsys)
    assert document["code"]["package_root"] == str(tree.resolve())
    assert gate(document, 2)["verdict"] == PASS, gate(document, 2)["evidence"]
    harness = document["code"]["harness"]
    if interpreter == "operator-with-torch":
        assert harness.startswith(f"the operator's interpreter {exe}")
    else:
        assert "cannot import torch" in harness and "alone on the path" in harness
    assert gate(document, 1)["verdict"] == UNKNOWN and code == 1  # unknown is never a pass


def test_audit_names_a_wheel_exported_by_the_toolkit(tmp_path, monkeypatch):
    """`--python EXE` whose sglang is an exported wheel: the audit says so, and whether the package
    installed is still the tree the wheel's record names (measured, not taken from the record)."""
    import json
    import sys

    from backport.audit.code import exported_wheel
    from backport.tree import tree_digest
    from tests.synthetic import write_tree

    site = write_tree(tmp_path / "site", "9.9.7")
    info = site / "sglang-9.9.7+backport.5.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.7+backport.5\n")
    (info / "sglang_backport.json").write_text(
        json.dumps({"spec": "sglang==9.9.7", "tree_digest": tree_digest(site), "patch_set_sha256": "cd" * 32})
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    found = exported_wheel(sys.executable, site)["exported_wheel"]
    assert found == {"version": "9.9.7+backport.5", "spec": "sglang==9.9.7", "patch_set_sha256": "cd" * 32,
                     "tree_digest_matches": True}
    (site / "sglang" / "__init__.py").write_text("# edited in place\n")
    assert exported_wheel(sys.executable, site)["exported_wheel"]["tree_digest_matches"] is False
    (info / "sglang_backport.json").unlink()
    assert exported_wheel(sys.executable, site) == {}


# ---- every non-pass gate names its way out and the command that re-checks it ---------------------


def audit_text(args, capsys) -> str:
    main(["audit", *args])
    return capsys.readouterr().out


def test_every_non_pass_gate_names_a_change_and_the_recheck_command(capsys):
    prefill = server_doc(pool=INCIDENT_POOL, mem_fraction_static=0.8)
    decode = server_doc(mode="decode", pool=INCIDENT_POOL)
    with serve({"/server_info": prefill}) as p, serve({"/server_info": decode}) as d:
        code, document = run_cli(["--server", p, "--server", d], capsys)
    assert code == 1
    recheck = f"re-check: `sglang-backport audit --server {p} --server {d}"
    for g in document["gates"]:
        assert g["verdict"] != PASS and recheck in g["remedy"], g
    g1 = gate(document, 1)["remedy"]
    assert "--context-length 681280" in g1 and "--mem-fraction-static (now 0.8)" in g1 and "1.54x" in g1
    g3 = gate(document, 3)["remedy"]
    assert "sglang-backport run sglang==0.5.19 --export" in g3 and "--disaggregation-enable-kv-checksum" in g3
    assert "--python EXE" in gate(document, 2)["remedy"] and "--python EXE`" in gate(document, 4)["remedy"]


def _remedy(number, code, servers):
    from types import SimpleNamespace

    from backport.audit.remedies import attach

    args = SimpleNamespace(tree="/t", python=None, server=[s.url for s in servers], live=None)
    results = attach(gates.evaluate(code, servers, PACK), code, servers, args)
    return next(g for g in results if g.gate == number)


def test_gate3_remedies_name_the_flag_or_the_environment_variable():
    one_sided = (facts(disaggregation_enable_kv_checksum=False),
                 facts("http://d:2", mode="decode", disaggregation_enable_kv_checksum=True))
    result = _remedy(3, None, one_sided)
    assert result.verdict == FAIL
    assert (
        "start http://p:1 with --disaggregation-enable-kv-checksum (it is on for http://d:2" in result.remedy
    )
    off = _remedy(3, code_facts(coverage=False), PAIR)
    assert off.verdict == WARN and "SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK=1" in off.remedy
    assert "re-check: `sglang-backport audit /t --server http://p:1 --server http://d:2`" in off.remedy


def test_gate4_remedies_name_the_environment_and_the_backend():
    result = _remedy(4, code_facts(deferred=False, capable=("nixl",)), PAIR)
    assert result.verdict == FAIL
    assert (
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 in the environment of every decode node"
        in result.remedy
    )
    assert "from mooncake to --disaggregation-transfer-backend nixl" in result.remedy
    assert (
        "re-check: `SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 sglang-backport audit /t"
        in result.remedy
    )
    assert _remedy(4, code_facts(), PAIR).remedy is None   # a pass needs no way out


def test_an_unreachable_server_is_named_once_in_full(capsys):
    with serve({}) as url:
        pass
    text = audit_text(["--server", url], capsys)
    assert text.count("connection refused") == 1 and f"server {url}: not read: " in text
    assert "not read (above)" in text
