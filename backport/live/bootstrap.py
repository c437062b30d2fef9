"""`bootstrap_route_poisoning_refused`: a client without the token rewrites the route decode trusts.

Prefill's bootstrap HTTP server (`CommonKVBootstrapServer`; Mooncake's own in mooncake/conn.py
up to 0.5.2) keeps the table decode reads to find the prefill rank it registers its KV transfer
with: `PUT /route` writes a rank's entry (rank_ip, rank_port), `GET /route` reads it, and from
0.5.10 `POST /register_dp_rank` writes a room's dp rank, read by `POST /query_dp_ranks`. No release
authenticates the writes (sgl-project/sglang#39400); the pack's sbp-bootstrap-auth refuses them
without `Authorization: Bearer <token>` (401 without one, 403 for a wrong one).

The scenario, as a client on 127.0.0.1 without the token: read rank 0's entry; PUT it pointing
at a sink (a listening socket opened here, standing for the attacker's endpoint; it records
every connection), once without an Authorization header and once with a wrong bearer token,
reading the table back after each; POST /register_dp_rank for a room of its own where the release
has the route; a valid prompt while the table may be poisoned; the original entry put back with
the same unauthenticated PUT (on a pristine tree the hole is the only way back); a valid prompt
again, which must get the reference tokens.

One GET carries every release's query keys and one PUT body every release's fields (each handler
reads only its own; surveyed on the 0.4.5.post1 - 0.5.23 trees), so no version table is needed.
The fields a registrant's later PUT must repeat (0.5.22 on refuse a PUT whose
`decode_allocation_policy` or `dsv41_spec_layout` differs) are copied from the parallel info the
open `GET /route` with -1 ranks serves, as an attacker would.

Decode caches a rank's entry after its first request (its `connection_pool`), and this scenario
is registered last, after the others have served: the transfer of the next request uses the cached
entry and the sink normally stays silent. A decode that had not served yet, or whose cache a
failed transfer cleared, would read the poisoned entry. The verdict rests first on the table read
back, then on the sink.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any, Self

import requests

from backport.live.deployment import Deployment
from backport.live.model import TinyModel
from backport.live.scenarios import ERROR, SAFE, UNSAFE, Outcome, ask, scenario
from backport.live.servers import LOOPBACK
from backport.vocab import TreeVerdict

HTTP_TIMEOUT = 5.0           # each bootstrap call; the server answers in milliseconds
NEXT_REQUEST_TIMEOUT = 60.0  # the valid prompt sent while the table may point at the sink
SINK_GRACE = 1.0             # a transfer's connect after its request returned
SINK_MAX_CONNECTIONS = 32
AUTH_REFUSALS = (401, 403)   # sbp-bootstrap-auth: no bearer token / a wrong one
ABSENT = (404, 405)          # the release has no such route

# rank 0 (dp 0, cp 0, tp 0, pp 0) in every release's query keys; each handler reads its own
ROUTE_QUERY = {
    "prefill_dp_rank": 0,
    "prefill_cp_rank": 0,
    "target_tp_rank": 0,
    "target_pp_rank": 0,  # 0.5.10 on
    "engine_rank": 0,
    "target_dp_group": 0,
}  # up to 0.5.9 (0.4.5.post1 - 0.4.5.post3: engine_rank)
INFO_QUERY = {key: -1 for key in ROUTE_QUERY}  # -1 everywhere: the prefill's parallel info
# a single-rank prefill's registration in every release's fields ("role" up to 0.5.9, "engine_rank",
# "tp_size", "dp_size" up to 0.5.2); sizes only count while unset, so they change nothing
REGISTRANT = {"role": "Prefill", "engine_rank": 0, "tp_size": 1, "dp_size": 1,
              "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
              "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
              "system_dp_size": 1, "system_dp_rank": 0, "page_size": 1, "kv_cache_dtype": "auto"}
ECHOED = ("page_size", "kv_cache_dtype", "kv_layout", "dsv41_spec_layout", "decode_allocation_policy",
          "enable_dsa_cache_layer_split", "enable_kv_cache_sharding", "prefill_http_port")


def bootstrap_url(dep: Deployment) -> str:
    # deployed() starts prefill with the port names ("prefill", "bootstrap", ...): ports[1]
    return f"http://{LOOPBACK}:{dep.prefill.ports[1]}"


def _call(method: str, url: str, **kw) -> dict[str, Any]:
    """{"status", "body"} (JSON when the answer is JSON, else its first 200 characters), or
    {"status": None, "error"} when the server did not answer."""
    try:
        response = requests.request(method, url, timeout=HTTP_TIMEOUT, **kw)
    except requests.RequestException as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
    try:
        body = response.json()
    except ValueError:
        body = response.text[:200]
    return {"status": response.status_code, "body": body}


def read_entry(base: str) -> dict[str, Any]:
    """GET /route for rank 0; "entry" is {"rank_ip", "rank_port"} when the answer has both."""
    answer = _call("GET", base + "/route", params=ROUTE_QUERY)
    body = answer.get("body")
    if answer["status"] == 200 and isinstance(body, dict) and {"rank_ip", "rank_port"} <= body.keys():
        answer["entry"] = {"rank_ip": str(body["rank_ip"]), "rank_port": int(body["rank_port"])}
    return answer


def put_body(info: Any, rank_ip: str, rank_port: int) -> dict[str, Any]:
    echoed = {k: info[k] for k in ECHOED if isinstance(info, dict) and info.get(k) is not None}
    return {**REGISTRANT, **echoed, "rank_ip": rank_ip, "rank_port": rank_port}


class Sink:
    """A listening socket on 127.0.0.1 standing for the attacker's endpoint: records each
    connection (peer, seconds after opening, its first bytes) until closed."""

    def __init__(self):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((LOOPBACK, 0))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.connections: list[dict[str, Any]] = []
        self._opened = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="bootstrap-sink", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set() and len(self.connections) < SINK_MAX_CONNECTIONS:
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(0.5)
                try:
                    first = conn.recv(64)
                except OSError:
                    first = b""
            self.connections.append({"peer": f"{peer[0]}:{peer[1]}", "first_bytes_hex": first.hex(),
                                     "at_seconds": round(time.monotonic() - self._opened, 3)})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dp_rank_write(base: str) -> dict[str, Any]:
    """POST /register_dp_rank for a room of the scenario's own, no token; read back by /query_dp_ranks."""
    room = secrets.randbelow(2**62) + 1
    register = _call("POST", base + "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 0})
    out: dict[str, Any] = {"room": room, "register": register}
    if register["status"] not in ABSENT:
        out["query"] = _call("POST", base + "/query_dp_ranks", json={"bootstrap_rooms": [room]})
    return out


@scenario(
    must_preserve=False,
    expect="a client on 127.0.0.1 without the bootstrap token cannot rewrite the route "
    "table (PUT /route and POST /register_dp_rank refused with 401/403, the entry "
    "read back unchanged, no connection to its endpoint) and the pair still "
    "serves the valid prompt with the reference tokens",
)
def bootstrap_route_poisoning_refused(dep: Deployment, model: TinyModel) -> Outcome:
    base = bootstrap_url(dep)
    details: dict[str, Any] = {"bootstrap": base}
    with Sink() as sink:
        attacker = {"rank_ip": LOOPBACK, "rank_port": sink.port}
        details.update(attacker=attacker, before=read_entry(base))
        original = details["before"].get("entry")
        if original is not None:
            info = _call("GET", base + "/route", params=INFO_QUERY)
            details["info"] = info
            body = put_body(info.get("body"), **attacker)
            details["attempts"] = []
            wrong = {"Authorization": f"Bearer {secrets.token_urlsafe(16)}"}
            for label, headers in (("none", {}), ("wrong bearer token", wrong)):
                put = _call("PUT", base + "/route", json=body, headers=headers)
                details["attempts"].append(
                    {"authorization": label, "put": put, "read_back": read_entry(base)}
                )
            details["dp_rank"] = _dp_rank_write(base)
            details["next_valid"] = ask(dep, model, "valid", timeout=NEXT_REQUEST_TIMEOUT).to_json()
            time.sleep(SINK_GRACE)
            if any(a["read_back"].get("entry") != original for a in details["attempts"]):
                # the same hole puts the registrant's entry back, so the pair serves on
                put = _call("PUT", base + "/route", json=put_body(info.get("body"), **original))
                details["restore"] = {"put": put, "read_back": read_entry(base)}
            details["final_valid"] = ask(dep, model, "valid").to_json()
        details["sink_connections"] = list(sink.connections)
    verdict, observed = judge(details, model.reference["valid"])
    return Outcome(verdict, observed, details)


def _served(reply: dict | None, reference: list[int]) -> str | None:
    """None when the reply has the reference tokens; else what went wrong."""
    if reply is None:
        return "not sent"
    if reply.get("tokens_unrecoverable"):
        return "200 whose tokens cannot be read back"
    if reply["status"] != 200:
        return f"status {reply['status'] or 'none'} ({reply.get('error', '')[:100]})"
    return None if reply["tokens"] == reference else "other tokens than the reference"


def judge(details: dict[str, Any], reference: list[int]) -> tuple[TreeVerdict, str]:
    """The verdict from the recorded answers. `safe` only when every write was refused with
    401/403, every read-back shows the original entry, the sink saw nothing and both valid
    prompts got the reference tokens; a bootstrap that does not answer is `error`."""
    before = details["before"]
    if before["status"] is None:
        return (
            ERROR,
            f"the bootstrap server did not answer GET /route ({before.get('error', '')[:120]}): no verdict",
        )
    original = before.get("entry")
    if original is None:
        return ERROR, f"GET /route for rank 0 got {before['status']} without an entry: no verdict"
    attacker, attempts = details["attacker"], details["attempts"]
    ours = [a for a in attempts if a["read_back"].get("entry") == attacker]
    sink = details.get("sink_connections", [])
    dp = details.get("dp_rank", {})
    read = dp.get("query", {}).get("body")
    dp_written = isinstance(read, dict) and str(dp.get("room")) in read
    after = _restored_note(details, reference)
    if ours:
        how = "; ".join(f"authorization {a['authorization']}: {a['put']['status']}" for a in ours)
        reached = f", and decode connected to the sink {len(sink)} time(s)" if sink else ""
        return UNSAFE, (f"PUT /route without the token ({how}) and GET /route read back the sink's "
                        f"{attacker['rank_ip']}:{attacker['rank_port']}{reached}; {after}")
    if sink:
        return UNSAFE, f"the sink got {len(sink)} connection(s) after the unauthenticated PUT; {after}"
    if dp_written:
        return UNSAFE, (f"POST /register_dp_rank without a token got {dp['register']['status']} and "
                        f"/query_dp_ranks read the room back; {after}")
    for a in attempts:
        put, back = a["put"], a["read_back"]
        if put["status"] is None or back["status"] is None:
            return (
                ERROR,
                f"the bootstrap server stopped answering (authorization {a['authorization']!r}): no verdict",
            )
        if back.get("entry") != original:
            return ERROR, (
                f"GET /route read back {back.get('entry') or back['status']}, neither the original "
                "entry nor the sink's: no verdict"
            )
        if put["status"] not in AUTH_REFUSALS:
            return ERROR, (f"PUT /route with authorization {a['authorization']!r} got {put['status']}, not "
                           "401/403, and the entry is unchanged: no verdict")
    if dp and dp["register"]["status"] not in (*AUTH_REFUSALS, *ABSENT):
        return ERROR, f"POST /register_dp_rank got {dp['register']['status']}, not a refusal: no verdict"
    for name in ("next_valid", "final_valid"):
        wrong = _served(details.get(name), reference)
        if wrong is None:
            continue
        reply = details.get(name) or {}
        if reply.get("status") is None or reply["status"] >= 500 or wrong.startswith("other tokens"):
            return UNSAFE, f"writes refused, but the {name.replace('_', ' ')} prompt got {wrong}"
        return ERROR, f"the {name.replace('_', ' ')} prompt got {wrong}: no verdict"
    refused = "/".join(str(a["put"]["status"]) for a in attempts)
    dp_note = ("" if not dp or dp["register"]["status"] in ABSENT else
               f", POST /register_dp_rank {dp['register']['status']}")
    return SAFE, (
        f"PUT /route refused ({refused}){dp_note}, the entry read back unchanged, no connection to the "
        "sink, the valid prompt got the reference tokens"
    )


def _restored_note(details: dict[str, Any], reference: list[int]) -> str:
    """What happened after the poisoning: whether the entry went back, whether the pair still served."""
    restore = details.get("restore")
    back = "" if restore is None else (
        "the original entry put back with the same unauthenticated PUT, "
        if restore["read_back"].get("entry") == details["before"].get("entry") else
        f"putting the original entry back failed ({restore['put']['status']}), ")
    wrong = _served(details.get("final_valid"), reference)
    return back + ("the pair then served the valid prompt with the reference tokens" if wrong is None else
                   f"the valid prompt afterwards got {wrong}")

