"""Stand-in for vllm in the CPU probe environment.

SGLang 0.4.5.post1 - 0.4.10.post2 import vLLM's kernels at module level where sgl_kernel is not
used (`vllm._custom_ops` in the rotary embedding and MoE layers, `GeluAndMul`/`SiluAndMul` from
`vllm.model_executor.layers.activation`), reached from the scheduler. The real vllm pulls a CUDA
torch. Only those two modules exist here (a deeper `vllm...` import fails as without vllm, so
SGLang's optional vLLM paths stay off); every kernel and layer raises when used.
"""

__version__ = "0.0.0+sglang-backport-stand-in"


def _unavailable(qualified: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"vllm stand-in: {qualified} called in the CPU probe environment")

    kernel.__name__ = qualified.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualified
    return kernel
