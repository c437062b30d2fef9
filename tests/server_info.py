"""Build a server's ``/server_info`` document with one tree's own code, and print it as JSON.

Usage (inside the probe environment; the tree is the only ``sglang`` on the path)::

    python tests/server_info.py --tree PKGROOT --context-length 1048576 [--page-size 64] \\
        [--backend mooncake] --node prefill:681280 --node decode:681280:kv-checksum ...

Each ``--node MODE:POOL_TOKENS[:kv-checksum]`` is one server (MODE null, prefill or decode);
all of them are built in this one interpreter, since importing the tree costs most of the time.

What is the tree's own code: its ``ServerArgs`` (built from the given arguments and
published for the tokenizer process, which resolves it), its ``TpModelWorker.get_worker_info``
(which derives ``max_req_input_len`` from the context and the pool), its
``Scheduler.get_init_info`` (the start-up report merged into the document), and its
``/server_info`` handler itself, compiled from ``entrypoints/http_server.py`` with the names
that module imports, and awaited (importing the module would pull the whole web stack). Stand-ins,
each named for what it replaces:

- ``ModelRunnerStandIn``: the pool size that GPU memory profiling would measure at start-up
  (``POOL_TOKENS``), and a model config whose context is ``--context-length``;
- ``TokenizerManagerStandIn``: the running server's tokenizer manager (the handler reads its
  ``server_args``, ``startup_time`` and awaits ``get_internal_state``, which needs live
  schedulers: it answers one empty state per DP rank);

Stdout carries exactly one JSON document ``{"tree", "version", "sglang_file", "nodes": [{"mode",
"pool_tokens", "kv_checksum", "server_info"}]}``;
exit 2 on bad input (the tree is not the imported ``sglang``), 1 when the tree's code raised.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import importlib
import json
import os
import sys
import traceback
from types import SimpleNamespace


class ModelRunnerStandIn(SimpleNamespace):
    """Stands for the model runner after start-up: the KV pool is what memory profiling chose."""

    def __init__(self, pool_tokens: int, context_length: int) -> None:
        super().__init__(
            max_total_num_tokens=pool_tokens,
            effective_max_total_num_tokens=pool_tokens,
            logical_max_total_num_tokens=pool_tokens,
            effective_logical_max_total_num_tokens=pool_tokens,
            max_running_requests=256,
            forward_stream=None,
            req_to_token_pool=SimpleNamespace(size=256, max_context_len=context_length + 4,
                                              schedulable_token_capacity=lambda tokens: tokens),
            token_to_kv_pool=SimpleNamespace(size=pool_tokens),
            token_to_kv_pool_allocator=SimpleNamespace(size=pool_tokens),
        )


class TokenizerManagerStandIn:
    """Stands for the HTTP server's tokenizer manager (no schedulers are running)."""

    def __init__(self, server_args) -> None:
        self.server_args = server_args
        self.startup_time = 0.0

    async def get_internal_state(self):
        return [{}]


def handler_from_source(module_file: str, name: str, global_state) -> object:
    """The tree's own handler function, compiled from its module's source without importing
    the module (which pulls the whole web and OpenAI-serving stack), with every name it uses
    bound the way the module's own top-level imports bind it."""
    with open(module_file, encoding="utf-8") as fh:
        module = ast.parse(fh.read(), filename=module_file)
    func = next((n for n in module.body if isinstance(n, ast.AsyncFunctionDef) and n.name == name), None)
    if func is None:
        raise LookupError(f"{module_file} has no handler {name}()")
    func.decorator_list = []  # the route registration, @app.get(...)
    used = {n.id for n in ast.walk(func) if isinstance(n, ast.Name)}
    namespace: dict = {"__name__": "sglang.srt.entrypoints.http_server", "_global_state": global_state}
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if (alias.asname or alias.name) in used:
                    namespace[alias.asname or alias.name] = getattr(
                        importlib.import_module(node.module), alias.name
                    )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if bound in used:
                    namespace[bound] = importlib.import_module(alias.name if alias.asname else bound)
    # the tree's own function body, compiled from its own file: no code of ours is executed
    exec(compile(ast.Module(body=[func], type_ignores=[]), module_file, "exec"), namespace)  # noqa: S102
    return namespace[name]


def scheduler_info(pool_tokens: int, context_length: int) -> dict:
    """The tree's own start-up report: worker info, then the scheduler's handshake dict."""
    from sglang.srt.managers import tp_worker
    from sglang.srt.managers.scheduler import Scheduler

    worker = SimpleNamespace(
        model_config=SimpleNamespace(context_len=context_length),
        model_runner=ModelRunnerStandIn(pool_tokens, context_length),
        ps=SimpleNamespace(attn_dcp_size=1),
        random_seed=0, device="cpu", dllm_algorithm=None,
    )
    if hasattr(tp_worker, "page_interleave_shard_size"):
        # Interleaved pages shard a GPU allocator; the stand-in pool is not sharded.
        tp_worker.page_interleave_shard_size = lambda allocator: 1
    info = tp_worker.TpModelWorker.get_worker_info(worker)
    # The order is the same in every release: (pool, ..., max_req_len, max_req_input_len, ...).
    scheduler = SimpleNamespace(max_total_num_tokens=info[0], max_req_input_len=info[5], startup_time=0.0)
    return Scheduler.get_init_info(scheduler)


def server_args_for(args, node):
    from sglang.srt.server_args import ServerArgs

    # A dataclass up to 0.5.19, a msgspec struct from 0.5.20.
    fields = set(getattr(ServerArgs, "__dataclass_fields__", {})) | set(
        getattr(ServerArgs, "__struct_fields__", ())
    )
    kwargs = {"model_path": "dummy", "context_length": args.context_length, "page_size": args.page_size,
                  "disaggregation_mode": node["mode"], "disaggregation_transfer_backend": args.backend}
    if node["kv_checksum"]:
        if "disaggregation_enable_kv_checksum" not in fields:
            raise SystemExit(_refuse(args.tree, "this release has no --disaggregation-enable-kv-checksum"))
        kwargs["disaggregation_enable_kv_checksum"] = True
    return ServerArgs(**kwargs)


_real_stdout = None


def parse_node(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("null", "prefill", "decode") or not parts[1].isdigit() \
            or (len(parts) == 3 and parts[2] != "kv-checksum"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected MODE:POOL_TOKENS[:kv-checksum]")
    return {"mode": parts[0], "pool_tokens": int(parts[1]), "kv_checksum": len(parts) == 3}


def _refuse(tree: str, message: str) -> int:
    _real_stdout.write(json.dumps({"tree": tree, "error": message}) + "\n")
    _real_stdout.flush()
    return 2


def build(args, node) -> dict:
    from sglang.srt import server_args as server_args_module

    server_args = server_args_for(args, node)
    server_args_module.set_global_server_args_for_tokenizer(server_args)  # resolves, as the launcher does
    info = scheduler_info(node["pool_tokens"], args.context_length)
    state = SimpleNamespace(tokenizer_manager=TokenizerManagerStandIn(server_args), scheduler_info=info)
    entrypoints = os.path.join(os.path.dirname(server_args_module.__file__), "entrypoints")
    handler = handler_from_source(os.path.join(entrypoints, "http_server.py"), "server_info", state)
    return asyncio.run(handler())


def main(argv: list[str] | None = None) -> int:
    global _real_stdout
    parser = argparse.ArgumentParser(prog="tests/server_info.py")
    parser.add_argument("--tree", required=True)
    parser.add_argument("--context-length", type=int, required=True)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--backend", default="mooncake")
    parser.add_argument("--node", action="append", required=True, type=parse_node,
                        metavar="MODE:POOL_TOKENS[:kv-checksum]")
    args = parser.parse_args(argv)

    sys.stdout.flush()
    _real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    tree = os.path.abspath(args.tree)
    try:
        import sglang
    except ImportError as exc:
        return _refuse(tree, f"cannot import sglang: {exc}")
    if not os.path.abspath(sglang.__file__).startswith(os.path.join(tree, "sglang") + os.sep):
        return _refuse(tree, f"sglang is imported from {sglang.__file__}, not from the tree")
    try:
        nodes = [{**node, "server_info": build(args, node)} for node in args.node]
    except Exception as exc:  # noqa: BLE001 - reported, never a document
        traceback.print_exc(file=sys.stderr)
        _real_stdout.write(json.dumps({"tree": tree, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        _real_stdout.flush()
        return 1
    from sglang import __version__

    _real_stdout.write(json.dumps({"tree": tree, "version": __version__, "sglang_file": sglang.__file__,
                                   "nodes": nodes}, default=str, sort_keys=True) + "\n")
    _real_stdout.flush()
    return 0



if __name__ == "__main__":
    sys.exit(main())
