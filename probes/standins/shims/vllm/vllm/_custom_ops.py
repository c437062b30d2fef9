"""Stand-in for `vllm._custom_ops`: every kernel name resolves to a function that raises when called."""

from vllm import _unavailable


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _unavailable(f"vllm._custom_ops.{name}")
