"""The patch pack (quilt layout, DEP-3 headers): its model and its loader."""

from .load import load_pack, load_variant
from .model import FilePatch, FingerprintRule, Fix, Pack, PatchVariant

__all__ = ["FilePatch", "FingerprintRule", "Fix", "Pack", "PatchVariant", "load_pack", "load_variant"]
