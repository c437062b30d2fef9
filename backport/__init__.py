"""sglang-backport: backport SGLang's PD disaggregation KV-exposure fixes and prove them."""

__version__ = "0.1.0"
