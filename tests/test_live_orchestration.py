"""The live tier's process handling, with no SGLang server: small Python processes stand in for one.

A "server" here is `python -m http.server` in a folder holding a file named `health` (so GET
/health answers 200), or a script that ignores SIGTERM and forks a listening child, as
`launch_server` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from backport.cli import main
from backport.evidence import live as live_evidence
from backport.live.servers import (
    Processes,
    ServerDidNotStart,
    free_port,
    group_members,
    listening_pids,
    wait_ready,
)
from backport.records import LiveResult, ScenarioResult
from backport.vocab import TreeVerdict

REPO = Path(__file__).resolve().parent.parent

# A stubborn server: ignores SIGTERM, forks a child that listens on PORT and ignores SIGTERM too.
STUBBORN = textwrap.dedent("""
    import os, signal, socket, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.fork() == 0:
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
        while True:
            time.sleep(1)
    while True:
        time.sleep(1)
""")


def _http_server(tmp_path: Path, port: int) -> list[str]:
    (tmp_path / "health").write_text("ok")
    return [
        sys.executable,
        "-m",
        "http.server",
        str(port),
        "--bind",
        "127.0.0.1",
        "--directory",
        str(tmp_path),
    ]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie holds nothing


def _group_alive(pgid: int) -> bool:
    return bool(group_members({pgid}))


def test_free_port_leaves_room_for_the_derived_grpc_port():
    """0.5.13+ refuse to start when --port + 10000 passes 65535: every port handed out stays below."""
    from backport.live.servers import HIGHEST_SERVER_PORT

    ports = [free_port() for _ in range(200)]
    assert max(ports) <= HIGHEST_SERVER_PORT == 55535


def test_free_port_is_bindable_and_skips_busy_ports():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = {free_port() for _ in range(5)}
        assert taken not in ports
    port = ports.pop()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_ready_server_is_polled_and_stopped(tmp_path):
    port = free_port()
    with Processes(tmp_path) as processes:
        server = processes.start("fake", _http_server(tmp_path, port), url=f"http://127.0.0.1:{port}",
                                 env=dict(os.environ))
        seconds = wait_ready([server], "/health", timeout=30)
        assert seconds < 30 and server.alive()
        pid = server.process.pid
    assert _gone(pid)
    assert not listening_pids({pid})


def test_server_that_exits_is_one_line_with_its_log_tail(tmp_path):
    argv = [
        sys.executable,
        "-c",
        "import sys; print('loading weights'); print('RuntimeError: no CUDA'); sys.exit(3)",
    ]
    with Processes(tmp_path) as processes:
        server = processes.start("prefill", argv, url=f"http://127.0.0.1:{free_port()}", env=dict(os.environ))
        with pytest.raises(ServerDidNotStart) as raised:
            wait_ready([server], "/health", timeout=30)
    message = str(raised.value)
    assert message.splitlines()[0].startswith("prefill server exited with code 3 before it was ready")
    assert "RuntimeError: no CUDA" in message


def test_server_not_ready_in_time_is_reported(tmp_path):
    argv = [sys.executable, "-c", "import time; print('still importing', flush=True); time.sleep(60)"]
    with Processes(tmp_path) as processes:
        server = processes.start("decode", argv, url=f"http://127.0.0.1:{free_port()}", env=dict(os.environ))
        with pytest.raises(ServerDidNotStart, match="decode server not ready after 2 s"):
            wait_ready([server], "/health", timeout=2)
        pid = server.process.pid
    assert _gone(pid)


def test_stubborn_group_is_killed(tmp_path):
    """SIGTERM ignored by the server and its child: the whole group still goes, nothing listens."""
    port = free_port()
    with Processes(tmp_path) as processes:
        server = processes.start("stubborn", [sys.executable, "-c", STUBBORN, str(port)],
                                 url=f"http://127.0.0.1:{port}", env=dict(os.environ))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        group = server.process.pid
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert not _group_alive(group)


DRIVER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from backport.live.servers import Processes, sigterm_raises
    work, ports = Path(sys.argv[1]), sys.argv[2:]
    with sigterm_raises(), Processes(work) as processes:
        pids = [processes.start(f"s{i}", [sys.executable, "-c", sys.stdin.read() if i == 0 else STUB, p],
                                url="", env=None).process.pid for i, p in enumerate(ports)]
        print(json.dumps(pids), flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("signals", [(signal.SIGINT,), (signal.SIGINT, signal.SIGINT), (signal.SIGTERM,)],
                         ids=["sigint", "second-ctrl-c", "sigterm"])
def test_signal_mid_run_leaves_no_process_or_listener(tmp_path, signals):
    ports = [str(free_port()), str(free_port())]
    driver = DRIVER.replace("sys.stdin.read() if i == 0 else STUB", "STUB").replace(
        "from pathlib import Path", f"from pathlib import Path\nSTUB = {STUBBORN!r}")
    proc = subprocess.Popen([sys.executable, "-c", driver, str(tmp_path), *ports], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pids = json.loads(proc.stdout.readline())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(_listening(int(p)) for p in ports):
            time.sleep(0.1)
        assert all(_listening(int(p)) for p in ports)
        for sig in signals:
            proc.send_signal(sig)
            time.sleep(0.3)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert all(_gone(pid) for pid in pids)
    assert not any(_listening(int(p)) for p in ports)
    assert not any(_group_alive(pid) for pid in pids)


def test_sigterm_is_named_as_sigterm_not_as_ctrl_c():
    """A SIGTERM of `live` or `run --live` unwinds like Ctrl-C but the CLI names it (exit 143):
    it once surfaced as KeyboardInterrupt, "interrupted by SIGINT", exit 130."""
    from backport.errors import Interrupted
    from backport.live.servers import sigterm_raises

    with pytest.raises(Interrupted) as caught, sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode; never reached
    assert caught.value.signum == signal.SIGTERM
    assert not isinstance(caught.value, KeyboardInterrupt)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_live_cli_refuses_bad_input_before_starting_anything(tmp_path, capsys):
    assert main(["live", str(tmp_path / "missing"), "--json"]) == 2
    document = json.loads(capsys.readouterr().out)
    assert document["error"]["code"] == 2


def test_audit_live_refuses_a_bad_url_and_count(capsys):
    assert main(["audit", "--live", "ftp://x", "--json"]) == 2
    assert main(["audit", "--live", "http://127.0.0.1:1", "--live-count", "50", "--json"]) == 2
    capsys.readouterr()


# ---- predicate.live from live documents (no server) --------------------------------------------------


def _doc(verdicts: dict[str, str]) -> LiveResult:
    return LiveResult("t", "0.5.19", 1.0, {"version": "0.5.19", "router": "smg==1.13.0"},
                      tuple(ScenarioResult(name, name.startswith("valid"), "", TreeVerdict(v), "")
                            for name, v in verdicts.items()))


def test_live_section_pairs_and_summary():
    docs = {
        "pristine": _doc({"valid_prompt_matches_reference": "safe", "over_pool_prompt_rejected": "unsafe"}),
        "patched": _doc({"valid_prompt_matches_reference": "safe", "over_pool_prompt_rejected": "safe"}),
        "reference": _doc({"valid_prompt_matches_reference": "safe", "over_pool_prompt_rejected": "safe"}),
    }
    section = live_evidence.section(docs)
    assert [(r["scenario"], r["pair"], r["reference_agrees"]) for r in section["scenarios"]] == [
        ("valid_prompt_matches_reference", "held", True), ("over_pool_prompt_rejected", "fixed", True)]
    assert live_evidence.fold_summary({"result": "pass"}, section)["result"] == "pass"
    assert not live_evidence.section_problems(section)
    docs["patched"] = _doc({"valid_prompt_matches_reference": "safe", "over_pool_prompt_rejected": "unsafe"})
    still = live_evidence.section(docs)
    folded = live_evidence.fold_summary({"result": "pass"}, still)
    assert folded["result"] == "fail"
    assert folded["live"]["findings"] == [{"scenario": "over_pool_prompt_rejected", "pair": "still-unsafe",
                                           "must_preserve": False}]
    still["scenarios"][1]["pair"] = "fixed"  # a receipt edited by hand
    assert "does not follow" in live_evidence.section_problems(still)[0]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


HOLDS_ON = "    SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE = EnvBool(True)\n"
IDLE_COUNTS_HOLDS = (
    "                idle &= not self.disagg_decode_transfer_queue.has_pending_deferred_releases()\n"
)


@pytest.mark.parametrize("environ, scheduler, hazard", [
    (HOLDS_ON, "", True),                      # 0.5.21, 0.5.22: holds by default, idle check blind to them
    (HOLDS_ON, IDLE_COUNTS_HOLDS, False),      # 0.5.23, or sbp-flush-holds applied
    (HOLDS_ON.replace("True", "False"), "", False),  # 0.5.19, 0.5.20: no hold unless asked for
    ("", "", False),                           # no deferral at all
])
def test_a_tree_whose_flush_frees_held_pages_is_read_from_its_code(tmp_path, environ, scheduler, hazard):
    from backport.live.deployment import flush_frees_held_pages

    root = _package(
        tmp_path, {"sglang/srt/environ.py": environ, "sglang/srt/managers/scheduler.py": scheduler}
    )
    assert flush_frees_held_pages(root) is hazard


def test_decode_gets_the_retraction_backup_option_only_where_the_release_defines_it(tmp_path):
    from backport.live.deployment import DECODE_FLAGS, RETRACTION_BACKUP_FLAGS, decode_flags

    old = _package(tmp_path / "old", {"sglang/srt/server_args.py": "class ServerArgs: pass\n"})
    new = _package(
        tmp_path / "new", {"sglang/srt/configs/disagg.py": "disaggregation_decode_retraction_backup: str\n"}
    )
    assert decode_flags(old) == DECODE_FLAGS
    assert decode_flags(new) == DECODE_FLAGS + RETRACTION_BACKUP_FLAGS


def test_one_invocation_deploys_the_reference_once(monkeypatch, tmp_path):
    """`run A B --live`: every target names the same reference tree (same digest), so its
    deployment runs for the first target only; a reference scenario that broke runs again."""
    import backport.live as live_pkg
    from backport.evidence import TreeInput
    from backport.job import live as job_live

    served: list[list[str]] = []

    def fake_run_live(env, model, trees):
        served.append([role for role, _, _ in trees])
        verdict = "error" if len(served) == 1 and trees[-1][0] == "reference" and breaks else "safe"
        row = ScenarioResult("s", False, "", TreeVerdict(verdict), "")
        return [LiveResult(role, "0.5.19", 1.0, {}, (row,)) for role, _, _ in trees]

    monkeypatch.setattr(job_live, "_REFERENCE_RUNS", {})
    monkeypatch.setattr(
        live_pkg, "ensure_serving_env", lambda python: type("Env", (), {"python": "/srv/python"})
    )
    monkeypatch.setattr(live_pkg, "ensure_model", lambda python: None)
    monkeypatch.setattr(live_pkg, "run_live", fake_run_live)

    def trees(version, ref_digest="d" * 64):
        return {role: TreeInput(role, f"sglang=={v}", v, digest, package_root=tmp_path / role)
                for role, v, digest in (("pristine", version, "a" * 64), ("patched", version, "b" * 64),
                                        ("reference", "0.5.22", ref_digest))}

    breaks = True
    first = job_live.live_documents(trees("0.5.19"), None)
    second = job_live.live_documents(trees("0.5.20"), None)  # the broken reference run is not reused
    third = job_live.live_documents(trees("0.5.21"), None)
    fourth = job_live.live_documents(trees("0.5.21", ref_digest="e" * 64), None)  # another reference tree
    assert served == [["pristine", "patched", "reference"], ["pristine", "patched", "reference"],
                      ["pristine", "patched"], ["pristine", "patched", "reference"]]
    assert first["reference"].scenarios[0].verdict == "error"
    assert third["reference"] is second["reference"] and list(third) == ["pristine", "patched", "reference"]
    assert fourth["reference"] is not second["reference"]
