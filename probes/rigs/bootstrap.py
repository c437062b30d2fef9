"""The PD bootstrap server of a tree as a rig: started on a free local port (the tree's own class and
routes), prefill rank 0 registered through the tree's own manager code, and plain HTTP to its
routes as decode and an attacker would send it. The probe: probes/cases/bootstrap_routes.py."""
from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from ..standins import sg, sg_attr

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


def http(port: int, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
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


def route(port: int) -> tuple[str, int] | None:
    """Rank 0's entry as decode reads it (GET /route, no token), or None when there is none."""
    status, body = http(port, "GET", f"/route?{RANK_QUERY}")
    if status != 200 or not isinstance(body, dict) or "rank_ip" not in body:
        return None
    return body["rank_ip"], int(body["rank_port"])


def app_routes(app) -> set[str]:
    return {res.canonical for res in app.router.resources()}


def optional(module: str):
    """A module of the tree, or None where the release has none (common/conn.py from 0.4.7)."""
    try:
        return sg(module)
    except ImportError:
        return None


def mooncake_conn():
    return sg("disaggregation.mooncake.conn")


def kv_class(kind: str, backend: str = "MOONCAKE"):
    utils = sg("disaggregation.utils")
    return utils.get_kv_class(getattr(utils.TransferBackend, backend), getattr(utils.KVClassType, kind))


def registrant(manager_cls):  # renamed register_to_bootstrap at 0.5.10
    return getattr(manager_cls, "register_to_bootstrap", None) or manager_cls._register_to_bootstrap


def nixl_own() -> tuple[Any, Any] | None:
    """NIXL's (bootstrap server, KV manager) where its route handler or registrant is not the one
    the Mooncake cases already drive (NIXL's own on 0.4.5.post3 - 0.4.6.post5, the common ones on
    0.4.7 - 0.5.2); else None (no NIXL, or from 0.5.3 both inherit the common ones)."""
    utils = sg("disaggregation.utils")
    if not hasattr(utils.TransferBackend, "NIXL"):
        return None
    try:
        server, manager = kv_class("BOOTSTRAP_SERVER", "NIXL"), kv_class("MANAGER", "NIXL")
    except ImportError:  # a NIXL module this interpreter cannot import: nothing of NIXL's to drive
        return None
    mooncake_server, mooncake_manager = kv_class("BOOTSTRAP_SERVER"), kv_class("MANAGER")
    if server._handle_route is not mooncake_server._handle_route or (
            registrant(manager) is not registrant(mooncake_manager)):
        return server, manager
    return None


class Settings(SimpleNamespace):
    """Settings of one single-node prefill rank (server arguments, a runtime-context getter's
    answer): what is given, else sizes 1 and every other field unset."""

    def __getattr__(self, name: str) -> Any:
        return 1 if name.endswith("_size") else None


def prefill_args() -> Settings:
    # the defaults of the settings the registrant sends (0.5.22's server refuses a rank whose
    # allocation policy differs from the first one's: an attacker sends the default too)
    return Settings(
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
    ensure(prefill_args())
    return os.environ.get(TOKEN_ENV)


def multi_node_without_token(ctx) -> str | None:
    """Where the tree settles a token: a prefill on two nodes with none configured must refuse to
    start (its other node could never learn a secret generated here, so it could never register),
    naming the variable and no secret. None where the tree settles no token."""
    ensure = sg_attr("disaggregation.common.conn", "ensure_bootstrap_auth_token")
    if ensure is None:
        return None
    ctx.setenv(TOKEN_ENV, None)
    try:
        ensure(Settings(**{**vars(prefill_args()), "nnodes": 2}))
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

    cls = cls or kv_class("BOOTSTRAP_SERVER")
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

    conn = sys.modules[manager_cls.__module__] if manager_cls else mooncake_conn()
    manager_cls = manager_cls or kv_class("MANAGER")
    method = registrant(manager_cls)
    if manager_cls is not kv_class("MANAGER") and method.__qualname__.startswith("CommonKVManager."):
        register_by_common_constructor(ctx, port, manager_cls)
        return
    for module in (conn, optional("disaggregation.common.conn")):
        for getter in ("get_parallel", "get_serving", "get_disagg"):
            if module is not None and getter in module.__dict__:
                ctx.patch(module, getter, prefill_args)
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
        server_args=prefill_args(), system_dp_size=1, system_dp_rank=0,
        kv_args=SimpleNamespace(page_size=1, engine_rank=0, rust_http_port=None),
        agent=SimpleNamespace(name="probe"),  # NIXL's registrant sends its agent's name
    )
    method(shell)


def register_by_common_constructor(ctx, port: int, manager_cls) -> None:
    """NIXL's registration where its manager inherits the common one (0.4.7 - 0.5.2): the common
    constructor NIXL's own starts with (its prefill branch registers); not NIXL's remainder."""
    import sys

    common = sys.modules[registrant(manager_cls).__module__]
    for name, value in (("get_ip", "127.0.0.1"), ("get_local_ip_by_remote", PREFILL_RANK[0]),
                        ("get_free_port", PREFILL_RANK[1])):
        if name in common.__dict__:
            ctx.patch(common, name, lambda *a, _v=value, **k: _v)
    args = Settings(**vars(prefill_args()), host="127.0.0.1", disaggregation_bootstrap_port=port,
                     dist_init_addr=None, enable_dp_attention=False)
    shell = object.__new__(manager_cls)
    common.CommonKVManager.__init__(shell, SimpleNamespace(engine_rank=0, page_size=1),
                                    sg("disaggregation.utils").DisaggregationMode.PREFILL, args)


def register_room_dp_rank(port: int) -> str:
    """The tree's own Mooncake sender registering room ROOM's DP rank (0) with POST
    /register_dp_rank, on a sender built without its constructor (which would start a transfer)."""
    sender_cls = kv_class("SENDER")
    shell = object.__new__(sender_cls)
    shell.__dict__.update(bootstrap_server_url=f"127.0.0.1:{port}", bootstrap_room=ROOM,
                          kv_mgr=SimpleNamespace(attn_dp_rank=0, server_args=prefill_args()))
    sender_cls._register_prefill_dp_rank(shell)
    return f"by {sender_cls.__name__}._register_prefill_dp_rank"


def registered(ctx, port: int, manager_cls=None) -> None:
    register_rank(ctx, port, manager_cls)
    if route(port) != PREFILL_RANK:
        raise RuntimeError("the registrant's own PUT /route did not reach the table "
                           f"(GET /route: {route(port)})")


def poison_route(port: int, poison: dict, server: str, problems: list[str], details: dict) -> None:
    """The attacker's PUT /route without a token and with a wrong one, each followed by decode's read."""
    for label, token in (("without a token", None), ("with a wrong token", "not-the-token")):
        status, _ = http(port, "PUT", "/route", poison, token=token)
        after = route(port)
        details[f"{server}put {label}"] = {"status": status, "route_after": after}
        if after != PREFILL_RANK:
            problems.append(f"{server}PUT /route {label} answered {status} and GET /route now says {after}")

