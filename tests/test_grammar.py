"""Structured outputs (issue 24): JSON schemas (nested objects, enums, arrays), any JSON object, regexes
and EBNF through llguidance. Greedy constrained decoding equals a numpy reference (a teacher-forced
forward per token, the grammar's mask applied by hand) in target-only decoding and with EAGLE (tree
nodes masked by their paths), mixed with unconstrained requests in one batch; every output parses and
validates. fp32, a tiny target over a 100-token ASCII vocabulary."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.grammar import GrammarBackend, GrammarError
from jeagle.sampling import SamplingParams
from jeagle.spec.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.test_serve import char_tokenizer
from tests.util import last_logits, kv_idle

VOCAB, EOS = 100, 3
MAX_CONTEXT = 160


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "kind": {"enum": ["cat", "dog", "emu"]}},
     "required": ["name", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                  "required": ["ok", "level"], "additionalProperties": False}},
     "required": ["id", "tags", "owner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(last="~")  # printable ASCII: JSON's braces too


@pytest.fixture(scope="module")
def backend(tok):
    return GrammarBackend(tok, VOCAB, EOS)


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config(vocab=VOCAB, eos=(EOS,)), scale=6.0)


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.05)


def allowed(mask):
    ids = np.arange(VOCAB)
    return ((mask[ids // 32] >> (ids % 32)) & 1).astype(bool)


def reference(target, prompt, grammar, max_new):
    """Constrained greedy decoding by hand: a forward of the whole sequence per token, the mask of a
    fresh matcher fed the tokens so far."""
    m = grammar.matcher()
    out = []
    while len(out) < max_new:
        x = np.where(allowed(m.mask()), last_logits(target, prompt + out, MAX_CONTEXT), -np.inf)
        tok = int(np.argmax(x))
        out.append(tok)
        if tok == EOS:
            break
        m.consume(tok)
    return out


def text_of(tok, ids):
    return tok.decode([t for t in ids if t != EOS])


@pytest.fixture(scope="module")
def workload(tok, backend):
    """(prompt, params) pairs: two schemas, any JSON object, a regex, an EBNF grammar, one free request."""
    rng = np.random.default_rng(2)
    prompts = [list(map(int, rng.integers(4, VOCAB, n))) for n in (5, 3, 7, 4, 6, 2)]
    grammars = [backend.compile("json_schema", SCHEMAS[0]), backend.compile("json_schema", SCHEMAS[1]),
                backend.compile("json_object", None), backend.compile("regex", r"[a-z]{2,5}@(x|yy)\.com"),
                backend.compile("ebnf", 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "z"'), None]
    params = [SamplingParams(max_new_tokens=64, grammar=g) for g in grammars]
    return prompts, params


def check_outputs(tok, outs, params):
    for o, p in zip(outs, params):
        g = p.grammar
        if g is None:
            continue
        assert o.finish_reason == "stop" and o.token_ids[-1] == EOS, (g.kind, text_of(tok, o.token_ids))
        text = text_of(tok, o.token_ids)
        if g.kind == "json_schema":
            import jsonschema

            doc = json.loads(text)
            jsonschema.validate(doc, SCHEMAS[0] if "name" in text else SCHEMAS[1])
        elif g.kind == "json_object":
            assert isinstance(json.loads(text), dict)
        elif g.kind == "regex":
            assert re.fullmatch(r"[a-z]{2,5}@(x|yy)\.com", text), text
        else:
            assert re.fullmatch(r"\(([0-9]|z)(,([0-9]|z))*\)", text), text


@pytest.fixture(scope="module")
def expected(target, workload):
    prompts, params = workload
    return [reference(target, p, sp.grammar, sp.max_new_tokens) if sp.grammar is not None else None
            for p, sp in zip(prompts, params)]


def test_target_only_equals_the_reference(tok, target, workload, expected):
    prompts, params = workload
    eng = target_only(target, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4),
                                           decode_steps=2))
    outs = eng.generate(prompts, params)
    check_outputs(tok, outs, params)
    for o, e in zip(outs, expected):
        if e is not None:
            assert o.token_ids == e
    free = target_only(target, EngineConfig(max_batch_size=1, max_context=MAX_CONTEXT)).generate(
        prompts[-1:], params[-1:])[0]
    assert outs[-1].token_ids == free.token_ids  # the unconstrained request, batched with grammars
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


@pytest.mark.parametrize("tier", [(3, 2, 5), (2, 1, 3), (4, 3, 8)])
def test_eagle_equals_the_reference(tok, target, head, workload, expected, tier):
    prompts, params = workload
    eng = speculative(target, head, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4),
                                                 rounds_per_dispatch=2), SpecConfig(*tier))
    outs = eng.generate(prompts, params)
    check_outputs(tok, outs, params)
    for o, e in zip(outs, expected):
        if e is not None:
            assert o.token_ids == e
    assert eng.last_stats.to_dict()["accept_length"] > 1.0
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


def test_bad_grammars_are_refused(backend):
    for kind, src in [("regex", "a(b"), ("json_schema", {"type": 5}), ("json_schema", "[1, 2]"),
                      ("ebnf", "root ::= missing"), ("json_schema", "{not json")]:
        with pytest.raises(GrammarError):
            backend.compile(kind, src)


@pytest.fixture(scope="module")
def server(tok, target, head):
    from jeagle.serve import create_app
    from tests.test_serve import start_server

    engine = speculative(target, head, EngineConfig(max_batch_size=8, max_context=MAX_CONTEXT), SpecConfig(3, 2, 5))
    srv, thread, url = start_server(create_app(engine, tok, "tiny"))
    yield url
    srv.should_exit = True
    thread.join(timeout=30)


def test_server_structured_outputs(server, tok):
    """response_format (json_schema, json_object) and SGLang's regex / ebnf over HTTP with the openai
    client, EAGLE on, eight at once: every output parses, validates and matches; streamed too."""
    import concurrent.futures

    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Describe a pet."}]

    def ask(i):
        kind = i % 4
        if kind < 2:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{kind}", "schema": SCHEMAS[kind]}}
            r = client.completions.create(model="tiny", prompt=f"pet {i}:", max_tokens=80, temperature=0.7, seed=i,
                                          extra_body={"response_format": fmt})
            jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[kind])
        elif kind == 2:
            # Greedy: free-form keys sampled from this random target can outrun max_tokens (finish "length").
            r = client.completions.create(model="tiny", prompt=f"obj {i}:", max_tokens=80, temperature=0, seed=i,
                                          extra_body={"response_format": {"type": "json_object"}})
            assert isinstance(json.loads(r.choices[0].text), dict)
        else:
            r = client.completions.create(model="tiny", prompt=f"mail {i}:", max_tokens=40, temperature=0, seed=i,
                                          extra_body={"regex": r"[a-z]{2,5}@(x|yy)\.com"})
            assert re.fullmatch(r"[a-z]{2,5}@(x|yy)\.com", r.choices[0].text), r.choices[0].text
        return r.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == ["stop"] * 8
    # Chat, streamed, under an EBNF grammar.
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ebnf": 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "z"'})
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert re.fullmatch(r"\(([0-9]|z)(,([0-9]|z))*\)", text), text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"regex": "a(b"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"ebnf": "root ::= missing"}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
])
def test_server_bad_grammars_are_400(server, body, param):
    import httpx

    r = httpx.post(f"{server}/v1/completions", json={"prompt": "abc", "max_tokens": 4} | body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
