"""The serving setups on real PD deployments: one release per setup older than 0.5.8.

0.5.5.post1 (vllm-layers), 0.4.10.post2 (addons), 0.4.6.post5 (reserved-tokens-env, with the
4-CPU host stand-in): each pristine pair is started, a valid prompt is answered and the over-pool
prompt gets 200 (the incident); the patched pair is started and answers the valid prompt. No
2P1D race and no scenario sequence here (tests/test_live.py and `live` run those): a pair, two or
three requests, stopped. Measured at this stop (`pytest -v tests/test_live_setups.py`, 2 cores
shared with three other helpers' jobs and their pairs): 7 passed in 1,579 s, of which about 8 min
the first pair with the serving overlay built in the test cache, then 4 - 5 min per pair; peak
RSS of the pytest process 0.7 GB (the servers are its children). The code-fact test added after
(15 cases, trees only) took 11 s.
The computing vLLM stand-in is checked against plain torch first (probe interpreter only).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from backport.live import setups
from tests.conftest import _with_cache

RELEASES = ("0.5.5.post1", "0.4.10.post2", "0.4.6.post5")

STAND_IN_CHECK = """
import json, torch, torch.nn.functional as F
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
torch.manual_seed(0)
x, r = torch.randn(3, 8), torch.randn(3, 8)
norm = RMSNorm(8, eps=1e-5)
with torch.no_grad():
    norm.weight.copy_(torch.randn(8))
def rms(v, w):
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w
out, res = norm(x, r)
def kernel_raises():
    from vllm import _custom_ops
    try:
        _custom_ops.rms_norm(x)
    except RuntimeError:
        return True
    return False
gemma = GemmaRMSNorm(8, eps=1e-5)
print(json.dumps({
    "silu": torch.allclose(SiluAndMul()(x), F.silu(x[:, :4]) * x[:, 4:]),
    "gelu": torch.allclose(GeluAndMul("tanh")(x), F.gelu(x[:, :4], approximate="tanh") * x[:, 4:]),
    "rms": torch.allclose(norm(x), rms(x, norm.weight), atol=1e-6),
    "rms_residual": torch.allclose(out, rms(x + r, norm.weight), atol=1e-6) and torch.equal(res, x + r),
    "gemma": torch.allclose(gemma(x), rms(x, 1.0), atol=1e-6),
    "kernel_raises": kernel_raises(),
}))
"""


@pytest.mark.probe_env
def test_vllm_layer_stand_ins_compute_what_vllm_computes(probe_python):
    out = subprocess.run([probe_python, "-c", STAND_IN_CHECK], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(setups.VLLM_LAYERS), "PATH": "/usr/bin:/bin"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"silu": True, "gelu": True, "rms": True, "rms_residual": True, "gemma": True,
                      "kernel_raises": True}


@pytest.fixture(scope="module")
def serving(shared_cache, probe_python):
    from backport.live import ensure_model, ensure_serving_env

    with _with_cache(shared_cache):
        env = ensure_serving_env(probe_python)
        return env, ensure_model(env.python)


def _drive(serving, tree, workdir: Path, over_pool: bool) -> dict:
    from backport.live.deployment import deployed
    from backport.live.model import PROMPTS

    env, model = serving
    with deployed(env, Path(tree.package_root), tree.version, model, workdir) as dep:
        result = {"setup": dep.flags["setup"]["name"], "startup": dep.startup_seconds,
                  "valid": dep.generate(PROMPTS["valid"])}
        if over_pool:
            result["over_pool"] = dep.generate(PROMPTS["over_pool"])
    return result


@pytest.mark.live
@pytest.mark.probe_env
@pytest.mark.parametrize("version", RELEASES)
def test_pristine_pair_serves_and_shows_the_incident(serving, release_tree, tmp_path, version):
    result = _drive(serving, release_tree(version), tmp_path, over_pool=True)
    assert result["setup"] == setups.serving_for(version).name
    assert result["valid"].status == 200, result["valid"]
    over = result["over_pool"]
    assert over.status == 200 and over.prompt_tokens == 400, over   # served though the prefill pool is 256


@pytest.mark.live
@pytest.mark.probe_env
@pytest.mark.parametrize("version", RELEASES)
def test_patched_pair_serves(serving, patched_tree, tmp_path, version):
    tree, _report = patched_tree(version)
    result = _drive(serving, tree, tmp_path, over_pool=False)
    assert result["valid"].status == 200, result["valid"]


CODE_FACT_RELEASES = (
    "0.5.23",   # --nccl-port from ServerArgs' annotation (0.5.14 on)
    "0.5.16",
    "0.5.8",
    "0.5.7",
    "0.5.3",
    "0.5.2",
    "0.5.1.post3",
    "0.4.10.post2",
    "0.4.10.post1",
    "0.4.9",
    "0.4.8.post1",
    "0.4.7.post1",
    "0.4.7",
    "0.4.6.post5",
    "0.4.6.post4",
    "0.4.6.post3",
    "0.4.6.post2",
    "0.4.6",
    "0.4.5.post3",
    "0.4.5.post2",
)


@pytest.mark.probe_env
@pytest.mark.parametrize("version", CODE_FACT_RELEASES)
def test_each_setup_field_is_what_the_trees_code_says(release_tree, version):
    """The boundaries of setups.py against the real wheels' code, at and around each one."""
    import re

    srt = Path(release_tree(version).package_root) / "sglang" / "srt"
    setup = setups.serving_for(version)

    def read(relative: str) -> str:
        return (srt / relative).read_text(errors="replace")

    server_args, decode = read("server_args.py"), read("disaggregation/decode.py")

    # 0.5.14 on make flags from ServerArgs' `field: A[...]` annotations (0.5.20 on in arg_groups/fields/)
    groups = sorted(srt.glob("arg_groups/**/*.py"))
    declared = server_args + "".join(p.read_text(errors="replace") for p in groups)

    def has_flag(flag: str) -> bool:
        field = flag.removeprefix("--").replace("-", "_")
        return flag in server_args or re.search(rf"^\s+{field}: A\[", declared, re.M) is not None
    assert ("vllm.model_executor.layers.activation" in read("layers/activation.py")) == setup.vllm_layers
    assert has_flag("--nccl-port") == setup.nccl_port
    flag = has_flag("--num-reserved-decode-tokens")
    assert flag == (not setup.reserved_tokens_env and not setup.decode_pool_extra)
    assert flag or ("SGLANG_NUM_RESERVED_DECODE_TOKENS" in decode) == setup.reserved_tokens_env
    assert ("cpu_count // 4" in read("disaggregation/mooncake/conn.py")) == bool(setup.stand_in_cpus)
    health = re.search(
        r"async def health\(\)[^\n]*\n(.*?)\n\n\n", read("entrypoints/http_server.py"), re.DOTALL
    )
    body = health.group(1) if health else ""   # newer releases take the request: not this plain form
    unconditional = body.strip().endswith("return Response(status_code=200)") and body.count("\n") < 3
    assert unconditional == setup.health_before_warmup
    assert _connector_takes_the_routed_address(srt) == setup.configured_route
    # the memory fraction picked by comparing a device memory that is None on a CPU (a TypeError)
    assert ("if gpu_mem <= 81920:" in server_args) == (setup.mem_fraction_static is not None)


def _connector_takes_the_routed_address(srt: Path) -> bool:
    """Mooncake's connector calls get_local_ip_by_remote, itself or through a get_local_ip_auto that
    does not try get_ip (SGLANG_HOST_IP) first."""
    conn = (srt / "disaggregation" / "mooncake" / "conn.py").read_text(errors="replace")
    if "get_local_ip_by_remote()" in conn:
        return True
    if "get_local_ip_auto(" not in conn:
        return False
    for utils in (srt / "utils.py", *sorted((srt / "utils").glob("*.py"))):
        text = utils.read_text(errors="replace") if utils.is_file() else ""
        if "def get_local_ip_auto(" in text:
            body = text.split("def get_local_ip_auto(", 1)[1].split("\ndef ", 1)[0]
            return "get_local_ip_by_remote()" in body and "get_ip()" not in body
    return False
