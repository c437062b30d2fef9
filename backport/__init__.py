"""sglang-backport: backport SGLang's PD disaggregation KV-exposure fixes and prove them."""

from importlib.metadata import PackageNotFoundError, version

try:
    # pyproject.toml is the one place the version is written; receipts, audit reports and
    # --version all read it here, from the installed distribution's metadata.
    __version__ = version("sglang-backport")
except PackageNotFoundError:  # the package imported from a source tree that was never installed
    __version__ = "0+unknown"
