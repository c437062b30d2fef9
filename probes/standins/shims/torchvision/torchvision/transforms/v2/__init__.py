from torchvision.transforms import InterpolationMode  # noqa: F401

from . import functional  # noqa: F401


def __getattr__(name):
    raise AttributeError(
        f"torchvision stand-in: transforms.v2.{name} is not available in the probe environment"
    )
