"""An admin route reachable without the admin key (#26789; the pack's pr26789, class SBP-2026-0007).

From 0.5.8 (where the route, ``--admin-api-key`` and ``sglang/srt/utils/auth.py`` arrive together) to
0.5.21, ``POST /load_lora_adapter_from_tensors`` is registered without an auth level. The release's
API-key middleware judges such a route NORMAL: with only an admin key configured it lets every
caller through, and with an API key as well any holder of the ordinary key. The route loads a LoRA
adapter from caller-supplied tensors and config into the live server. Its siblings
(``/load_lora_adapter``, ``/unload_lora_adapter``) are ADMIN_OPTIONAL: only the admin key reaches
them where one is configured. 0.5.22 gives the route the same level.

How it is driven: the tree's real FastAPI ``app`` (``sglang.srt.entrypoints.http_server``, its routes
and their decorators as the release registers them) with the tree's own auth wiring
(``sglang.srt.utils.auth.add_api_key_middleware``, wired under ``launch_server``'s condition with the
keys it passes), requests sent through starlette's in-process ``TestClient`` (no
socket, no lifespan: no scheduler or tokenizer process starts). Stand-in: the tokenizer manager
behind ``_global_state`` (``AdapterLoadingTokenizerManager``), which records each adapter load that
reaches it and answers with the tree's own ``LoRAUpdateOutput``. The sibling ``/load_lora_adapter``
is the control: if a call without the admin key reaches it, the wiring is not the release's and
the case errors instead of judging.
"""

from __future__ import annotations

from typing import Any

from .. import NotApplicable, Outcome, case, judged, tree_version

ADMIN_KEY = "probe-admin-key"
API_KEY = "probe-user-key"
ROUTE = "/load_lora_adapter_from_tensors"
SIBLING = "/load_lora_adapter"


class AdapterLoadingTokenizerManager:
    """Stands for the server's TokenizerManager, the only collaborator the LoRA routes call: each
    adapter load that reaches it is recorded (route, adapter name) and answered with success, as
    the real manager answers once its scheduler has loaded the adapter."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, str]] = []

    def _answer(self, route: str, obj) -> Any:
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.loads.append((route, obj.lora_name))
        return LoRAUpdateOutput(success=True)

    async def load_lora_adapter_from_tensors(self, obj, request=None):
        return self._answer(ROUTE, obj)

    async def load_lora_adapter(self, obj, request=None):
        return self._answer(SIBLING, obj)


_IMPORTED_MIDDLEWARE: list = []  # the app's middleware as its module registers it (no key wiring yet)


def _http_server():
    """The tree's http_server module, imported once. Its import sets uvloop's event-loop policy for
    the whole interpreter; the policy before it is put back, so the probes after this one run as
    they would without it."""
    import asyncio
    import sys

    if "sglang.srt.entrypoints.http_server" not in sys.modules:
        policy = asyncio.get_event_loop_policy()
        try:
            import sglang.srt.entrypoints.http_server as module
        finally:
            asyncio.set_event_loop_policy(policy)
        _IMPORTED_MIDDLEWARE[:] = module.app.user_middleware
    return sys.modules["sglang.srt.entrypoints.http_server"]


def _keyed_client(ctx, module, *, api_key: str | None, admin_api_key: str | None):
    """A TestClient on the tree's app with the release's key middleware for these keys, and the
    stand-in tokenizer manager behind its global state. Each configuration starts from the app's
    middleware as imported; the list and the built stack are put back when the case ends."""
    from types import SimpleNamespace

    from sglang.srt.utils.auth import add_api_key_middleware, app_has_admin_force_endpoints
    from starlette.testclient import TestClient

    app = module.app
    ctx.patch(app, "user_middleware", list(_IMPORTED_MIDDLEWARE))
    ctx.patch(app, "middleware_stack", None)
    # launch_server's condition for wiring the middleware, on every release from 0.5.8
    if api_key or admin_api_key or app_has_admin_force_endpoints(app):
        add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    manager = AdapterLoadingTokenizerManager()
    ctx.patch(module, "_global_state", SimpleNamespace(tokenizer_manager=manager))
    return TestClient(app, raise_server_exceptions=False), manager


def _tensor_load_body(module) -> dict[str, Any]:
    """A body the release's own request class accepts: up to 0.5.16 the tensors travel as one
    string (``serialized_tensors``), from 0.5.17 as one base64 entry per TP rank."""
    fields = set(getattr(module.LoadLoRAAdapterFromTensorsReqInput, "__annotations__", {}))
    body: dict[str, Any] = {"lora_name": "probe-adapter", "config_dict": {"r": 8}}
    if "serialized_named_tensors" in fields:
        body["serialized_named_tensors"] = ["c3RhbmQtaW4="]  # base64 of b"stand-in"
    else:
        body["serialized_tensors"] = "stand-in"
    return body


def _check_applies() -> None:
    from packaging.version import Version

    if tree_version() < Version("0.5.8"):
        raise NotApplicable("the route and the admin key first appear in 0.5.8")


def _post(client, path: str, body: dict, key: str | None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post(path, json=body, headers=headers)


@case(
    proves=("pr26789",), needs=(">=0.5.8",), must_preserve=False,
    expect="With an admin key configured, POST /load_lora_adapter_from_tensors without it (no key, or the "
           "ordinary API key where one is configured too) is refused (401) before the handler: no adapter "
           "load reaches the tokenizer manager, as for the sibling /load_lora_adapter.",
)
def unkeyed_lora_tensor_load_refused(ctx) -> Outcome:
    """An operator set ``--admin-api-key`` (alone, then with ``--api-key``); a client without the
    admin key posts an adapter's tensors. The release's middleware decides, by the route's level,
    whether the call reaches the handler and so the tokenizer manager."""
    _check_applies()
    module = _http_server()
    body = _tensor_load_body(module)
    details: dict[str, Any] = {}
    problems = []
    for label, api_key, caller_key in (("admin key only, no key sent", None, None),
                                       ("admin and API key, the API key sent", API_KEY, API_KEY)):
        client, manager = _keyed_client(ctx, module, api_key=api_key, admin_api_key=ADMIN_KEY)
        sibling_body = {"lora_name": "probe-adapter", "lora_path": "/nonexistent"}
        control = _post(client, SIBLING, sibling_body, caller_key)
        if control.status_code != 401 or manager.loads:
            raise RuntimeError(f"control broken ({label}): {SIBLING} without the admin key answered "
                               f"{control.status_code} and reached {manager.loads}; the middleware is not "
                               "the release's")
        reply = _post(client, ROUTE, body, caller_key)
        details[label] = {"status": reply.status_code, "loads_reaching_manager": list(manager.loads),
                          "sibling_status": control.status_code}
        if manager.loads:
            problems.append(f"{label}: the call reached the handler (HTTP {reply.status_code}, "
                            f"adapter load {manager.loads[0][1]!r} passed to the tokenizer manager)")
        elif reply.status_code != 401:
            problems.append(f"{label}: answered {reply.status_code}, not 401")
    return judged(problems, "refused with 401 before the handler in both key configurations, as the sibling "
                            "/load_lora_adapter; no adapter load reached the tokenizer manager.", details)


@case(
    needs=(">=0.5.8",), must_preserve=True,
    expect="POST /load_lora_adapter_from_tensors with the admin key, where only an admin key is configured, "
           "reaches the handler (the adapter load is passed to the tokenizer manager, 200); with no key "
           "configured the route stays open, as its siblings.",
)
def admin_keyed_lora_tensor_load_accepted(ctx) -> Outcome:
    """The operator's own call with the admin key; and a server with no key at all, where the route
    is open on every release (an operator without keys sees no change). Where an API key is
    configured too, the releases before 0.5.22 take the API key on this route and 0.5.22 the admin
    key: that change is the fix (the other case), not judged here."""
    _check_applies()
    module = _http_server()
    body = _tensor_load_body(module)
    details: dict[str, Any] = {}
    problems = []
    for label, admin_key in (("admin key configured and sent", ADMIN_KEY), ("no key configured", None)):
        client, manager = _keyed_client(ctx, module, api_key=None, admin_api_key=admin_key)
        reply = _post(client, ROUTE, body, admin_key)
        details[label] = {"status": reply.status_code, "loads_reaching_manager": list(manager.loads)}
        if reply.status_code != 200 or manager.loads != [(ROUTE, "probe-adapter")]:
            problems.append(f"{label}: answered {reply.status_code} ({reply.text[:160]}), "
                            f"loads reaching the manager {manager.loads}")
    return judged(problems, "the admin-keyed call, and the call to a server without keys, reached the "
                            "handler and were answered 200.", details)
