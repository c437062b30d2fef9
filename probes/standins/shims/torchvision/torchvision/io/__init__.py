import enum


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def _unavailable(*_args, **_kwargs):
    raise RuntimeError("torchvision stand-in: image decoding is not available in the probe environment")


decode_jpeg = _unavailable
decode_image = _unavailable
read_image = _unavailable
