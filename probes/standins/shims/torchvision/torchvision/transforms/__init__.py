import enum

from . import functional  # noqa: F401


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name):
    raise AttributeError(f"torchvision stand-in: transforms.{name} is not available in the probe environment")
