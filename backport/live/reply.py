"""One `/generate` request and its reply, read by the reply's shape, never by the release number.

A non-streamed `/generate` reply carries the generated tokens in one of three shapes (read from
each release's tokenizer_manager and detokenizer_manager):

- `output_ids` with exactly `meta_info.completion_tokens` ids: the generated tokens (0.5.3 on;
  a token-id output path on every release);
- `output_ids` longer than `completion_tokens` by at most INIT_INCREMENTAL_DETOKENIZATION_OFFSET
  (5): 0.5.2's detokenizer returns its incremental-decode ids, which start with the prompt's last
  ids (`surr_offset = read_offset - 5`); the extra head is stripped, and only when it is the
  prompt's own tail;
- `text` and no `output_ids` (0.4.7 - 0.4.10.post2 and older: `BatchStrOut` without ids): the
  text is re-encoded with the tiny model's own tokenizer (WordLevel over whitespace-split words,
  `tN` is id N). Requests ask `skip_special_tokens: false` (the detokenizer honours it per batch on
  every release), so a generated `<s>` stays in the text; the text is still trusted only when it
  gives back exactly `completion_tokens` ids, every word in the vocabulary.

A 200 whose tokens cannot be recovered this way has `recovered=False` and empty tokens: the
scenarios make it `error`, never `safe` (an empty list compared with an empty list once judged a
leaking pristine 0.4.10.post2 safe).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from backport.live.model import NEW_TOKENS

REQUEST_TIMEOUT = 60.0
PROMPT_TAIL_MAX = 5     # INIT_INCREMENTAL_DETOKENIZATION_OFFSET on the releases that prepend it

FROM_IDS = "output_ids"
FROM_IDS_TAIL_STRIPPED = "output_ids, the prompt's last {n} ids stripped"
FROM_TEXT = "text re-encoded with the tiny model's tokenizer (the reply has no output_ids)"


@dataclass(frozen=True)
class Reply:
    status: int | None          # None: no answer within the timeout
    tokens: list[int]
    prompt_tokens: int | None
    seconds: float
    error: str = ""
    source: str = ""            # where the tokens came from (one of the FROM_* shapes), "" when none
    recovered: bool = True      # False: a 200 whose generated tokens could not be read back

    def to_json(self) -> dict:
        out: dict[str, Any] = {"status": self.status, "tokens": self.tokens,
                               "prompt_tokens": self.prompt_tokens, "seconds": round(self.seconds, 3)}
        if self.source and self.source != FROM_IDS:
            out["tokens_from"] = self.source
        if not self.recovered:
            out["tokens_unrecoverable"] = True
        if self.error:
            out["error"] = self.error[:300]
        return out


class WordTokenizer:
    """The tiny model's tokenizer (make_model.make_tokenizer): a WordLevel vocabulary over
    whitespace-split words, read from its tokenizer.json; `encode` is None for a word outside it."""

    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    @classmethod
    def load(cls, model_path: Path) -> WordTokenizer:
        return _load(str(model_path))

    def encode(self, text: str) -> list[int] | None:
        ids = [self.vocab.get(word) for word in text.split()]
        known = [i for i in ids if i is not None]
        return None if len(known) < len(ids) else known


@functools.lru_cache(maxsize=8)
def _load(model_path: str) -> WordTokenizer:
    document = json.loads((Path(model_path) / "tokenizer.json").read_text())
    model, pre = document.get("model") or {}, document.get("pre_tokenizer") or {}
    if model.get("type") != "WordLevel" or pre.get("type") != "WhitespaceSplit":
        raise ValueError(f"{model_path}: not the tiny model's WordLevel/WhitespaceSplit tokenizer")
    return WordTokenizer(dict(model["vocab"]))


def read_tokens(document: dict, prompt: list[int],
                tokenizer: WordTokenizer | None) -> tuple[list[int], str, bool]:
    """(generated tokens, where they came from, recovered) of one 200 reply's JSON document."""
    meta = document.get("meta_info") or {}
    count = meta.get("completion_tokens")
    ids = document.get("output_ids")
    if ids is None:
        ids = meta.get("output_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        if not isinstance(count, int) or len(ids) == count:
            return list(ids), FROM_IDS, True
        extra = len(ids) - count
        if 0 < extra <= PROMPT_TAIL_MAX and ids[:extra] == prompt[-extra:]:
            return list(ids[extra:]), FROM_IDS_TAIL_STRIPPED.format(n=extra), True
        return [], FROM_IDS, False   # a head that is not the prompt's tail: no reading is sound
    text = document.get("text")
    if isinstance(text, str) and tokenizer is not None:
        ids = tokenizer.encode(text)
        if ids is not None and (not isinstance(count, int) or len(ids) == count):
            return ids, FROM_TEXT, True
        return [], FROM_TEXT, False  # a skipped special token or a word outside the vocabulary
    return [], "", False


def parse(status: int, body: str, prompt: list[int], tokenizer: WordTokenizer | None,
          seconds: float) -> Reply:
    """A Reply from one answer: tokens only from a 200 (a refusal has none to read)."""
    try:
        document = json.loads(body)
    except ValueError:
        return Reply(status, [], None, seconds, body, recovered=status != 200)
    if isinstance(document, list):
        document = document[0] if document else {}
    if not isinstance(document, dict):
        return Reply(status, [], None, seconds, body, recovered=status != 200)
    meta = document.get("meta_info") or {}
    if status != 200:
        return Reply(
            status, [], meta.get("prompt_tokens"), seconds, str(document.get("error") or document)[:300]
        )
    tokens, source, recovered = read_tokens(document, prompt, tokenizer)
    return Reply(status, tokens, meta.get("prompt_tokens"), seconds, "" if recovered else
                 f"the reply's generated tokens cannot be recovered: {json.dumps(document)[:240]}",
                 source, recovered)


def generate(url: str, input_ids: list[int], *, max_new_tokens: int = NEW_TOKENS,
             timeout: float = REQUEST_TIMEOUT, extra: dict | None = None,
             tokenizer: WordTokenizer | None = None) -> Reply:
    """One greedy request by token ids, EOS ignored, through `url` (a router or a server);
    `extra`: more body fields (a request id, the PD bootstrap fields when a client dispatches);
    `tokenizer`: reads a text-only reply (without it such a reply is unrecoverable)."""
    # skip_special_tokens off: where a release answers with text only, a generated special token
    # (the tiny model's greedy answers contain <s>) must stay in the text to be read back
    body = {"input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True,
                                "skip_special_tokens": False},
            **(extra or {})}
    started = time.monotonic()
    try:
        response = requests.post(url + "/generate", json=body, timeout=timeout)
    except requests.RequestException as exc:
        return Reply(None, [], None, time.monotonic() - started, f"{type(exc).__name__}: {exc}")
    return parse(response.status_code, response.text, input_ids, tokenizer, time.monotonic() - started)
