"""The third-party packages every release imports, imported ahead of the tree's own `sglang`.

The probe matrix imports them once before forking a child per tree; a harness that records
coverage imports them before coverage starts, so the tracer follows only the tree's code (the
files it measures are all under `sglang/`).
"""

from __future__ import annotations

import importlib
import sys
import time

# Third-party packages SGLang's scheduler and disaggregation modules import on every release.
# A name that is missing in this environment is skipped; none of them is `sglang`.
PRELOAD = (
    "torch", "numpy", "transformers", "openai", "sympy", "networkx", "triton", "fastapi", "aiohttp",
    "pydantic", "huggingface_hub", "xgrammar", "compressed_tensors", "gguf", "rich", "jinja2", "uvicorn",
    "zmq", "requests", "PIL", "psutil", "safetensors", "tokenizers", "einops", "orjson", "msgspec",
    # torch's own submodules that SGLang's import chain reaches (measured with -X importtime on
    # 0.5.19: torch._inductor alone was 3 s of a child's 12 s), and smaller packages it pulls in
    "torch._inductor.compile_fx", "torch._dynamo", "torch.distributed", "torch.export", "IPython",
    "prometheus_client", "fsspec", "transformers.processing_utils", "transformers.modeling_outputs",
)


def preload() -> dict[str, float]:
    timings = {}
    for name in PRELOAD:
        started = time.monotonic()
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - an optional package; the child imports what it needs
            continue
        timings[name] = round(time.monotonic() - started, 3)
    if "sglang" in sys.modules:
        raise RuntimeError("a preloaded package imported sglang; the children would share it")
    return timings
