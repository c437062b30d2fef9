"""Stand-in for vllm in the live tier's servers of SGLang 0.4.5.post1 - 0.5.7.

Those releases take their activation and RMSNorm layers from vLLM on a CPU without AMX
(`sglang/srt/layers/activation.py` and `layernorm.py` import them when sgl_kernel is not used), and
vLLM has no CPU wheel for torch 2.13. Unlike the probes' stand-in (probes/standins/shims/vllm, whose
layers raise when built), these layers compute, in plain torch, what vLLM's do: a server built on
them answers with the same greedy tokens as `transformers` on the same weights (the live tier's
reference check proves it per request). Only the modules SGLang imports exist here; vLLM's
kernels (`vllm._custom_ops`) are names that raise when called, so a path that would need one
fails loudly instead of computing something else.
"""

__version__ = "0.0.0+sglang-backport-serving-stand-in"
