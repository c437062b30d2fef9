# Any function imported from here exists, but calling it fails: the probes decode no images.
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError(f"torchvision stand-in: {name}() is not available in the probe environment")

    _unavailable.__name__ = name
    return _unavailable
