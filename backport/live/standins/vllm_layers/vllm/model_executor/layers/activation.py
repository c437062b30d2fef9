"""`vllm.model_executor.layers.activation`'s gated activations, in plain torch.

The input's last dimension holds the gate and the up projection side by side; the output is
act(gate) * up, half as wide (the layout SGLang's merged gate/up projection writes).
"""

import torch
import torch.nn.functional as F
from torch import nn


class _GatedActivation(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return self.act(x[..., :half]) * x[..., half:]

    forward_native = forward  # the name SGLang calls on vLLM's CustomOp layers where it picks a path


class SiluAndMul(_GatedActivation):
    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


class GeluAndMul(_GatedActivation):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def act(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate=self.approximate)
