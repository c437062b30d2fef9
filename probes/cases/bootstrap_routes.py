"""The PD bootstrap server's route table (this pack's sbp-bootstrap-auth; sgl-project/sglang#39400).

Prefill runs a small aiohttp server that decode asks where each prefill rank listens
(``GET /route``); prefill's KV manager fills it with ``PUT /route`` (and, where the release has
it, tells it a room's DP rank with ``POST /register_dp_rank``). No release checks who writes:
any client that reaches the bootstrap port can replace a rank's ``rank_ip``/``rank_port``, and
decode then registers its KV transfer with the endpoint that client chose (route poisoning). The
fix (#39416's design): the two mutating routes need ``Authorization: Bearer <token>`` and refuse
without it; the reads decode's rendezvous makes stay open.

How it is driven: the tree's real bootstrap server class for Mooncake (``get_kv_class``; its
subclasses for NIXL, Mori and Ascend inherit the same handlers), built by its own constructor
with its thread not started (old releases bind every interface), its aiohttp app served here on
127.0.0.1 on a free port; the tree's real registrant (the Mooncake KV manager's
``register_to_bootstrap`` / ``_register_to_bootstrap``) on a manager built without its
constructor (which would register RDMA memory), its attributes those of one prefill rank
(TP 1, DP 1, PP 1). Where the patched tree has ``ensure_bootstrap_auth_token``, the case runs it
as the engine parent does, so the token is the one the patched code resolves. The attacker is a
plain HTTP client on 127.0.0.1. Where NIXL's bootstrap server or registrant is not Mooncake's
(its own on 0.4.5.post3 - 0.4.6.post5; the common ones, CommonKVBootstrapServer and
CommonKVManager's, on 0.4.7 - 0.5.2 while Mooncake keeps its own), the refusal and the
registration run on NIXL's too; the common registrant through the common constructor NIXL's
manager starts with (its prefill branch registers), not NIXL's remainder (a NIXL agent).
Stand-ins: the runtime-context getters the registrant reads (one rank's parallel and serving
settings), the host lookups of old releases (127.0.0.1) and the common constructor's free-port
pick (rank 0's port).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from probes import NotApplicable, Outcome, case, judged
from probes.standins import sg, sg_attr

TOKEN_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN"
# prefill rank 0's real endpoint, and the one the attacker substitutes (TEST-NET-3)
PREFILL_RANK = ("10.0.0.1", 17000)
POISONED = ("203.0.113.66", 6666)
ROOM = 4401
# Every release's PUT /route reads a subset of these keys and ignores the rest, and its GET
# /route a subset of these query parameters: one payload and one query serve 0.4.5 - 0.5.23.
ONE_RANK = {"role": "Prefill", "engine_rank": 0, "agent_name": "probe", "tp_size": 1, "dp_size": 1,
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "page_size": 1, "kv_cache_dtype": "auto"}
RANK_QUERY = ("engine_rank=0&target_dp_group=0&prefill_dp_rank=0&prefill_cp_rank=0"
              "&target_tp_rank=0&target_pp_rank=0")


def _http(port: int, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """One request from a plain client on 127.0.0.1: (status, JSON body or text)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _route(port: int) -> tuple[str, int] | None:
    """Rank 0's entry as decode reads it (GET /route, no token), or None when there is none."""
    status, body = _http(port, "GET", f"/route?{RANK_QUERY}")
    if status != 200 or not isinstance(body, dict) or "rank_ip" not in body:
        return None
    return body["rank_ip"], int(body["rank_port"])


def _routes(app) -> set[str]:
    return {res.canonical for res in app.router.resources()}


def _optional(module: str):
    """A module of the tree, or None where the release has none (common/conn.py from 0.4.7)."""
    try:
        return sg(module)
    except ImportError:
        return None


def _conn():
    return sg("disaggregation.mooncake.conn")


def _kv_class(kind: str, backend: str = "MOONCAKE"):
    utils = sg("disaggregation.utils")
    return utils.get_kv_class(getattr(utils.TransferBackend, backend), getattr(utils.KVClassType, kind))


def _registrant(manager_cls):  # renamed register_to_bootstrap at 0.5.10
    return getattr(manager_cls, "register_to_bootstrap", None) or manager_cls._register_to_bootstrap


def _nixl_own() -> tuple[Any, Any] | None:
    """NIXL's (bootstrap server, KV manager) where its route handler or registrant is not the one
    the Mooncake cases already drive (NIXL's own on 0.4.5.post3 - 0.4.6.post5, the common ones on
    0.4.7 - 0.5.2); else None (no NIXL, or from 0.5.3 both inherit the common ones)."""
    utils = sg("disaggregation.utils")
    if not hasattr(utils.TransferBackend, "NIXL"):
        return None
    try:
        server, manager = _kv_class("BOOTSTRAP_SERVER", "NIXL"), _kv_class("MANAGER", "NIXL")
    except ImportError:  # a NIXL module this interpreter cannot import: nothing of NIXL's to drive
        return None
    mooncake_server, mooncake_manager = _kv_class("BOOTSTRAP_SERVER"), _kv_class("MANAGER")
    if server._handle_route is not mooncake_server._handle_route or (
            _registrant(manager) is not _registrant(mooncake_manager)):
        return server, manager
    return None


class _Settings(SimpleNamespace):
    """Settings of one single-node prefill rank (server arguments, a runtime-context getter's
    answer): what is given, else sizes 1 and every other field unset."""

    def __getattr__(self, name: str) -> Any:
        return 1 if name.endswith("_size") else None


def _prefill_args() -> _Settings:
    # the defaults of the settings the registrant sends (0.5.22's server refuses a rank whose
    # allocation policy differs from the first one's: an attacker sends the default too)
    return _Settings(
        disaggregation_mode="prefill",
        nnodes=1,
        api_key=None,
        port=30000,
        load_balance_method="follow_bootstrap_room",
        disaggregation_decode_allocation_policy="early",
    )


def settle_token(ctx) -> str | None:
    """The engine parent's step before the schedulers start, where the tree has it: with no token
    configured it generates one into the environment. Returns the token the tree resolved."""
    import os

    ctx.setenv(TOKEN_ENV, None)  # the case's environment change is undone after it
    ensure = sg_attr("disaggregation.common.conn", "ensure_bootstrap_auth_token")
    if ensure is None:
        return None
    ensure(_prefill_args())
    return os.environ.get(TOKEN_ENV)


def _multi_node_without_token(ctx) -> str | None:
    """Where the tree settles a token: a prefill on two nodes with none configured must refuse to
    start (its other node could never learn a secret generated here, so it could never register),
    naming the variable and no secret. None where the tree settles no token."""
    ensure = sg_attr("disaggregation.common.conn", "ensure_bootstrap_auth_token")
    if ensure is None:
        return None
    ctx.setenv(TOKEN_ENV, None)
    try:
        ensure(_Settings(**{**vars(_prefill_args()), "nnodes": 2}))
    except ValueError as err:
        return "refused" if TOKEN_ENV in str(err) else f"refused without naming {TOKEN_ENV}: {err}"
    return "a two-node prefill without a shared token started (its second node cannot register)"


@contextmanager
def bootstrap_server(ctx, cls=None):
    """The tree's Mooncake bootstrap server (or `cls`), its app served on 127.0.0.1 on a free port (its own
    thread, which old releases bind to every interface, is not started). Yields (server, port)."""
    import asyncio
    import inspect

    from aiohttp import web

    cls = cls or _kv_class("BOOTSTRAP_SERVER")
    ctx.patch(cls, "run", lambda self: None)
    params = inspect.signature(cls.__init__).parameters
    server = cls(host="127.0.0.1", port=0) if "host" in params else cls(port=0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, name="bootstrap-probe", daemon=True)
    thread.start()
    try:
        yield server, port
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def register_rank(ctx, port: int, manager_cls=None) -> None:
    """The tree's own registrant: the Mooncake (or `manager_cls`) KV manager's PUT /route for
    prefill rank 0."""
    import sys

    conn = sys.modules[manager_cls.__module__] if manager_cls else _conn()
    manager_cls = manager_cls or _kv_class("MANAGER")
    method = _registrant(manager_cls)
    if manager_cls is not _kv_class("MANAGER") and method.__qualname__.startswith("CommonKVManager."):
        _register_by_common_constructor(ctx, port, manager_cls)
        return
    for module in (conn, _optional("disaggregation.common.conn")):
        for getter in ("get_parallel", "get_serving", "get_disagg"):
            if module is not None and getter in module.__dict__:
                ctx.patch(module, getter, _prefill_args)
    # old releases look their hosts up: the bootstrap server's, and the rank's own address
    if "get_ip" in conn.__dict__:
        ctx.patch(conn, "get_ip", lambda *a, **k: "127.0.0.1")
    if "get_local_ip_by_remote" in conn.__dict__:
        ctx.patch(conn, "get_local_ip_by_remote", lambda *a, **k: PREFILL_RANK[0])

    def unset(self, name: str) -> Any:
        # one rank of a single-node prefill: sizes 1, ranks 0, optional features off
        if name.endswith("_size"):
            return 1
        if name.endswith("_rank"):
            return 0
        raise AttributeError(name)

    shell_cls = type("OnePrefillRank", (manager_cls,), {"__getattr__": unset})
    shell = object.__new__(shell_cls)
    shell.__dict__.update(
        dist_init_addr=None, bootstrap_host="127.0.0.1", bootstrap_port=port, local_ip=PREFILL_RANK[0],
        rank_port=PREFILL_RANK[1], kv_cache_dtype_str="auto", kv_layout=None, dsv41_spec_layout=None,
        server_args=_prefill_args(), system_dp_size=1, system_dp_rank=0,
        kv_args=SimpleNamespace(page_size=1, engine_rank=0, rust_http_port=None),
        agent=SimpleNamespace(name="probe"),  # NIXL's registrant sends its agent's name
    )
    method(shell)


def _register_by_common_constructor(ctx, port: int, manager_cls) -> None:
    """NIXL's registration where its manager inherits the common one (0.4.7 - 0.5.2): the common
    constructor NIXL's own starts with (its prefill branch registers); not NIXL's remainder."""
    import sys

    common = sys.modules[_registrant(manager_cls).__module__]
    for name, value in (("get_ip", "127.0.0.1"), ("get_local_ip_by_remote", PREFILL_RANK[0]),
                        ("get_free_port", PREFILL_RANK[1])):
        if name in common.__dict__:
            ctx.patch(common, name, lambda *a, _v=value, **k: _v)
    args = _Settings(**vars(_prefill_args()), host="127.0.0.1", disaggregation_bootstrap_port=port,
                     dist_init_addr=None, enable_dp_attention=False)
    shell = object.__new__(manager_cls)
    common.CommonKVManager.__init__(shell, SimpleNamespace(engine_rank=0, page_size=1),
                                    sg("disaggregation.utils").DisaggregationMode.PREFILL, args)


def register_room_dp_rank(port: int) -> str:
    """The tree's own Mooncake sender registering room ROOM's DP rank (0) with POST
    /register_dp_rank, on a sender built without its constructor (which would start a transfer)."""
    sender_cls = _kv_class("SENDER")
    shell = object.__new__(sender_cls)
    shell.__dict__.update(bootstrap_server_url=f"127.0.0.1:{port}", bootstrap_room=ROOM,
                          kv_mgr=SimpleNamespace(attn_dp_rank=0, server_args=_prefill_args()))
    sender_cls._register_prefill_dp_rank(shell)
    return f"by {sender_cls.__name__}._register_prefill_dp_rank"


def _registered(ctx, port: int, manager_cls=None) -> None:
    register_rank(ctx, port, manager_cls)
    if _route(port) != PREFILL_RANK:
        raise RuntimeError("the registrant's own PUT /route did not reach the table "
                           f"(GET /route: {_route(port)})")


def _poison_route(port: int, poison: dict, server: str, problems: list[str], details: dict) -> None:
    """The attacker's PUT /route without a token and with a wrong one, each followed by decode's read."""
    for label, token in (("without a token", None), ("with a wrong token", "not-the-token")):
        status, _ = _http(port, "PUT", "/route", poison, token=token)
        after = _route(port)
        details[f"{server}put {label}"] = {"status": status, "route_after": after}
        if after != PREFILL_RANK:
            problems.append(f"{server}PUT /route {label} answered {status} and GET /route now says {after}")


@case(
    proves=("sbp-bootstrap-auth",), beyond_upstream=True, must_preserve=False,
    expect="After prefill registered, a PUT /route (and a POST /register_dp_rank where the route exists) "
    "from a "
           "client without the token, or with a wrong one, is refused (401/403) and GET /route still answers "
           "prefill's own endpoint.",
)
def unauthenticated_route_update_refused(ctx) -> Outcome:
    settle_token(ctx)
    problems: list[str] = []
    details: dict[str, Any] = {}
    poison = {**ONE_RANK, "rank_ip": POISONED[0], "rank_port": POISONED[1]}
    nixl = _nixl_own()
    if nixl is not None:
        with bootstrap_server(ctx, nixl[0]) as (_server, port):
            _registered(ctx, port, nixl[1])
            _poison_route(port, poison, "NIXL's ", problems, details)
    with bootstrap_server(ctx) as (server, port):
        _registered(ctx, port)
        _poison_route(port, poison, "", problems, details)
        if "/register_dp_rank" in _routes(server.app):
            status, _ = _http(port, "POST", "/register_dp_rank", {"bootstrap_room": ROOM, "dp_rank": 7})
            _, seen = _http(port, "POST", "/query_dp_ranks", {"bootstrap_rooms": [ROOM]})
            details["register_dp_rank without a token"] = {"status": status, "query_after": seen}
            if isinstance(seen, dict) and str(ROOM) in seen:
                problems.append(
                    f"POST /register_dp_rank without a token answered {status} and room {ROOM} now "
                    f"maps to DP rank {seen[str(ROOM)]}"
                )
    # fail closed: a bootstrap server that resolved no token (started outside the engine's launch,
    # which settles one) refuses every update rather than accepting them all
    ctx.setenv(TOKEN_ENV, None)
    for label, cls in (("", None), *((("NIXL's ", nixl[0]),) if nixl else ())):
        with bootstrap_server(ctx, cls) as (server, port):
            status, _ = _http(port, "PUT", "/route", poison)
            after = _route(port)
        details[f"{label}put to a server without a token configured"] = {"status": status,
                                                                          "route_after": after}
        if after is not None:
            problems.append(f"{label or 'a '}server with no token configured took a PUT /route without "
                            f"one ({status})")
    return judged(
        problems,
        "every route update without the token refused; the table still holds prefill's own endpoint.",
        details,
        unsafe_prefix="route poisoning: ",
    )


@case(
    must_preserve=True,
    expect="Prefill's own registration (the tree's registrant, with the token the tree resolves) "
    "is accepted: "
           "GET /route answers the endpoint it registered.",
)
def authenticated_registration_accepted(ctx) -> Outcome:
    problems = []
    multi_node = _multi_node_without_token(ctx)
    if multi_node not in (None, "refused"):
        problems.append(multi_node)
    token = settle_token(ctx)
    with bootstrap_server(ctx) as (_server, port):
        register_rank(ctx, port)
        seen = _route(port)
    details = {"token_resolved": token is not None, "route": seen, "multi_node_without_token": multi_node}
    if seen != PREFILL_RANK:
        problems.append(f"GET /route after the registration says {seen}")
    nixl = _nixl_own()
    if nixl is not None:
        with bootstrap_server(ctx, nixl[0]) as (_server, port):
            register_rank(ctx, port, nixl[1])
            details["NIXL's route"] = seen = _route(port)
        if seen != PREFILL_RANK:
            problems.append(f"GET /route on NIXL's server after NIXL's registration says {seen}")
    return judged(problems, f"registered {PREFILL_RANK[0]}:{PREFILL_RANK[1]}.", details,
                  unsafe_prefix="prefill's own registration refused: ")


@case(
    must_preserve=True,
    expect="Decode's rendezvous reads need no token: GET /route (rank entry, and the server-info query where "
           "the release has it), POST /query_dp_ranks (the DP rank prefill's own sender registered) and GET "
           "/health answer.",
)
def decode_rendezvous_reads_open(ctx) -> Outcome:
    settle_token(ctx)
    problems, details = [], {}
    with bootstrap_server(ctx) as (server, port):
        _registered(ctx, port)
        routes = _routes(server.app)
        details["route"] = _route(port)
        reads = []
        if "/query_dp_ranks" in routes:
            # the room's DP rank as prefill's own sender registers it, then decode's read of it
            details["registered dp rank"] = register_room_dp_rank(port)
            status, seen = _http(port, "POST", "/query_dp_ranks", {"bootstrap_rooms": [ROOM]})
            details["POST /query_dp_ranks"] = {"status": status, "answer": seen}
            if status != 200 or not isinstance(seen, dict) or seen.get(str(ROOM)) != 0:
                problems.append("POST /query_dp_ranks after the sender's registration answered "
                                f"{status} {seen}")
        if "/health" in routes:
            reads.append(("GET /health", "GET", "/health", None))
        if "prefill_dp_rank" in _handler_source(server):
            # 0.5.10+: decode first asks for the prefill's parallel layout (every rank -1)
            layout = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
            reads.append(("GET /route (server info)", "GET", layout, None))
        for label, method, path, body in reads:
            status, _ = _http(port, method, path, body)
            details[label] = status
            if status != 200:
                problems.append(f"{label} answered {status}")
    if details["route"] != PREFILL_RANK:
        problems.append(f"GET /route answered {details['route']}")
    return judged(
        problems,
        f"{len(reads) + 1 + ('/query_dp_ranks' in routes)} reads answered without a token.",
        details,
        unsafe_prefix="decode's rendezvous blocked: ",
    )


def _handler_source(server) -> str:
    import inspect

    handler = getattr(type(server), "_handle_route_get", None)
    if handler is None:
        raise NotApplicable("the bootstrap server has no GET /route handler")
    return inspect.getsource(handler)
