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

from typing import Any

from .. import NotApplicable, Outcome, case, judged
from ..rigs.bootstrap import (
    ONE_RANK,
    POISONED,
    PREFILL_RANK,
    ROOM,
    TOKEN_ENV,
    app_routes,
    bootstrap_server,
    http,
    multi_node_without_token,
    nixl_own,
    poison_route,
    register_rank,
    register_room_dp_rank,
    registered,
    route,
    settle_token,
)


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
    nixl = nixl_own()
    if nixl is not None:
        with bootstrap_server(ctx, nixl[0]) as (_server, port):
            registered(ctx, port, nixl[1])
            poison_route(port, poison, "NIXL's ", problems, details)
    with bootstrap_server(ctx) as (server, port):
        registered(ctx, port)
        poison_route(port, poison, "", problems, details)
        if "/register_dp_rank" in app_routes(server.app):
            status, _ = http(port, "POST", "/register_dp_rank", {"bootstrap_room": ROOM, "dp_rank": 7})
            _, seen = http(port, "POST", "/query_dp_ranks", {"bootstrap_rooms": [ROOM]})
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
            status, _ = http(port, "PUT", "/route", poison)
            after = route(port)
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
    multi_node = multi_node_without_token(ctx)
    if multi_node not in (None, "refused"):
        problems.append(multi_node)
    token = settle_token(ctx)
    with bootstrap_server(ctx) as (_server, port):
        register_rank(ctx, port)
        seen = route(port)
    details = {"token_resolved": token is not None, "route": seen, "multi_node_without_token": multi_node}
    if seen != PREFILL_RANK:
        problems.append(f"GET /route after the registration says {seen}")
    nixl = nixl_own()
    if nixl is not None:
        with bootstrap_server(ctx, nixl[0]) as (_server, port):
            register_rank(ctx, port, nixl[1])
            details["NIXL's route"] = seen = route(port)
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
        registered(ctx, port)
        routes = app_routes(server.app)
        details["route"] = route(port)
        reads = []
        if "/query_dp_ranks" in routes:
            # the room's DP rank as prefill's own sender registers it, then decode's read of it
            details["registered dp rank"] = register_room_dp_rank(port)
            status, seen = http(port, "POST", "/query_dp_ranks", {"bootstrap_rooms": [ROOM]})
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
            status, _ = http(port, method, path, body)
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
