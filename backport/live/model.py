"""The live tier's tiny model and its prompts: made offline by `make_model.py`, cached by content.

The prompts are token ids (the WordLevel tokenizer maps `tN` to id N), chosen against the pair's
deliberate misconfiguration (`servers.PAIR_SHAPE`): prefill pool 256 tokens (input limit 250),
context 1024, decode pool 512.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

from backport import cache
from backport.errors import Finding

MAKER = Path(__file__).resolve().parent / "make_model.py"
NEW_TOKENS = 8


def _ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


# name -> (input ids, max_new_tokens); each scenario names the prompts it sends
PROMPTS: dict[str, list[int]] = {
    "valid": [5, 17, 42, 99],
    # the earlier requests of the leak scenario: they fit the prefill pool and differ everywhere
    "earlier_a": _ids(1, 200),
    "earlier_b": _ids(2, 200),
    # within the context (1024), above the prefill pool (256)
    "over_pool": _ids(3, 400),
}


@dataclass(frozen=True)
class TinyModel:
    path: Path
    reference: dict[str, list[int]]   # prompt name -> plain transformers' greedy tokens
    sha256: str                        # of the weights file


def model_key(prompts: dict[str, tuple[list[int], int]] | None = None,
              shape: dict[str, int] | None = None) -> str:
    material = MAKER.read_bytes() + json.dumps([PROMPTS, NEW_TOKENS], sort_keys=True).encode()
    if prompts is not None or shape is not None:  # the default model's key stays what it was
        material += json.dumps([prompts, shape], sort_keys=True).encode()
    return hashlib.sha256(material).hexdigest()[:16]


def ensure_model(python: Path, *, name: str = "tiny-llama", shape: dict[str, int] | None = None,
                 prompts: dict[str, tuple[list[int], int]] | None = None) -> TinyModel:
    """The cached model (made on first use by `python`, which has torch and transformers).
    `shape` overrides entries of make_model.SHAPE (config integers by name); `prompts` (name -> (ids,
    new tokens)) replaces PROMPTS."""
    final = cache.cache_root() / "models" / f"{name}-{model_key(prompts, shape)}"
    wanted = prompts if prompts is not None else {n: (ids, NEW_TOKENS) for n, ids in PROMPTS.items()}
    if not (final / "reference.json").is_file():
        def build(staged: Path) -> None:
            staged.mkdir(parents=True, exist_ok=True)
            prompts_file = staged / "prompts.json"
            prompts_file.write_text(json.dumps({n: {"input_ids": ids, "max_new_tokens": new}
                                                for n, (ids, new) in wanted.items()}))
            proc = subprocess.run([str(python), str(MAKER), str(staged), str(prompts_file),
                                   json.dumps(shape or {})],
                                  capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-6:])
                raise Finding(f"{MAKER.name}: making the tiny model failed:\n{tail}")

        cache.build_entry(final, build)
    reference = json.loads((final / "reference.json").read_text())
    digest = hashlib.sha256((final / "model.safetensors").read_bytes()).hexdigest()
    return TinyModel(final, reference, digest)
