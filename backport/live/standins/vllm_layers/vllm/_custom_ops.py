"""Stand-in for `vllm._custom_ops`: a name for every kernel, each raising when called (no CPU build)."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args, **kwargs):
        raise RuntimeError(f"vllm serving stand-in: vllm._custom_ops.{name} has no CPU implementation here")

    kernel.__name__ = name
    return kernel
