"""rejected_request_releases_decode_reservation's verdicts, with a stand-in deployment: a decode
whose load (the shape /v1/loads answers) and replies follow a script. No server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from backport.live import load, scenarios, traffic
from backport.live.model import PROMPTS
from backport.live.reply import parse
from tests.test_live_reply_units import StandIn, model_at, shape_ids, shape_text_only

REFERENCE = [401, 77, 3, 77, 250, 9, 511, 128]
REFUSAL = (
    400,
    {"error": {"message": "Input length (400 tokens) exceeds the maximum allowed length (250 tokens)"}},
)


class Decode(StandIn):
    """Loads: a list of numbers read one per poll (the last one repeats); None: no load exposed."""

    def __init__(self, answer, loads):
        super().__init__(answer)
        self.loads = loads
        self.decode = SimpleNamespace(url="http://127.0.0.1:1", log="/nonexistent")

    def generate(self, ids, *, tokenizer=None, timeout=None, **kw):
        status, document = self.answer(ids)
        return parse(status, json.dumps(document), ids, tokenizer, 0.05)

    def log_mark(self):
        return {"decode": 0}

    def read(self, url):
        if self.loads is None:
            return None
        value = self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]
        return load.Load(value, "/v1/loads num_total_tokens")


@pytest.fixture
def model(tmp_path):
    return model_at(tmp_path / "model", {"valid": REFERENCE, "over_pool": REFERENCE})


def run(monkeypatch, dep, bound=1.0):
    monkeypatch.setattr(load, "read_load", dep.read)
    monkeypatch.setattr(scenarios, "RESERVATION_BOUND", bound)
    return scenarios.rejected_request_releases_decode_reservation(dep, dep.model)


def deployment(model, answer, loads):
    dep = Decode(answer, loads)
    dep.model = model
    return dep


def refusing(valid_document):
    return lambda ids: REFUSAL if ids == PROMPTS["over_pool"] else valid_document(ids)


def test_released_and_served_is_safe_with_the_traffic_measured(monkeypatch, model):
    dep = deployment(model, refusing(lambda ids: (200, shape_ids(ids, REFERENCE))), [0, 0, 800, 400, 0])
    outcome = run(monkeypatch, dep)
    assert outcome.verdict == scenarios.SAFE, outcome
    details = outcome.details
    assert details["baseline_tokens"] == 0 and details["readings"][-1][1] == 0
    cost = details["concurrent_cost"]
    assert cost["valid_only"]["valid"] == traffic.VALID_ONLY and cost["mix"]["requests"] == traffic.MIX
    assert (
        cost["mix"]["over_pool"] == traffic.plan().count("over_pool")
        and cost["mix"]["valid_wrong_tokens"] == 0
    )


def test_held_past_the_bound_is_unsafe(monkeypatch, model):
    dep = deployment(model, refusing(lambda ids: (200, shape_ids(ids, REFERENCE))), [0, 0, 800])
    outcome = run(monkeypatch, dep, bound=0.6)
    assert outcome.verdict == scenarios.UNSAFE and "still holds 800 tokens" in outcome.observed, outcome


def test_without_a_load_decode_that_stops_serving_is_unsafe(monkeypatch, model):
    dep = deployment(model, refusing(lambda ids: (503, {"error": "no decode worker"})), None)
    outcome = run(monkeypatch, dep)
    assert outcome.verdict == scenarios.UNSAFE and "stopped serving" in outcome.observed, outcome
    assert "judged only by the next valid prompt" in outcome.details["decode_load"]


def test_a_served_over_pool_prompt_is_not_applicable(monkeypatch, model):
    dep = deployment(model, lambda ids: (200, shape_ids(ids, REFERENCE)), [0])
    assert run(monkeypatch, dep).verdict == scenarios.NOT_APPLICABLE


def test_a_text_only_next_prompt_that_cannot_be_read_is_error_not_safe(monkeypatch, model):
    lost = [2, *REFERENCE[1:]]  # a special token the server skipped in the text
    dep = deployment(
        model, refusing(lambda ids: (200, shape_text_only(ids, lost, skip_special_tokens=True))), [0]
    )
    outcome = run(monkeypatch, dep)
    assert outcome.verdict == scenarios.ERROR, outcome


def test_wrong_tokens_under_the_mix_are_unsafe(monkeypatch, model):
    answers = iter(
        [REFERENCE] * 11 + [[9] * 8] * 30
    )  # the next valid prompt and valid-only right, the mix not
    dep = deployment(model, refusing(lambda ids: (200, shape_ids(ids, next(answers)))), [0])
    outcome = run(monkeypatch, dep)
    assert outcome.verdict == scenarios.UNSAFE and "under the mix" in outcome.observed, outcome
