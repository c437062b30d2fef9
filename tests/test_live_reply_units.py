"""Reading `/generate` replies by their shape (backport/live/reply.py), and what the scenarios make
of a reply whose tokens cannot be read back: no server, replies built as the releases return them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from backport.live import load, reply, scenarios
from backport.live.model import PROMPTS, TinyModel
from backport.live.reply import FROM_IDS, FROM_TEXT, WordTokenizer, parse

SPECIAL = {"<unk>": 0, "<s>": 1, "</s>": 2}
VOCAB = {**SPECIAL, **{f"t{i}": i for i in range(3, 512)}}


def tokenizer_json(folder: Path) -> Path:
    """The tokenizer.json make_model.make_tokenizer saves (the fields reply.py reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(
        json.dumps(
            {
                "version": "1.0",
                "added_tokens": [{"id": i, "content": w, "special": True} for w, i in SPECIAL.items()],
                "pre_tokenizer": {"type": "WhitespaceSplit"},
                "model": {"type": "WordLevel", "vocab": VOCAB, "unk_token": "<unk>"},
            }
        )
    )
    return folder


def detokenized_text(prompt: list[int], generated: list[int], skip_special_tokens: bool = False) -> str:
    """The text 0.4.7 - 0.4.10.post2 return: the detokenizer decodes the prompt's last 5 ids with
    the generated ones and sends what follows the prompt tail's own text (incremental decoding),
    special tokens kept as the live requests ask (skipped by the servers' default); the tiny
    model's tokenizer joins words with one space."""
    names = {i: w for w, i in SPECIAL.items()}

    def decode(ids):
        return " ".join(names.get(i, f"t{i}") for i in ids if not (skip_special_tokens and i in names))

    tail = prompt[-5:]
    return decode(tail + generated)[len(decode(tail)):]


def meta(prompt: list[int], generated: list[int]) -> dict:
    return {"id": "r", "finish_reason": {"type": "length", "length": len(generated)},
            "prompt_tokens": len(prompt), "completion_tokens": len(generated), "cached_tokens": 0}


def shape_ids(prompt, generated):  # 0.5.3 on: BatchTokenIDOut / BatchStrOut with output_ids
    return {
        "text": detokenized_text(prompt, generated),
        "output_ids": generated,
        "meta_info": meta(prompt, generated),
    }


def shape_ids_with_prompt_tail(prompt, generated):   # 0.5.2: decode_ids from surr_offset = read_offset - 5
    return {"text": detokenized_text(prompt, generated), "output_ids": prompt[-5:] + generated,
            "meta_info": meta(prompt, generated)}


def shape_text_only(prompt, generated, skip_special_tokens=False):  # 0.4.7 - 0.4.10.post2: no ids
    return {
        "text": detokenized_text(prompt, generated, skip_special_tokens),
        "meta_info": meta(prompt, generated),
    }


@pytest.fixture
def tok(tmp_path) -> WordTokenizer:
    return WordTokenizer.load(tokenizer_json(tmp_path / "model"))


PROMPT = PROMPTS["valid"]
GENERATED = [401, 77, 3, 77, 250, 9, 511, 128]


@pytest.mark.parametrize("shape", [shape_ids, shape_ids_with_prompt_tail, shape_text_only])
def test_every_shape_gives_the_generated_tokens(shape, tok):
    got = parse(200, json.dumps(shape(PROMPT, GENERATED)), PROMPT, tok, 0.5)
    assert got.recovered and got.tokens == GENERATED and got.prompt_tokens == len(PROMPT)
    assert got.source == {shape_ids: FROM_IDS, shape_text_only: FROM_TEXT}.get(
        shape, reply.FROM_IDS_TAIL_STRIPPED.format(n=4))


def test_a_long_prompts_tail_is_five_ids_and_must_be_the_prompts_own(tok):
    prompt = PROMPTS["over_pool"]
    got = parse(200, json.dumps(shape_ids_with_prompt_tail(prompt, GENERATED)), prompt, tok, 0.1)
    assert got.tokens == GENERATED and "last 5 ids" in got.source
    forged = {"output_ids": [1, 2, 3] + GENERATED, "meta_info": meta(prompt, GENERATED)}
    got = parse(200, json.dumps(forged), prompt, tok, 0.1)
    assert not got.recovered and got.tokens == [] and "cannot be recovered" in got.error


def test_a_text_only_reply_keeps_special_tokens_or_is_unrecoverable(tok):
    generated = [401, 2, 77, 3, 77, 1, 9, 511]   # </s> (EOS ignored) and <s> generated
    kept = {"text": detokenized_text(PROMPT, generated), "meta_info": meta(PROMPT, generated)}
    assert parse(200, json.dumps(kept), PROMPT, tok, 0.1).tokens == generated
    skipped = {
        "text": detokenized_text(PROMPT, generated, skip_special_tokens=True),
        "meta_info": meta(PROMPT, generated),
    }
    got = parse(200, json.dumps(skipped), PROMPT, tok, 0.1)
    assert not got.recovered and got.tokens == []
    assert parse(200, json.dumps({"text": "t5 hello", "meta_info": {}}), PROMPT, tok, 0.1).recovered is False
    assert parse(200, json.dumps(shape_text_only(PROMPT, GENERATED)), PROMPT, None, 0.1).recovered is False


def test_refusals_and_broken_bodies():
    refusal = parse(
        400, json.dumps({"error": {"message": "Input length (400 tokens) exceeds"}}), PROMPT, None, 0.0
    )
    assert refusal.recovered and refusal.tokens == [] and "exceeds" in refusal.error
    assert parse(200, "<html>bad gateway</html>", PROMPT, None, 0.0).recovered is False
    assert parse(502, "upstream gone", PROMPT, None, 0.0).recovered is True


class StandIn:
    """Stands in for a Deployment: answers every prompt with a document of the given shape."""

    def __init__(self, answer):
        self.answer = answer
        self.flush_frees_held_pages = False

    def generate(self, ids, *, tokenizer=None, **kw):
        status, document = self.answer(ids)
        return parse(status, json.dumps(document), ids, tokenizer, 0.1)

    def log_mark(self):
        return {}

    def log_lines(self, mark, *needles):
        return {}

    def flush_decode(self, timeout=60.0):
        return 0.0


def model_at(folder: Path, reference: dict) -> TinyModel:
    return TinyModel(tokenizer_json(folder), reference, "0" * 64)


def test_a_text_only_reply_is_safe_only_when_its_text_re_encodes_to_the_reference(tmp_path):
    reference = [401, 1, 3, 77, 250, 9, 511, 128]   # <s> in it, as in the tiny model's answer to "valid"
    model = model_at(tmp_path / "model", {"valid": reference})
    rng = random.Random(41)
    safe = 0
    for _ in range(300):
        generated = list(reference)
        if rng.random() < 0.6:   # one token off: a wrong value or a special one
            generated[rng.randrange(8)] = rng.choice((rng.randrange(3, 512), rng.randrange(0, 3)))
        skip = rng.random() < 0.3   # a server that skipped special tokens after all
        text = rng.choice((detokenized_text(PROMPT, generated, skip), "", " t9 t9", " x" * 8,
                           detokenized_text(PROMPT, generated, skip) + " t7"))
        document = {"text": text, "meta_info": meta(PROMPT, generated)}
        outcome = scenarios.valid_prompt_matches_reference(StandIn(lambda ids, d=document: (200, d)), model)
        encoded = WordTokenizer.load(model.path).encode(text)
        assert (outcome.verdict == scenarios.SAFE) == (encoded == reference), (text, outcome.verdict)
        assert outcome.verdict != scenarios.SAFE or outcome.details["reply"]["tokens_from"] == FROM_TEXT
        safe += outcome.verdict == scenarios.SAFE
    assert safe > 0   # the loop reached the safe case too


def test_text_only_answers_to_the_rejected_request_are_no_longer_judged_safe_by_empty_lists(tmp_path):
    """Pristine 0.4.10.post2 served R after A, B, A with text only: read as three empty token lists,
    they once compared equal (safe). Now the text is read, and its dependence on A or B shows."""
    model = model_at(tmp_path / "model", {"over_pool": [9] * 8})
    answers = iter([[11] * 8, [12] * 8, [11] * 8])

    def answer(ids):
        if ids == PROMPTS["over_pool"]:
            return 200, shape_text_only(ids, next(answers))
        return 200, shape_text_only(ids, [5] * 8)

    outcome = scenarios.rejected_request_reads_no_other_request(StandIn(answer), model)
    assert outcome.verdict == scenarios.UNSAFE, outcome
    # the same text after A and B, but a special token lost (skipped by the server): no verdict, not safe
    outcome = scenarios.rejected_request_reads_no_other_request(
        StandIn(lambda ids: (200, shape_text_only(ids, [2, 9, 9, 9, 9, 9, 9, 9], skip_special_tokens=True))),
        model,
    )
    assert outcome.verdict == scenarios.ERROR, outcome


@pytest.mark.parametrize(("document", "path", "tokens", "source"), [
    ({"loads": [{"dp_rank": 0, "num_used_tokens": 400, "num_total_tokens": 412}]}, "/v1/loads", 412,
     "/v1/loads num_total_tokens"),
    ({"loads": [{"dp_rank": 0, "num_used_tokens": 7}]}, "/v1/loads", 7, "/v1/loads num_used_tokens"),
    ([{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 1, "num_tokens": 400}], "/get_load", 400,
     "/get_load num_tokens"),
    ({"load": 12}, "/get_load", 12, "/get_load load"),
])
def test_decode_load_by_shape(document, path, tokens, source):
    assert load.from_document(document, path) == load.Load(tokens, source)


def test_decode_load_unknown_shapes_are_none():
    assert load.from_document({"loads": [{"dp_rank": 0}]}, "/v1/loads") is None
    assert load.from_document({"detail": "Not Found"}, "/get_load") is None
    assert load.from_document([], "/get_load") is None


def test_the_races_requests_read_a_text_only_reply(tmp_path, tok):
    """The 2P1D race asks prefill and decode directly (backport/live/race.py, Pair.send); on 0.4.7 -
    0.4.10.post2 decode answers with text only. Measured on pristine 0.4.10.post2 before this: B's
    answer was unrecoverable, so both controls read "not safe" and the race was `error` on a tree
    that serves. A stand-in server on 127.0.0.1 answers as those releases do."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from backport.live import race

    prompt, generated = race.PROMPTS["b"][0], [401, 1, 3, 77]

    class TextOnly(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(shape_text_only(prompt, generated)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), TextOnly)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        stand_in = SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}")
        with ThreadPoolExecutor(2) as pool:
            read = race.Pair(stand_in, 1, stand_in, tok).send(pool, "b", "b-1")[1].result()
            unread = race.Pair(stand_in, 1, stand_in).send(pool, "b", "b-2")[1].result()
    finally:
        server.shutdown()
        server.server_close()
    assert read.status == 200 and read.tokens == generated
    assert unread.status == 200 and unread.tokens == [] and unread.to_json().get("tokens_unrecoverable")
