"""bootstrap_route_poisoning_refused's verdicts (bootstrap.judge) from recorded answers, and the
scenario's own calls against a stand-in route table. No SGLang server: the stand-in is a small HTTP
server on 127.0.0.1 with the wire shape of 0.5.19's CommonKVBootstrapServer (PUT/GET /route,
/register_dp_rank, /query_dp_ranks), with or without sbp-bootstrap-auth's bearer check."""

from __future__ import annotations

import itertools
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import pytest

from backport.live import bootstrap
from backport.live.scenarios import ERROR, SAFE, UNSAFE
from tests.test_live_reply_units import StandIn, model_at, shape_ids

REFERENCE = [401, 1, 3, 77, 250, 9, 511, 128]
ORIGINAL = {"rank_ip": "127.0.0.1", "rank_port": 40001}
ATTACKER = {"rank_ip": "127.0.0.1", "rank_port": 40999}
SERVED = {"status": 200, "tokens": REFERENCE, "prompt_tokens": 4, "seconds": 0.2}


def read(entry=ORIGINAL, status=200):
    out = {"status": status, "body": entry}
    if status == 200 and entry is not None:
        out["entry"] = dict(entry)
    return out


UNREACHABLE = {"status": None, "error": "ConnectionError: refused"}


def details(puts=(401, 403), backs=(ORIGINAL, ORIGINAL), dp_status=401, dp_read=None, sink=(), nxt=SERVED,
            final=SERVED, restore=None):
    attempts = [{"authorization": label, "put": {"status": s, "body": "x"} if s else UNREACHABLE,
                 "read_back": read(b) if b is not None else UNREACHABLE}
                for label, s, b in zip(("none", "wrong bearer token"), puts, backs, strict=True)]
    dp = {"room": 7, "register": {"status": dp_status, "body": "x"}}
    if dp_read is not None:
        dp["query"] = {"status": 200, "body": dp_read}
    out = {"bootstrap": "http://127.0.0.1:1", "attacker": ATTACKER, "before": read(), "attempts": attempts,
           "dp_rank": dp, "next_valid": nxt, "final_valid": final, "sink_connections": list(sink)}
    if restore is not None:
        out["restore"] = restore
    return out


def judge(d):
    return bootstrap.judge(d, REFERENCE)[0]


def test_refused_writes_unchanged_table_and_silent_sink_is_safe():
    verdict, observed = bootstrap.judge(details(), REFERENCE)
    assert verdict == SAFE and "401/403" in observed and "register_dp_rank 401" in observed


PUT_STATUSES = (None, 200, 400, 401, 403, 500)
READ_BACKS = (ORIGINAL, ATTACKER, {"rank_ip": "10.0.0.9", "rank_port": 5}, None)


@pytest.mark.parametrize("which", [0, 1])
def test_safe_only_with_a_refusal_an_unchanged_table_and_no_sink_contact(which):
    """Every combination of one attempt's PUT status, its read-back and the sink: safe exactly when
    the PUT got 401/403, the table read back the original entry and nothing reached the sink."""
    for status, back, sink in itertools.product(PUT_STATUSES, READ_BACKS, ((), ({"peer": "127.0.0.1:5"},))):
        puts, backs = [401, 403], [ORIGINAL, ORIGINAL]
        puts[which], backs[which] = status, back
        verdict = judge(details(puts, backs, sink=sink))
        expected_safe = status in (401, 403) and back == ORIGINAL and not sink
        assert (verdict == SAFE) == expected_safe, (status, back, sink, verdict)
        if back == ATTACKER or sink:
            assert verdict == UNSAFE, (status, back, sink, verdict)


def test_poisoned_table_is_unsafe_whatever_the_status_and_says_whether_it_was_put_back():
    restored = {"put": {"status": 200}, "read_back": read(ORIGINAL)}
    verdict, observed = bootstrap.judge(
        details((200, 200), (ATTACKER, ATTACKER), restore=restored), REFERENCE
    )
    assert verdict == UNSAFE and "sink's 127.0.0.1:40999" in observed
    assert "put back" in observed and "reference tokens" in observed
    broken = details((200, 200), (ATTACKER, ATTACKER), final={**SERVED, "status": 500, "tokens": []})
    verdict, observed = bootstrap.judge(broken, REFERENCE)
    assert verdict == UNSAFE and "status 500" in observed


def test_an_unreachable_bootstrap_is_error_never_safe():
    unreachable_first = {**details(), "before": UNREACHABLE}
    del unreachable_first["attempts"]
    verdict, observed = bootstrap.judge(unreachable_first, REFERENCE)
    assert verdict == ERROR and "did not answer" in observed
    assert judge(details((None, None), (None, None))) == ERROR
    assert judge(details((401, 403), (ORIGINAL, None))) == ERROR
    assert judge({**details(), "before": read(None, status=503)}) == ERROR


def test_dp_rank_registration_read_back_is_unsafe_absent_is_fine_accepted_unread_is_error():
    assert judge(details(dp_status=200, dp_read={"7": 0})) == UNSAFE
    assert judge(details(dp_status=404)) == SAFE     # the release has no such route
    assert judge(details(dp_status=200, dp_read={})) == ERROR
    assert judge(details(dp_status=403, dp_read="7 was not found")) == SAFE  # text is not a read-back


def test_the_valid_prompts_after_refused_writes_must_get_the_reference_tokens():
    assert judge(details(final={**SERVED, "tokens": [9] * 8})) == UNSAFE
    assert judge(details(nxt={**SERVED, "status": None, "tokens": []})) == UNSAFE
    assert judge(details(final={**SERVED, "tokens_unrecoverable": True})) == ERROR
    assert judge(details(final={**SERVED, "status": 429, "tokens": []})) == ERROR


def test_put_body_carries_every_releases_fields_and_echoes_what_the_registrant_must_repeat():
    info = {
        "attn_tp_size": 1,
        "page_size": 1,
        "kv_cache_dtype": "float32",
        "decode_allocation_policy": "early",
        "dsv41_spec_layout": None,
        "prefill_http_port": 30000,
        "follow_bootstrap_room": True,
    }
    body = bootstrap.put_body(info, **ATTACKER)
    assert body["kv_cache_dtype"] == "float32" and body["decode_allocation_policy"] == "early"
    assert "dsv41_spec_layout" not in body and "follow_bootstrap_room" not in body
    for field in ("role", "engine_rank", "tp_size", "attn_cp_rank", "system_dp_rank", "rank_ip", "rank_port"):
        assert field in body
    assert bootstrap.put_body("Not Found", **ATTACKER)["page_size"] == 1   # no info served (0.4.5.post1)


def test_the_sink_records_a_connection_and_its_first_bytes():
    with bootstrap.Sink() as sink:
        with socket.create_connection(("127.0.0.1", sink.port), timeout=2) as conn:
            conn.sendall(b"\xff\x00zmtp")
        for _ in range(50):
            if sink.connections:
                break
            threading.Event().wait(0.05)
    assert sink.connections and sink.connections[0]["first_bytes_hex"] == "ff007a6d7470"


class RouteTable(BaseHTTPRequestHandler):
    """Stands in for prefill's bootstrap server (0.5.19's routes and fields); `token` set: PUT and
    /register_dp_rank need it as sbp-bootstrap-auth does."""

    table: dict
    rooms: dict
    token: str | None = None
    fields = (
        "attn_tp_size",
        "attn_cp_rank",
        "system_dp_size",
        "page_size",
        "kv_cache_dtype",
        "rank_ip",
        "rank_port",
    )

    def log_message(self, *args):
        pass

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def _refused(self):
        if self.token is None:
            return False
        given = self.headers.get("Authorization")
        if given != f"Bearer {self.token}":
            self._send(401 if given is None else 403, "refused")
            return True
        return False

    def do_GET(self):
        query = parse_qs(urlparse(self.path).query)
        if query["prefill_dp_rank"] == ["-1"]:
            return self._send(200, {"attn_tp_size": 1, "page_size": 1, "kv_cache_dtype": "float32"})
        return self._send(200, self.table)

    def do_PUT(self):
        if self._refused():
            return None
        data = self._body()
        missing = [f for f in self.fields if f not in data]
        if missing:
            return self._send(500, f"KeyError {missing}")
        self.table.update(rank_ip=data["rank_ip"], rank_port=int(data["rank_port"]))
        return self._send(200, "OK")

    def do_POST(self):
        if self.path == "/register_dp_rank":
            if self._refused():
                return None
            data = self._body()
            self.rooms[str(data["bootstrap_room"])] = data["dp_rank"]
            return self._send(200, "OK")
        rooms = self._body()["bootstrap_rooms"]
        return self._send(200, {str(r): self.rooms[str(r)] for r in rooms if str(r) in self.rooms})


class ColdDecode(StandIn):
    """A deployment whose decode has no cached route: each request reads GET /route and opens a
    connection to the entry, as a transfer registration would."""

    def __init__(self, base):
        super().__init__(lambda ids: (200, shape_ids(ids, REFERENCE)))
        self.base = base

    def generate(self, ids, **kw):
        entry = bootstrap.read_entry(self.base)["entry"]
        with socket.create_connection((entry["rank_ip"], entry["rank_port"]), timeout=2):
            pass
        return super().generate(ids, **kw)


@pytest.fixture
def route_table(request):
    origin = socket.socket()
    origin.bind(("127.0.0.1", 0))
    origin.listen(8)  # the real registrant's endpoint, so the cold decode's connect succeeds
    handler = type(
        "Table",
        (RouteTable,),
        {
            "table": {"rank_ip": "127.0.0.1", "rank_port": origin.getsockname()[1]},
            "rooms": {},
            "token": request.param,
        },
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, handler
    server.shutdown()
    server.server_close()
    origin.close()


def run_on(server, model, cold=False):
    base = f"http://127.0.0.1:{server.server_address[1]}"
    dep = ColdDecode(base) if cold else StandIn(lambda ids: (200, shape_ids(ids, REFERENCE)))
    dep.prefill = SimpleNamespace(ports=(1, server.server_address[1]))
    return bootstrap.bootstrap_route_poisoning_refused(dep, model)


@pytest.fixture
def model(tmp_path):
    return model_at(tmp_path / "model", {"valid": REFERENCE})


@pytest.mark.parametrize("route_table", [None], indirect=True)
def test_an_open_route_table_is_poisoned_then_put_back(route_table, model):
    server, handler = route_table
    original = dict(handler.table)
    outcome = run_on(server, model)
    assert outcome.verdict == UNSAFE, outcome
    assert [a["put"]["status"] for a in outcome.details["attempts"]] == [200, 200]
    assert outcome.details["attempts"][0]["read_back"]["entry"] == outcome.details["attacker"]
    assert outcome.details["restore"]["read_back"]["entry"] == original == handler.table
    assert str(outcome.details["dp_rank"]["room"]) in outcome.details["dp_rank"]["query"]["body"]


@pytest.mark.parametrize("route_table", [None], indirect=True)
def test_a_cold_decode_reading_the_poisoned_entry_reaches_the_sink(route_table, model):
    outcome = run_on(route_table[0], model, cold=True)
    assert outcome.verdict == UNSAFE and len(outcome.details["sink_connections"]) == 1, outcome
    assert "connected to the sink 1 time(s)" in outcome.observed


@pytest.mark.parametrize("route_table", ["s3cret"], indirect=True)
def test_a_route_table_that_wants_the_token_is_safe(route_table, model):
    server, handler = route_table
    original = dict(handler.table)
    outcome = run_on(server, model, cold=True)
    assert outcome.verdict == SAFE, outcome
    assert [a["put"]["status"] for a in outcome.details["attempts"]] == [401, 403]
    assert "restore" not in outcome.details and handler.table == original and handler.rooms == {}
    assert outcome.details["sink_connections"] == []


def test_a_closed_bootstrap_port_is_error_and_nothing_is_sent(model):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    dep = StandIn(lambda ids: pytest.fail("no prompt is sent without a route to read"))
    dep.prefill = SimpleNamespace(ports=(1, port))
    outcome = bootstrap.bootstrap_route_poisoning_refused(dep, model)
    assert outcome.verdict == ERROR and "did not answer" in outcome.observed
    assert "attempts" not in outcome.details
