"""Stand-in for `sgl_kernel.kvcacheio`: every kernel name raises when called (see the package)."""

from sgl_kernel import _kernel


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _kernel(f"sgl_kernel.kvcacheio.{name}")
