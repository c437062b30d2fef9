"""`vllm.model_executor.layers.layernorm`'s RMSNorm and GemmaRMSNorm, in plain torch.

Called as vLLM's are: `norm(x)` returns the normalized x; `norm(x, residual)` adds the residual
first and returns (normalized sum, sum), the fused form SGLang's decoder layers use. The
statistics are taken in float32 and the result cast back, as vLLM does.
"""

import torch
from torch import nn


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    wide = x.float()
    return wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size=None, has_weight: bool = True,
                 dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.has_weight = has_weight
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype)) if has_weight else None

    def scale(self) -> torch.Tensor | None:
        return self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = _rms(x, self.variance_epsilon)
        scale = self.scale()
        if scale is not None:
            out = out * scale.float()
        out = out.to(x.dtype)
        return out if residual is None else (out, residual)

    forward_native = forward


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant: the weight starts at zero and scales by (1 + weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def scale(self) -> torch.Tensor:
        weight = self.weight
        assert weight is not None  # Gemma's norm always has its weight
        return 1.0 + weight
