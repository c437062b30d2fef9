"""The stand-in packages of probes/standins/shims/ (vllm, decord for older releases; mori): importable,
and every kernel, layer or decoder in them raises when used, so a case that reached one is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHIMS = Path(__file__).resolve().parent.parent / "probes" / "standins" / "shims"

SCRIPT = """
import pytest
from vllm import _custom_ops as ops
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
import decord
for call in (lambda: ops.rotary_embedding(1), lambda: SiluAndMul(), lambda: GeluAndMul(),
             lambda: decord.VideoReader("x.mp4"), lambda: decord.cpu(0)):
    with pytest.raises(RuntimeError, match="stand-in"):
        call()
try:  # only the two modules SGLang imports exist: its optional vLLM paths stay off
    import vllm.model_executor.layers.quantization.aqlm
except ImportError:
    print("ok")
"""


def test_vllm_and_decord_stand_ins_raise_when_used():
    path = [str(SHIMS / "vllm"), str(SHIMS / "decord")]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


MORI_SCRIPT = """
import pytest
from mori.cpp import TransferStatus
from mori.io import (BackendType, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType, PollCqMode,
                     RdmaBackendConfig)
engine = IOEngine("io-decode-probe", IOEngineConfig(host="127.0.0.1", port=0))
engine.create_backend(BackendType.RDMA, RdmaBackendConfig(1, 1, 1, PollCqMode.POLLING, False))
desc = engine.get_engine_desc()
assert desc.port > 0 and type(desc).unpack(desc.pack()) == desc
mem = engine.register_memory(4096, 256, 0, MemoryLocationType.GPU)
assert MemoryDesc.unpack(mem.pack()) == mem
for call in (lambda: engine.allocate_transfer_uid(), lambda: engine.batch_write([], [], [], [], [], []),
             lambda: engine.wait_all([], timeout_ms=1), lambda: engine.register_remote_engine(desc),
             lambda: TransferStatus()):
    with pytest.raises(RuntimeError, match="stand-in"):
        call()
print("ok")
"""


def test_mori_stand_in_builds_an_engine_without_a_nic_and_raises_on_transfers():
    """What a Mori manager's constructor does works (engine, backend, local registration); every
    data-path call, which needs an RDMA NIC, raises."""
    proc = subprocess.run([sys.executable, "-c", MORI_SCRIPT], capture_output=True, text=True, timeout=60,
                          check=False, env={"PYTHONPATH": str(SHIMS / "mori"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
