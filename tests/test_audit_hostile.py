"""`audit --server` and `audit --live` against small hostile HTTP servers on 127.0.0.1.

Each server is http.server in a thread, bound to 127.0.0.1 and stopped (its handlers too) when
its test ends. Each test asserts the verdict and that the audit ended within its bound. A guard
on socket.connect fails any test whose audit would contact an address outside loopback.
"""

from __future__ import annotations

import json
import re
import resource
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from backport.cli import main

POOL, CONTEXT, MAX_INPUT = 256, 1024, 250


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Imports and the pack loaded once, so each test's elapsed time is the audit's own (on a loaded
    2-core machine the first import costs seconds)."""
    from backport.audit import command, fetch, live, remedies  # noqa: F401

    command._pack(None)


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch):
    """Every connection the audit makes stays on loopback (a redirect followed would show here)."""
    contacted = []
    connect = socket.socket.connect

    def guarded(sock, address):
        host = address[0] if isinstance(address, tuple) else str(address)
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not (
            host.startswith("127.") or host == "::1"
        ):
            contacted.append(host)
            raise OSError(f"test guard: {host} is not loopback")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
    assert contacted == [], f"the audit contacted {contacted}"


class Server:
    """One hostile server: `handle(server, request)` answers every GET and POST; `seen` records
    (method, path, Authorization) of each request."""

    def __init__(self, handle):
        self.handle, self.seen, self.stopping = handle, [], threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.seen.append((self.command, self.path, self.headers.get("Authorization")))
                try:
                    outer.handle(outer, self)
                except OSError:   # the audit hung up: what a bounded client does
                    pass

            do_POST = do_GET

            def log_message(self, *args):
                pass

        class Listener(ThreadingHTTPServer):
            request_queue_size = 256   # many workers connect at once

        self.httpd = Listener(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def posts(self) -> list[str]:
        return [path for method, path, _ in self.seen if method == "POST"]


@contextmanager
def hostile(handle):
    server = Server(handle)
    server.thread.start()
    try:
        yield server
    finally:
        server.stopping.set()       # wakes every silent or dripping handler
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(5)


def send(request, status: int, body, headers: dict | None = None) -> None:
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    request.send_response(status)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(payload)))
    for key, value in (headers or {}).items():
        request.send_header(key, value)
    request.end_headers()
    request.wfile.write(payload)


def prefill_info(pool=POOL, context=CONTEXT) -> dict:
    return {
        "model_path": "m",
        "disaggregation_mode": "prefill",
        "disaggregation_transfer_backend": "mooncake",
        "max_total_num_tokens": pool,
        "max_req_input_len": min(pool, context) - 6,
        "context_length": context,
        "page_size": 1,
        "version": "0.5.19",
    }


def prompt_length(request) -> int:
    size = int(request.headers.get("Content-Length", 0))
    return len(json.loads(request.rfile.read(size))["input_ids"])


def router(generate, info=None, key=None):
    """A router whose one worker is itself: /workers, /server_info, and /generate -> generate(n)."""
    def handle(server, request):
        if key and request.headers.get("Authorization") != f"Bearer {key}":
            return send(request, 401, {"error": "Unauthorized"})
        if request.path == "/workers":
            return send(request, 200, {"workers": [{"url": server.url}]})
        if request.path == "/server_info":
            return send(request, 200, info or prefill_info())
        if request.path == "/generate":
            return send(request, *generate(prompt_length(request)))
        return send(request, 404, {"detail": "Not Found"})
    return handle


def sglang_like(n: int):
    """0.5.22: a prompt that fits is served, a longer one refused by the length check."""
    if n < MAX_INPUT:
        return 200, {"output_ids": [1, 2, 3, 4], "meta_info": {"prompt_tokens": n}}
    return 400, {"error": {"message": f"Input length ({n} tokens) exceeds the maximum allowed length "
                                      f"({MAX_INPUT} tokens)."}}


def audit(*args) -> tuple[int, dict, float]:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    started = time.monotonic()
    with redirect_stdout(out):
        code = main(["audit", *args, "--json"])
    return code, json.loads(out.getvalue()), time.monotonic() - started


def gate(document: dict, number: int) -> dict:
    return next(g for g in document["gates"] if g["gate"] == number)


def text(g: dict) -> str:
    return "\n".join(g["evidence"])


# ---- gate 2 judges only what it saw ---------------------------------------------------------------


def test_a_router_that_rejects_by_length_passes_gate2():
    with hostile(router(sglang_like)) as r:
        code, document, seconds = audit("--live", r.url, "--live-count", "2")
    g2 = gate(document, 2)
    assert g2["verdict"] == "pass", g2
    assert code == 1 and gate(document, 1)["verdict"] == "fail"   # its pool is below its context
    assert "each naming the input length" in text(g2)
    assert r.posts() == ["/generate"] * 3 and seconds < 15


def test_a_router_that_serves_the_over_pool_prompt_fails_gate2():
    def leaky(n):
        return 200, {"output_ids": [7, 7, 7, 7], "meta_info": {"prompt_tokens": n}}

    with hostile(router(leaky)) as r:
        code, document, _ = audit("--live", r.url, "--live-count", "1")
    assert gate(document, 2)["verdict"] == "fail" and code == 1
    assert "incident's fingerprint" in text(gate(document, 2))


@pytest.mark.parametrize("over_pool, reason", [
    ((400, {"error": "bad request"}), "does not name the input length"),
    ((422, {"detail": [{"msg": "field required", "input": [1, 384, 2]}]}), "does not name the input length"),
    ((503, {"error": "overloaded"}), "HTTP 503"),
    ((200, b"<html>ok</html>"), "garbled"),
])
def test_an_over_pool_answer_that_is_not_the_length_check_is_unknown(over_pool, reason):
    def generate(n):
        return sglang_like(n) if n < MAX_INPUT else over_pool

    with hostile(router(generate)) as r:
        code, document, _ = audit("--live", r.url, "--live-count", "1")
    assert gate(document, 2)["verdict"] == "unknown", gate(document, 2)
    assert reason in text(gate(document, 2)) and code == 1


def test_a_failed_baseline_leaves_gate2_unknown_and_sends_no_over_pool_prompt():
    with hostile(router(lambda n: (500, {"error": "boom"}))) as r:
        code, document, _ = audit("--live", r.url)
    g2 = gate(document, 2)
    assert (
        g2["verdict"] == "unknown" and "baseline" in text(g2) and "nothing judged" in text(g2) and code == 1
    )
    assert r.posts() == ["/generate"]   # the baseline only


def test_401_names_the_api_key_flag_and_the_key_is_sent_as_a_bearer_token():
    with hostile(router(sglang_like, key="sekret")) as r:
        code, document, seconds = audit("--live", r.url)
        assert gate(document, 2)["verdict"] == "unknown" and seconds < 15 and code == 1
        assert "the router wants an API key: --api-key" in text(gate(document, 2))
        assert "re-run with --api-key KEY" in gate(document, 1)["remedy"] and r.posts() == []
        _, document, _ = audit("--live", r.url, "--live-count", "1", "--api-key", "sekret")
        assert gate(document, 2)["verdict"] == "pass", gate(document, 2)
        assert {auth for _, _, auth in r.seen} == {None, "Bearer sekret"}
        _, passive, _ = audit("--server", r.url)
    assert "HTTP 401: the server wants an API key: --api-key" in passive["servers"][0]["error"]
    assert "re-run with --api-key KEY" in gate(passive, 1)["remedy"]


def test_401_on_generate_only_is_unknown_not_a_rejection():
    def generate(n):
        return 401, {"error": "Unauthorized"}

    with hostile(router(generate)) as r:
        _, document, _ = audit("--live", r.url)
    assert gate(document, 2)["verdict"] == "unknown"
    assert "the router wants an API key: --api-key" in text(gate(document, 2))
    assert gate(document, 2)["remedy"] and "--api-key" in gate(document, 2)["remedy"]


# ---- no redirect is followed -------------------------------------------------------------------------


def test_redirects_are_named_never_followed():
    with hostile(router(sglang_like)) as canary:
        def handle(server, request):
            send(request, 307, b"", {"Location": canary.url + request.path})

        with hostile(handle) as r:
            _, live, seconds = audit("--live", r.url)
            _, passive, _ = audit("--server", r.url)
        assert canary.seen == []   # nothing reached the redirect's target
    assert gate(live, 2)["verdict"] == "unknown" and seconds < 15
    assert f"HTTP 307 redirect to {canary.url}/workers: not followed" in text(gate(live, 1))
    assert f"redirect to {canary.url}/server_info: not followed" in passive["servers"][0]["error"]
    assert "give the URL each server answers on itself" in gate(passive, 1)["remedy"]


def test_a_redirected_generate_is_not_sent_on():
    with hostile(router(sglang_like)) as canary:
        def handle(server, request):
            if request.path == "/generate":
                prompt_length(request)
                return send(request, 307, b"", {"Location": canary.url + "/generate"})
            return router(sglang_like)(server, request)

        with hostile(handle) as r:
            _, document, _ = audit("--live", r.url)
        assert canary.seen == []
    assert gate(document, 2)["verdict"] == "unknown"
    assert "redirect to" in text(gate(document, 2)) and "not followed" in text(gate(document, 2))


# ---- bounded in seconds, bytes and prompt size ---------------------------------------------------------


def drip_body(server, request):
    request.send_response(200)
    request.send_header("Content-Type", "application/json")
    request.end_headers()
    while not server.stopping.wait(4):
        request.wfile.write(b" ")
        request.wfile.flush()


def drip_headers(server, request):
    request.wfile.write(b"HTTP/1.0 200 OK\r\n")
    while not server.stopping.wait(4):
        request.wfile.write(b"X: y\r\n")
        request.wfile.flush()


@pytest.mark.parametrize("handle", [drip_body, drip_headers])
def test_a_server_dripping_a_byte_every_4_s_ends_at_the_timeout(handle):
    with hostile(handle) as s:
        code, document, seconds = audit("--server", s.url, "--timeout", "2")
    assert seconds < 10 and code == 1, seconds   # the server drips until the test ends
    assert "no complete answer within 2 s" in document["servers"][0]["error"]
    assert gate(document, 1)["verdict"] == "unknown"


def test_a_huge_body_is_cut_at_the_limit():
    def huge(server, request):
        request.send_response(200)
        request.end_headers()
        chunk = b"[" + b"1," * (1 << 19)
        for _ in range(400):   # 400 MB unless the audit hangs up
            request.wfile.write(chunk)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with hostile(huge) as s:
        code, document, seconds = audit("--server", s.url)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert "above the audit's limit of 4,194,304 bytes" in document["servers"][0]["error"]
    assert seconds < 20 and grown_mb < 100 and code == 1, (seconds, grown_mb)


def test_a_declared_huge_body_is_not_read():
    def declared(server, request):
        request.send_response(200)
        request.send_header("Content-Length", str(400 << 20))
        request.end_headers()
        server.stopping.wait(30)

    with hostile(declared) as s:
        _, document, seconds = audit("--server", s.url)
    assert "an answer of 419,430,400 bytes" in document["servers"][0]["error"] and seconds < 10


def test_a_huge_reported_pool_builds_no_prompt_above_the_cap():
    info = prefill_info(pool=20_000_000, context=40_000_000)
    with hostile(router(sglang_like, info=info)) as r:
        _, document, seconds = audit("--live", r.url)
    g2 = gate(document, 2)
    assert g2["verdict"] == "unknown" and r.posts() == [] and seconds < 15
    assert "--max-prompt-tokens (1,048,576)" in text(g2) and "--max-prompt-tokens 20000001" in g2["remedy"]


def silent_router(count):
    def handle(server, request):
        if request.path == "/workers":
            return send(request, 200, {"workers": [{"url": f"{server.url}/w{i}"} for i in range(count)]})
        server.stopping.wait(60)   # a worker that never answers
    return handle


def test_many_silent_workers_are_read_in_parallel():
    with hostile(silent_router(64)) as r:
        _, document, seconds = audit("--live", r.url, "--timeout", "1")
    # 64 one-second timeouts, 16 at a time: 4 s (64 s one by one); half of one by one leaves room for a
    # loaded machine (22 s seen at load average 10) and still fails a serial read
    assert seconds < 32, seconds
    assert gate(document, 1)["verdict"] == "unknown"
    servers = gate(document, 1)["servers"]
    assert len(servers) == 64 and all(
        s["verdict"] == "unknown" and "not read" in s["evidence"] for s in servers
    )


def test_200_silent_workers_end_at_the_total_timeout():
    with hostile(silent_router(200)) as r:
        _, document, seconds = audit("--live", r.url, "--timeout", "1", "--total-timeout", "4")
    assert seconds < 10, seconds   # 13 s at 16 at a time without the total bound, 200 s one by one
    evidence = [s["evidence"] for s in gate(document, 1)["servers"]]
    assert len(evidence) == 200 and any("--total-timeout 4 s) ran out" in e for e in evidence)


# ---- unreachable and garbled routers are named as such ---------------------------------------------------


def test_garbled_json_is_named_garbled():
    def garbled(server, request):
        send(request, 200, b"{not json")

    with hostile(garbled) as s:
        _, live, _ = audit("--live", s.url)
        _, passive, _ = audit("--server", s.url)
    assert "garbled" in text(gate(live, 2))
    assert "garbled" in passive["servers"][0]["error"]


def test_an_unreachable_router_is_named_and_a_bad_port_blames_live(capsys):
    with hostile(router(sglang_like)) as r:
        url = r.url
    _, document, seconds = audit("--live", url)
    assert re.search(r"/workers: unreachable: connection refused", text(gate(document, 2))) and seconds < 15
    assert main(["audit", "--live", "http://127.0.0.1:99999"]) == 2
    assert "--live http://127.0.0.1:99999: malformed port" in capsys.readouterr().err


def test_a_hostile_location_is_one_short_printable_line():
    def handle(server, request):
        send(request, 302, b"", {"Location": "http://127.0.0.1:1/\x1b[2J" + "a" * 5000})

    with hostile(handle) as s:
        _, document, _ = audit("--server", s.url)
    error = document["servers"][0]["error"]
    assert "\x1b" not in error and "http://127.0.0.1:1/?[2J" in error and len(error) < 400


def test_the_over_pool_prompt_is_above_every_prefill_pool():
    def handle(server, request):
        if request.path == "/workers":
            return send(request, 200, {"workers": [{"url": f"{server.url}/a"}, {"url": f"{server.url}/b"}]})
        if request.path.endswith("/server_info"):
            return send(request, 200, prefill_info(pool=200 if request.path.startswith("/a") else POOL))
        if request.path == "/generate":
            return send(request, *sglang_like(prompt_length(request)))
        return send(request, 404, {})

    with hostile(handle) as r:
        _, document, _ = audit("--live", r.url, "--live-count", "1")
    assert gate(document, 2)["details"]["live"]["prompt_tokens_sent"] == 384   # 1.5 x the larger pool, 256
