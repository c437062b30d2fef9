# The same stand-in as torchvision.transforms.functional: every name exists, calling it fails.
from torchvision.transforms.functional import __getattr__  # noqa: F401
