"""The stand-in packages of probes/shims/ for older releases (vllm, decord): importable, and every
kernel, layer or decoder in them raises when used, so a case that reached one is an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SHIMS = Path(__file__).resolve().parent.parent / "probes" / "shims"

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
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False,
                          env={"PYTHONPATH": ":".join(path), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
