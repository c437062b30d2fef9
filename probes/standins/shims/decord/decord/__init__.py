"""Stand-in for decord (video decoding) in the CPU probe environment.

SGLang 0.4.5.post1 imports `decord.VideoReader` and `decord.cpu` at module level in a multimodal
processor reached from the scheduler; the probes decode no video, so every name raises when called.
"""

__version__ = "0.0.0+sglang-backport-stand-in"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"decord stand-in: {name} used in the CPU probe environment (no video decoding)")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable
