"""Stand-in for `vllm.model_executor.layers.activation`: the two activation layers SGLang imports
where sgl_kernel is not used; building one raises (the probes build no model layer)."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"vllm stand-in: {type(self).__name__} built in the CPU probe environment")


class GeluAndMul(_Unavailable):
    pass


class SiluAndMul(_Unavailable):
    pass
