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
    "torch",
    "numpy",
    "transformers",
    "openai",
    "sympy",
    "networkx",
    "triton",
    "fastapi",
    "aiohttp",
    "pydantic",
    "huggingface_hub",
    "xgrammar",
    "compressed_tensors",
    "gguf",
    "rich",
    "jinja2",
    "uvicorn",
    "zmq",
    "requests",
    "PIL",
    "psutil",
    "safetensors",
    "tokenizers",
    "einops",
    "orjson",
    "msgspec",
    # torch's own submodules that SGLang's import chain reaches (measured with -X importtime on
    # 0.5.19: torch._inductor alone was 3 s of a child's 12 s), and smaller packages it pulls in
    "torch._inductor.compile_fx",
    "torch._dynamo",
    "torch.distributed",
    "torch.export",
    "IPython",
    "prometheus_client",
    "fsspec",
    "transformers.processing_utils",
    "transformers.modeling_outputs",
    # what the tree's own import still paid per child (-X importtime, 0.5.10, 0.5.13, 0.5.17, 0.5.23):
    # pydantic.v1 was 0.44 s of 0.5.23's import, cpp_extension (setuptools) 43 ms, aiohttp.web 22 ms
    "pydantic.v1",
    "torch.utils.cpp_extension",
    "aiohttp.web",
    "zmq.asyncio",
    "huggingface_hub._buckets",
    "transformers.models.auto.tokenization_auto",
    "transformers.modeling_layers",
    "transformers.image_processing_utils",
    "transformers.models.llama",
    "partial_json_parser",
    "pybase64",
    "setproctitle",
    "multiprocessing.shared_memory",
    "triton.tools.tensor_descriptor",
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
