"""The live tier: the incident reproduced, and closed, on a real SGLang PD deployment on a CPU.

environment (serving overlay, router venv) -> model (tiny Llama + reference tokens) ->
deployment (prefill, decode, router on loopback; servers.py owns the processes) ->
scenarios (registered, judged per request) -> tier (per tree, one document); per tree also
race (the page-lifetime race on its own 2P1D deployment in a private network namespace: netns).
"""

from backport.live.environment import ServingEnv, ensure_serving_env
from backport.live.model import TinyModel, ensure_model
from backport.live.scenarios import REGISTRY, SAFE, UNSAFE
from backport.live.tier import run_live

__all__ = ["REGISTRY", "SAFE", "UNSAFE", "ServingEnv", "TinyModel", "ensure_model", "ensure_serving_env",
           "run_live"]
