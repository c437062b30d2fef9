"""Stand-in for sgl_kernel (SGLang's CUDA kernels) in the CPU probe environment.

0.5.10 - 0.5.12 import `sgl_kernel.kvcacheio`'s host<->device KV copy kernels at module level
(`mem_cache/memory_pool_host.py`, reached from the scheduler). The probes never copy KV on a
device, so every name resolves to a function that raises when called: a case that reached a
kernel fails loudly (`error`) instead of silently doing nothing.
"""

__version__ = "0.0.0+sglang-backport-stand-in"


def _kernel(qualified: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel stand-in: GPU kernel {qualified} called in the CPU probe environment")

    kernel.__name__ = qualified.rsplit(".", 1)[-1]
    kernel.__qualname__ = qualified
    return kernel


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _kernel(f"sgl_kernel.{name}")
