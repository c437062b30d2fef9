"""One PD deployment of one tree: prefill and decode `launch_server`, the `smg` router, a client.

The pair runs the incident's misconfiguration on purpose: the prefill pool (256 tokens, input
limit 250) is below the context (1024), so a prompt of 400 tokens is within the context and above
the pool. The decode pool is small (512) so that decode's allocator hands a later request the
slots an earlier one freed: the only way a leak becomes visible in the tokens.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests

from backport import resources
from backport.engine.detect import fingerprint_match, fs_reader
from backport.live.environment import ServingEnv, router_command
from backport.live.model import TinyModel
from backport.live.reply import Reply, generate
from backport.live.servers import LOOPBACK, Launch, Processes, Server, serve
from backport.live.setups import ServingSetup, pythonpath_extras, record, server_environment, serving_for
from backport.pack import load_pack

# SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT's default on every release that has it
DEFERRED_RELEASE_TIMEOUT = 30.0
SERVER_START_TIMEOUT = 600.0   # two loaded cores: both servers were ready in 90-120 s
ROUTER_START_TIMEOUT = 120.0

CONTEXT = 1024
PREFILL_POOL = 256
DECODE_POOL = 512
COMMON_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
    "--dtype",
    "float32",
    "--disable-radix-cache",
    "--disaggregation-transfer-backend",
    "mooncake",
    "--context-length",
    str(CONTEXT),
)
PREFILL_FLAGS = ("--disaggregation-mode", "prefill", "--max-total-tokens", str(PREFILL_POOL))
RESERVED_DECODE_TOKENS = 16
DECODE_FLAGS = ("--disaggregation-mode", "decode", "--max-total-tokens", str(DECODE_POOL),
                "--num-reserved-decode-tokens", str(RESERVED_DECODE_TOKENS))
# cpu_tensor: the default retraction backup registers host memory with CUDA; the option exists
# from 0.5.18 (0.5.17's launch_server refuses it as unrecognized), so it is passed where it exists
RETRACTION_BACKUP_FLAGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1",    # else --device cpu still takes the vllm path
              "MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": LOOPBACK}


@dataclass
class Deployment:
    version: str
    router_url: str
    prefill: Server
    decode: Server
    router: Server
    startup_seconds: float
    flags: dict = field(default_factory=dict)

    # The tree's decode holds a failed transfer's pages by default but its idle check ignores
    # the holds (0.5.21, 0.5.22): a flush during a hold frees them twice (sbp-flush-holds).
    flush_frees_held_pages: bool = False
    last_failure_at: float | None = None

    def generate(self, input_ids: list[int], **kw) -> Reply:
        reply = generate(self.router_url, input_ids, **kw)
        if reply.status != 200:  # the router aborted decode's half: a deferred hold may follow
            self.last_failure_at = time.monotonic()
        return reply

    def flush_decode(self, timeout: float = 60.0) -> float | None:
        """POST /flush_cache to decode until it accepts (it refuses while requests are pending);
        the seconds that took, or None when it never accepted within `timeout`. On a tree whose
        flush frees held pages twice, first wait until any hold since the last failed request has
        run out (the scheduler loop resolves a hold at its deadline at the latest)."""
        if self.flush_frees_held_pages and self.last_failure_at is not None:
            time.sleep(max(0.0, self.last_failure_at + DEFERRED_RELEASE_TIMEOUT + 2.0 - time.monotonic()))
            self.last_failure_at = None
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            with contextlib.suppress(requests.RequestException):
                if requests.post(self.decode.url + "/flush_cache", timeout=10).status_code == 200:
                    return time.monotonic() - started
            time.sleep(0.2)
        return None

    def log_mark(self) -> dict[str, int]:
        return {s.name: _size(s.log) for s in (self.prefill, self.decode, self.router)}

    def log_lines(self, mark: dict[str, int], *needles: str) -> dict[str, list[str]]:
        """Lines written since `mark` that contain any of `needles`, per server (at most 8 each)."""
        found = {}
        for server in (self.prefill, self.decode, self.router):
            with contextlib.suppress(OSError), open(server.log, "rb") as f:
                f.seek(mark.get(server.name, 0))
                lines = [line.strip() for line in f.read().decode(errors="replace").splitlines()
                         if any(n in line for n in needles)]
                if lines:
                    found[server.name] = [line[:300] for line in lines[:8]]
        return found


def flush_frees_held_pages(package_root: Path) -> bool:
    """Decode holds a failed transfer's pages by default (#41023's default) and its idle check
    does not count the holds (no sbp-flush-holds, not 0.5.23): read from the tree's code."""
    pack = load_pack(resources.pack_dir())
    read = fs_reader(package_root)
    environ = read("sglang/srt/environ.py") or ""
    held_by_default = re.search(
        r"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE = EnvBool\(True\)", environ
    )
    counted, _ = fingerprint_match(pack.fixes["sbp-flush-holds"], read)
    return bool(held_by_default) and not counted


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


WARMED_UP = "The server is fired up and ready to roll"


def wait_warmed_up(servers: list[Server], timeout: float) -> None:
    """Until every server's log has the line its warmup ends with (where /health answers before it)."""
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while waiting:
        waiting = [s for s in waiting if WARMED_UP not in s.log.read_text(errors="replace")]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(s.name for s in waiting)}: no {WARMED_UP!r} in the log within "
                               f"{timeout:.0f} s of /health answering")
        time.sleep(0.5 if waiting else 0)


def _router_ready(response: requests.Response) -> bool:
    """smg answers /health at once; /readiness says "ready" when both workers passed its checks."""
    try:
        return response.status_code == 200 and response.json().get("status") == "ready"
    except ValueError:
        return False


def decode_flags(package_root: Path, setup: ServingSetup | None = None) -> tuple[str, ...]:
    """DECODE_FLAGS as the setup has them (the reserved tokens in the environment instead of the
    flag, a bigger pool where the reserve is hard-coded), and the retraction backup option where
    the release defines it (its field name, in server_args.py up to 0.5.18 and in the config
    modules from 0.5.19)."""
    flags: tuple[str, ...] = ("--disaggregation-mode", "decode", "--max-total-tokens",
             str(DECODE_POOL + (setup.decode_pool_extra if setup else 0)))
    if setup is None or not (setup.reserved_tokens_env or setup.decode_pool_extra):
        flags += ("--num-reserved-decode-tokens", str(RESERVED_DECODE_TOKENS))
    field = RETRACTION_BACKUP_FLAGS[0].lstrip("-").replace("-", "_")
    defined = any(field in path.read_text(errors="replace")
                  for path in (package_root / "sglang" / "srt").rglob("*.py"))
    return flags + (RETRACTION_BACKUP_FLAGS if defined else ())


def server_argv(env: ServingEnv, model: TinyModel, role_flags: tuple[str, ...], port: int) -> list[str]:
    return [
        str(env.python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model.path),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *COMMON_FLAGS,
        *role_flags,
    ]


def nccl_port_names(setup: ServingSetup) -> tuple[str, ...]:
    """The extra port a server of `setup` is started on: its torch-distributed port, a free one
    chosen (and retried) as the others, where the setup passes --nccl-port."""
    return ("nccl",) if setup.nccl_port else ()


def with_setup_flags(setup: ServingSetup, role: tuple[str, ...], ports: dict[str, int]) -> tuple[str, ...]:
    """A server's role flags and what its setup adds: --nccl-port, --mem-fraction-static."""
    flags = (*role, "--nccl-port", str(ports["nccl"])) if setup.nccl_port else role
    if setup.mem_fraction_static is not None:
        flags += ("--mem-fraction-static", str(setup.mem_fraction_static))
    return flags


@contextlib.contextmanager
def deployed(env: ServingEnv, package_root: Path, version: str, model: TinyModel,
             workdir: Path) -> Iterator[Deployment]:
    """Prefill, decode and router of one tree on free loopback ports; all stopped on leaving."""
    workdir.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    setup = serving_for(version)
    setup_env = server_environment(setup, RESERVED_DECODE_TOKENS)
    server_env = {**base, **SERVER_ENV, **setup_env, "PYTHONNOUSERSITE": "1",
                  "PYTHONPATH": env.pythonpath(package_root, pythonpath_extras(setup))}
    started = time.monotonic()
    decode_role = decode_flags(package_root, setup)
    nccl = nccl_port_names(setup)

    def prefill_argv(ports: dict[str, int]) -> list[str]:
        role = (*PREFILL_FLAGS, "--disaggregation-bootstrap-port", str(ports["bootstrap"]))
        return server_argv(env, model, with_setup_flags(setup, role, ports), ports["prefill"])

    def router_argv(ports: dict[str, int]) -> list[str]:
        return [
            *router_command(env),
            "launch",
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(prefill.ports[1]),
            "--decode",
            decode.url,  # ports[1]: bootstrap
            "--host",
            LOOPBACK,
            "--port",
            str(ports["router"]),
            "--prometheus-host",
            LOOPBACK,
            "--prometheus-port",
            str(ports["metrics"]),
        ]

    with Processes(workdir) as processes:
        # each started on free loopback ports, again on others if one was taken meanwhile
        pair = serve(
            processes,
            [
                Launch("prefill", prefill_argv, ("prefill", "bootstrap", *nccl), server_env),
                Launch(
                    "decode",
                    lambda ports: server_argv(env, model, with_setup_flags(setup, decode_role, ports),
                                              ports["decode"]),
                    ("decode", *nccl),
                    server_env,
                ),
            ],
            "/health",
            SERVER_START_TIMEOUT,
        )
        prefill, decode = pair["prefill"], pair["decode"]
        if setup.health_before_warmup:
            wait_warmed_up([prefill, decode], SERVER_START_TIMEOUT)
        router = serve(processes, [Launch("router", router_argv, ("router", "metrics"), base)],
                       "/readiness", ROUTER_START_TIMEOUT, ready=_router_ready)["router"]
        flags = {"common": list(COMMON_FLAGS), "prefill": list(PREFILL_FLAGS), "decode": list(decode_role),
                 "environment": {**SERVER_ENV, **setup_env}, "setup": record(setup)}
        yield Deployment(version, router.url, prefill, decode, router, time.monotonic() - started, flags,
                         flush_frees_held_pages=flush_frees_held_pages(package_root))
