"""How the live tier serves each release: four serving setups by release range, and their exceptions.

One interpreter (the CPU probe environment, torch 2.13) serves every pinned release; what an
older release needs on top is stated here once, as data, and read from the trees' code (the
reasons say where). A setup adds to the one after it: each older range needs what the newer
ones need and more. `serving_for(version)` resolves a release to its setup and the exceptions
that hold inside its range; `deployed()` builds the servers' argv and environment from that, and
the bundle's `server` record names the setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from backport import resources
from backport.errors import BadInput

STAND_INS = Path(__file__).resolve().parent / "standins"
VLLM_LAYERS = STAND_INS / "vllm_layers"       # computing plain-torch layers for vLLM's (no CPU wheel)
SERVER_ADDONS = STAND_INS / "server_addons"  # a sitecustomize: the probes' add-ons, the 4-CPU host, the route
STAND_IN_CPUS = 4


@dataclass(frozen=True)
class ServingSetup:
    name: str
    releases: str                       # PEP 440 specifier: the range it serves
    adds: tuple[str, ...] = ()          # what it adds to the next newer setup, and why (docs table)
    vllm_layers: bool = False           # VLLM_LAYERS on PYTHONPATH
    nccl_port: bool = False             # --nccl-port <free port>: their own random choice races
    addons: bool = False                # the probes' add-ons in every server process
    reserved_tokens_env: bool = False   # SGLANG_NUM_RESERVED_DECODE_TOKENS instead of the flag
    stand_in_cpus: int | None = None    # os.cpu_count() reports at least this many in the servers
    decode_pool_extra: int = 0          # decode's --max-total-tokens raised by this many
    health_before_warmup: bool = False  # /health answers 200 at once: ready is the warmup's log line
    configured_route: bool = False      # the host's route lookup answers SGLANG_HOST_IP (loopback)
    mem_fraction_static: float | None = None  # --mem-fraction-static: the release cannot pick one on a CPU
    exceptions: tuple[str, ...] = ()    # the exceptions that applied (their reasons), once resolved

    def covers(self, version: str) -> bool:
        return SpecifierSet(self.releases).contains(Version(version), prereleases=True)


@dataclass(frozen=True)
class SetupException:
    releases: str       # PEP 440 specifier, inside one setup's range
    changes: dict = field(default_factory=dict)   # ServingSetup fields set for these releases
    reason: str = ""


_VLLM = (
    "vLLM's activation and RMSNorm layers, taken by sglang/srt/layers/{activation,layernorm}.py on a CPU "
    "without AMX (no vLLM CPU wheel for torch 2.13): computing plain-torch stand-ins"
)
_TORCHAO = "torchao (in requirements-serve.txt, --no-deps; imports with torch 2.13)"
_NCCL = ("--nccl-port on a free port: the torch-distributed port they pick at random raced (a decode of "
         "0.5.2 - 0.5.7 died on EADDRINUSE; pristine 0.5.16's 2P1D decode died in torch's rendezvous)")

_ADDONS = ("the probes' add-ons (probes/standins/addons.py) in every server process, through a "
           "sitecustomize: torch._C._cpu._is_amx_tile_supported (0.4.8 - 0.5.1 call it at import) and "
           "triton's cache-dir names (0.4.5.post1 - 0.4.9.x import them); set only where the module "
           "lacks the name")
_RESERVED = ("SGLANG_NUM_RESERVED_DECODE_TOKENS=16 in the servers' environment: the "
             "--num-reserved-decode-tokens flag starts at 0.4.7.post1; decode.py reads the variable")

SETUPS = (
    ServingSetup("0.5.8+", ">=0.5.8", (_NCCL,), nccl_port=True),
    ServingSetup("vllm-layers", ">=0.5.2,<0.5.8", (_VLLM, _TORCHAO), vllm_layers=True, nccl_port=True),
    ServingSetup("addons", ">=0.4.7.post1,<0.5.2", (_ADDONS,), vllm_layers=True, nccl_port=True, addons=True),
    ServingSetup("reserved-tokens-env", ">=0.4.5.post1,<0.4.7.post1", (_RESERVED,),
                 vllm_layers=True, addons=True, reserved_tokens_env=True),
)

EXCEPTIONS = (
    SetupException(
        "<0.4.10.post2",
        {"health_before_warmup": True},
        "http_server.py's /health returns 200 unconditionally up to 0.4.10.post1, before the "
        "server's warmup request finished (0.4.6.post5: 2 min later, and the first requests timed "
        "out); the server is ready when its log says \"The server is fired up and ready to roll\"",
    ),
    SetupException(
        "<0.4.9",
        {"nccl_port": False},
        "server_args.py defines --nccl-port from 0.4.9; older releases pick their own port (the race "
        "stays: a bind failure is seen and the server started again)",
    ),
    SetupException(
        ">=0.4.6,<0.4.7",
        {"stand_in_cpus": STAND_IN_CPUS},
        "Mooncake's KV sender pool is ThreadPoolExecutor(os.cpu_count() // 4) on 0.4.6 - 0.4.6.post5: "
        "0 threads on a 2-core host stops prefill at start; the servers see a stand-in 4-core host "
        "(os.cpu_count() at least 4; torch's own thread pools are unchanged)",
    ),
    SetupException(
        "<0.4.6.post3",
        {"reserved_tokens_env": False, "decode_pool_extra": 512 - 16},
        "decode.py hard-codes 512 reserved decode tokens (no flag, no variable before 0.4.6.post3): "
        "decode's pool is raised by 496 so a request's reservation leaves the same room as 16 "
        "reserved tokens in the 512-token pool",
    ),
    SetupException(
        ">=0.4.5.post3,<0.4.6.post5",
        {"mem_fraction_static": 0.88},
        "server_args.py compares the device memory with 81920 MB to pick --mem-fraction-static, and on a "
        "CPU that memory is None (TypeError at start, 0.4.5.post3 - 0.4.6.post4; 0.4.6.post5 tests for "
        "None): the servers get 0.88, what these releases pick for one rank up to 80 GB and what "
        "0.4.6.post5 picks on a CPU (the pool itself is set by --max-total-tokens)",
    ),
    SetupException(
        "<0.5.3",
        {"configured_route": True},
        "Mooncake's connector takes its own address from sglang.srt.utils.get_local_ip_by_remote (the "
        "route to a public address; SGLANG_LOCAL_IP_NIC skips 127.0.0.1), not SGLANG_HOST_IP, up to "
        "0.5.2 (0.5.3's get_local_ip_auto tries get_ip first): the pair advertised the host's address "
        "and the race's namespace, with no route, stopped prefill (\"Can not get local ip\"); in the "
        "servers, that lookup answers SGLANG_HOST_IP, the loopback address the deployment set",
    ),
)


def serving_for(version: str) -> ServingSetup:
    """The setup for `version`, with the exceptions that hold for it applied; BadInput outside every range."""
    try:
        parsed = Version(version)
    except ValueError:
        raise BadInput(
            f"{version!r}: not a release version; the live tier picks its serving setup by it"
        ) from None
    matches = [s for s in SETUPS if s.covers(str(parsed))]
    if len(matches) != 1:
        ranges = ", ".join(f"{s.name} {s.releases}" for s in SETUPS)
        raise BadInput(f"sglang {version}: no serving setup of the live tier covers it ({ranges})")
    setup = matches[0]
    for exception in EXCEPTIONS:
        if SpecifierSet(exception.releases).contains(parsed, prereleases=True):
            setup = replace(setup, **exception.changes, exceptions=(*setup.exceptions, exception.reason))
    return setup


def pythonpath_extras(setup: ServingSetup) -> list[str]:
    """Folders the setup puts on the servers' PYTHONPATH, ahead of the overlay and the tree."""
    extras = [str(VLLM_LAYERS)] if setup.vllm_layers else []
    if setup.addons or setup.stand_in_cpus or setup.configured_route:
        extras.append(str(SERVER_ADDONS))
    return extras


def server_environment(setup: ServingSetup, reserved_decode_tokens: int) -> dict[str, str]:
    env = {}
    if setup.addons:
        env["SGLANG_BACKPORT_ADDONS"] = str(resources.probes_dir() / "standins" / "addons.py")
    if setup.stand_in_cpus:
        env["SGLANG_BACKPORT_STAND_IN_CPUS"] = str(setup.stand_in_cpus)
    if setup.configured_route:
        env["SGLANG_BACKPORT_CONFIGURED_ROUTE"] = "1"
    if setup.reserved_tokens_env:
        env["SGLANG_NUM_RESERVED_DECODE_TOKENS"] = str(reserved_decode_tokens)
    return env


def record(setup: ServingSetup) -> dict:
    """The bundle's account of the setup that served (the `server` record's `setup`)."""
    return {
        "name": setup.name,
        "releases": setup.releases,
        "vllm_layers": setup.vllm_layers,
        "nccl_port": setup.nccl_port,
        "addons": setup.addons,
        "reserved_tokens_env": setup.reserved_tokens_env,
        "stand_in_cpus": setup.stand_in_cpus,
        "decode_pool_extra": setup.decode_pool_extra,
        "health_before_warmup": setup.health_before_warmup,
        "configured_route": setup.configured_route,
        "mem_fraction_static": setup.mem_fraction_static,
        "exceptions": list(setup.exceptions),
    }
