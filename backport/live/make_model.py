"""Make the live tier's tiny model, offline and deterministically, and its reference tokens.

Run by the serving interpreter (it needs torch, transformers and tokenizers, never `backport`):
    python make_model.py OUT_DIR PROMPTS_JSON [SHAPE_JSON]
A 2-layer Llama with seeded random weights and a WordLevel tokenizer (token `tN` is id N), saved
as a Hugging Face model folder SGLang loads with `--model-path`; then, for each prompt in
PROMPTS_JSON ({"name": {"input_ids": [...], "max_new_tokens": N}}), the greedy continuation by
plain `transformers` on the same weights, written to OUT_DIR/reference.json. A server whose
answer equals it computed attention over the prompt's real KV: for a PD pair, the bytes Mooncake
moved from prefill to decode. SHAPE_JSON (optional) overrides entries of SHAPE: the page-lifetime
race needs more KV per token than the default model has.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 20260
SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(SPECIAL)
    vocab.update({f"t{i}": i for i in range(len(SPECIAL), SHAPE["vocab_size"])})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)


def make_weights(out: Path, shape: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(**shape, bos_token_id=SPECIAL["<s>"], eos_token_id=SPECIAL["</s>"],
                         tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # default init gives near-uniform logits; wider weights make greedy argmax well separated
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return model


def greedy(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, EOS ignored (as the live requests ask with `ignore_eos`)."""
    import torch

    ids = torch.tensor([input_ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def main(out_dir: str, prompts_json: str, shape_json: str = "{}") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = {**SHAPE, **json.loads(shape_json)}
    make_tokenizer(out)
    model = make_weights(out, shape)
    prompts = json.loads(Path(prompts_json).read_text())
    reference = {name: greedy(model, p["input_ids"], p["max_new_tokens"]) for name, p in prompts.items()}
    (out / "reference.json").write_text(json.dumps(reference, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
