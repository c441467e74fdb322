"""Structured output on the real default pair (Qwen2.5-Coder-1.5B-Instruct
float32 target, 0.5B int4 ONNX draft): constrained greedy speculative output
equals constrained target-only output token for token on three grammars (an
object with nested arrays, an enum-heavy object, a date regex), the output
validates, and the draft's acceptance under the grammar's mask is printed
beside the unmasked draft's (the orchestrator's draft_grammar off)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specdec.grammar import GrammarSpec
from tests.stack import Stack, make_request
from tests.test_real_model import real_stack  # noqa: F401 (the module fixture)

pytestmark = pytest.mark.real_model

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
               "maxItems": 2},
}, "required": ["name", "tags", "matrix"], "additionalProperties": False}
ENUMS = {"type": "object", "properties": {
    "language": {"enum": ["python", "rust", "go", "java", "c"]},
    "paradigm": {"enum": ["functional", "imperative", "object-oriented"]},
    "typing": {"enum": ["static", "dynamic"]},
    "level": {"enum": ["low", "high"]},
}, "required": ["language", "paradigm", "typing", "level"], "additionalProperties": False}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CASES = [
    ("nested-arrays", GrammarSpec("json_schema", json.dumps(NESTED)),
     "Describe the Python project 'requests' as JSON with a name, tags and a small matrix of integers."),
    ("enum-heavy", GrammarSpec("json_schema", json.dumps(ENUMS)), "Classify the Rust language as JSON."),
    ("date-regex", GrammarSpec("regex", DATE), "On what date was Python 3.0 released? Answer with the date only."),
]


def run(stack: Stack, spec: GrammarSpec, prompt: str, mode: str) -> dict:  # type: ignore[type-arg]
    req = make_request(messages=[("user", prompt)], max_new_tokens=96, mode=mode, gamma=4, ignore_eos=False)
    spec.to_proto(req.structured_output)
    chunks = list(stack.orch_stub().Generate(req, timeout=900))
    return {"text": "".join(c.text for c in chunks), "token_ids": [t for c in chunks for t in c.token_ids],
            "stats": chunks[-1].stats, "finish_reason": chunks[-1].finish_reason}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_real_pair_constrained_greedy_equals_constrained_off(real_stack: Stack, case: int) -> None:  # noqa: F811
    name, spec, prompt = CASES[case]
    off = run(real_stack, spec, prompt, "off")
    masked = run(real_stack, spec, prompt, "fixed")
    cfg = real_stack.orchestrator.servicer.cfg
    cfg.draft_grammar = False
    try:
        unmasked = run(real_stack, spec, prompt, "fixed")
    finally:
        cfg.draft_grammar = True
    assert masked["token_ids"] == off["token_ids"] and unmasked["token_ids"] == off["token_ids"]
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(off["text"]), json.loads(spec.source))
    else:
        assert re.fullmatch(DATE, off["text"])
    m, u = masked["stats"], unmasked["stats"]
    print(f"\n{name}: {len(off['token_ids'])} tokens {off['text']!r}\n"
          f"  acceptance with the masked draft {m.acceptance_rate:.3f} ({m.accepted_tokens}/{m.draft_tokens}, "
          f"mean accepted length {m.mean_accepted_length:.2f}); unmasked draft {u.acceptance_rate:.3f} "
          f"({u.accepted_tokens}/{u.draft_tokens}, {u.mean_accepted_length:.2f})")
    real_stack.wait_no_sessions()
