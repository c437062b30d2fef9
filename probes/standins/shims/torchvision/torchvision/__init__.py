"""Stand-in for torchvision in the CPU probe environment.

PyPI's torchvision either pulls a CUDA torch or fails to import beside the CPU
torch wheel ("operator torchvision::nms does not exist"), while SGLang imports
`torchvision.io.decode_jpeg` and a few transform enums at module level. The
probes never decode an image, so this package provides those names and makes
every other use fail loudly instead of silently doing nothing.
"""

__version__ = "0.0.0+sglang-backport-stand-in"


def __getattr__(name):
    raise AttributeError(f"torchvision stand-in: {name!r} is not available in the probe environment")
