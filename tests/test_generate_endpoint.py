"""SGLang's native `POST /generate` over loopback HTTP (the tiny speculative engine of tests/test_serve.py):
greedy text and token ids give what /v1/completions and target-only decoding give, batches, streaming,
logprobs equal to the completions endpoint's, SGLang's sampling fields mapped onto the OpenAI path's
SamplingParams, unsupported fields as 400s naming them; and a probe of hostile requests against every
endpoint: each a 400 with a message, never a 500, the server serving on."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest

from jeagle.serve import native
from jeagle.serve.protocol import (COMPLETION_KEYS, BadRequest, StopMatcher, parse_common, request_params,
                                   seeded)
from tests.test_serve import PROMPTS, char_tokenizer, parts, reference, server  # noqa: F401 (fixtures)

GREEDY = {"temperature": 0}


def post(c: httpx.Client, path: str, body) -> httpx.Response:
    return c.post(path, content=body if isinstance(body, (str, bytes)) else json.dumps(body),
                  headers={"content-type": "application/json"})


def events(c: httpx.Client, body: dict) -> list[dict]:
    """A streamed /generate's events (ending with [DONE], which is checked and dropped)."""
    with c.stream("POST", "/generate", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


@pytest.fixture(scope="module")
def c(server):  # noqa: F811
    with httpx.Client(base_url=server[0], timeout=120) as client:
        yield client


def test_greedy_text_and_input_ids_give_what_completions_and_target_only_give(c, parts, reference):  # noqa: F811
    tok = parts[2]
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt)
        want, finish = reference(ids, 20)
        by_text = c.post("/generate", json={"text": prompt, "sampling_params": GREEDY | {"max_new_tokens": 20}})
        by_ids = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY | {"max_new_tokens": 20}})
        openai = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20} | GREEDY)
        assert by_text.status_code == by_ids.status_code == 200, by_text.text
        a, b = by_text.json(), by_ids.json()
        assert a["text"] == b["text"] == openai.json()["choices"][0]["text"] == want
        assert a["output_ids"] == b["output_ids"]
        meta = a["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(a["output_ids"])
        assert meta["id"] and meta["cached_tokens"] >= 0
        if finish == "stop":  # SGLang's: the EOS's id, which output_ids keep and the text does not
            assert meta["finish_reason"] == {"type": "stop", "matched": 3} and a["output_ids"][-1] == 3
            assert tok.decode(a["output_ids"][:-1]) == want
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 20} and len(a["output_ids"]) == 20
            assert tok.decode(a["output_ids"]) == want


def test_a_batch_answers_a_list_in_order(c, parts, reference):  # noqa: F811
    tok = parts[2]
    texts = [PROMPTS[1], PROMPTS[3]]
    r = c.post("/generate", json={"text": texts, "rid": ["first", "second"],
                                  "sampling_params": [GREEDY | {"max_new_tokens": 9}, GREEDY | {"max_new_tokens": 5}]})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [a["meta_info"]["id"] for a in got] == ["first", "second"]
    assert [a["text"] for a in got] == [reference(tok.encode(texts[0]), 9)[0], reference(tok.encode(texts[1]), 5)[0]]
    # Token ids in a batch, one sampling_params for both: each as asked alone.
    ids = [tok.encode(t) for t in texts]
    r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY | {"max_new_tokens": 7}})
    alone = [c.post("/generate", json={"input_ids": x, "sampling_params": GREEDY | {"max_new_tokens": 7}}).json()
             for x in ids]
    assert [(a["text"], a["output_ids"]) for a in r.json()] == [(a["text"], a["output_ids"]) for a in alone]


def test_streaming_sends_the_whole_answer_so_far_and_ends_as_the_whole_response(c):
    body = {"text": PROMPTS[4], "sampling_params": GREEDY | {"max_new_tokens": 30}}
    whole = c.post("/generate", json=body).json()
    evs = events(c, body)
    assert len(evs) > 1
    for before, after in zip(evs, evs[1:]):  # cumulative, as SGLang's stream
        assert after["text"].startswith(before["text"]) and after["output_ids"][:len(before["output_ids"])] == \
            before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = evs[-1]
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"] is not None
    assert "index" not in last
    # A batch's events say their request by its index; each request's last event is its whole answer.
    both = {"text": [PROMPTS[0], PROMPTS[2]], "sampling_params": GREEDY | {"max_new_tokens": 12}}
    whole = c.post("/generate", json=both).json()
    last = {}
    for ev in events(c, both):
        last[ev.pop("index")] = ev
    assert [(last[i]["text"], last[i]["output_ids"]) for i in (0, 1)] == [(w["text"], w["output_ids"]) for w in whole]


def test_logprobs_equal_the_completions_endpoints(c, parts):
    tok = parts[2]
    prompt = "hello world"
    ids = tok.encode(prompt)
    sp = GREEDY | {"max_new_tokens": 12, "ignore_eos": True}
    r = c.post("/generate", json={"text": prompt, "sampling_params": sp, "return_logprob": True,
                                  "top_logprobs_num": 3, "return_text_in_logprobs": True, "logprob_start_len": 0})
    assert r.status_code == 200, r.text
    a = r.json()
    meta = a["meta_info"]
    o = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "logprobs": 3, "echo": True,
                                        "ignore_eos": True} | GREEDY).json()["choices"][0]["logprobs"]
    assert [e[1] for e in meta["output_token_logprobs"]] == a["output_ids"]
    assert [e[2] for e in meta["output_token_logprobs"]] == o["tokens"][len(ids):]
    assert [e[0] for e in meta["output_token_logprobs"]] == o["token_logprobs"][len(ids):]
    assert [{t: p for p, _, t in top} for top in meta["output_top_logprobs"]] == o["top_logprobs"][len(ids):]
    assert all([i for _, i, _ in top] == [tok.token_to_id(t) for _, _, t in top] for top in meta["output_top_logprobs"])
    # The prompt's, from logprob_start_len (the first position has none): echo's.
    assert [e[:2] for e in meta["input_token_logprobs"]] == [[p, t] for p, t in zip(o["token_logprobs"][:len(ids)],
                                                                                     ids)]
    assert meta["input_top_logprobs"][0] is None
    assert [{t: p for p, _, t in top} for top in meta["input_top_logprobs"][1:]] == o["top_logprobs"][1:len(ids)]
    # By default: the output's logprobs only, no texts, no top lists without top_logprobs_num.
    meta = c.post("/generate", json={"text": prompt, "sampling_params": sp, "return_logprob": True}).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and "output_top_logprobs" not in meta
    assert [e[0] for e in meta["output_token_logprobs"]] == o["token_logprobs"][len(ids):]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    # Streamed: the last event's are the whole response's.
    body = {"text": prompt, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2}
    whole = c.post("/generate", json=body).json()["meta_info"]
    last = events(c, body)[-1]["meta_info"]
    assert last["output_token_logprobs"] == whole["output_token_logprobs"]
    assert last["output_top_logprobs"] == whole["output_top_logprobs"]


def test_sglang_sampling_fields(c, parts, reference):  # noqa: F811
    tok = parts[2]
    prompt = PROMPTS[4]
    want, _ = reference(tok.encode(prompt), 24)
    assert len(want) >= 6
    # A stop string: the text cut before it, SGLang's finish reason naming it.
    stop = want[3:5]
    r = c.post("/generate", json={"text": prompt, "sampling_params": GREEDY | {"max_new_tokens": 24, "stop": stop}})
    assert r.json()["text"] == want[:want.index(stop)]
    assert r.json()["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # A stop token id: output_ids end with it, the text stops before it.
    token = tok.encode(want[4], add_special_tokens=False)[0]
    r = c.post("/generate", json={"text": prompt, "sampling_params": GREEDY | {"max_new_tokens": 24,
                                                                               "stop_token_ids": [token]}}).json()
    cut = want.index(want[4])
    assert r["text"] == want[:cut] and r["output_ids"][-1] == token
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    # n samples with a seed: a list, each its own seed stream as the completions' n choices; SGLang's
    # neutral defaults accepted.
    body = {"text": "abc", "sampling_params": {"n": 3, "sampling_seed": 7, "temperature": 2.0, "max_new_tokens": 10,
                                               "ignore_eos": True, "min_p": 0.0, "skip_special_tokens": True,
                                               "no_stop_trim": False, "top_k": -1}}
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    choices = c.post("/v1/completions", json={"prompt": "abc", "n": 3, "seed": 7, "temperature": 2.0, "max_tokens": 10,
                                              "ignore_eos": True}).json()["choices"]
    assert [a["text"] for a in r.json()] == [ch["text"] for ch in sorted(choices, key=lambda ch: ch["index"])]
    assert len({a["meta_info"]["id"] for a in r.json()}) == 3


def test_sampling_params_are_the_openai_paths():
    """SGLang's sampling fields give the SamplingParams (and grammar) the equivalent completions body
    gives through the same functions; null is the default."""
    tok = char_tokenizer()
    facts = SimpleNamespace(max_context=512, context_reserve=8, vocab_size=96, eos_token_ids=(3,))
    grammar = lambda kind, source: (kind, source)  # noqa: E731
    sglang = {"max_new_tokens": 9, "min_new_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
              "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["x", "yz"],
              "ignore_eos": True, "n": 2, "sampling_seed": 11, "logit_bias": {"7": 2.0}, "regex": "[a-c]+",
              "min_p": None}
    openai = {"max_tokens": 9, "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "frequency_penalty": 0.5,
              "presence_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["x", "yz"], "ignore_eos": True, "n": 2,
              "seed": 11, "logit_bias": {"7": 2.0}, "regex": "[a-c]+", "logprobs": 4}
    call = native.parse({"input_ids": [5, 6, 7], "sampling_params": sglang, "return_logprob": True,
                         "top_logprobs_num": 4}, tok, facts, grammar)
    (one,) = call.items
    opts = parse_common(openai, COMPLETION_KEYS)
    assert one.samples == seeded(request_params(openai, opts, 3, False, facts, grammar), 2)
    assert one.samples[0].grammar == ("regex", "[a-c]+") and one.stops == ["x", "yz"] and call.batch
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call = native.parse({"text": "ab", "sampling_params": {"json_schema": json.dumps(schema)}}, tok, facts, grammar)
    assert call.items[0].samples[0].grammar == ("json_schema", schema)
    assert call.items[0].samples[0].max_new_tokens == native.DEFAULT_MAX_NEW_TOKENS  # SGLang's default, 128 ...
    short = native.parse({"text": "x" * 450}, tok, facts, grammar).items[0].samples[0]  # ... within the room
    assert short.max_new_tokens == 512 - 8 - 450
    with pytest.raises(BadRequest) as e:
        native.parse({"text": "ab", "sampling_params": {"max_new_tokens": 600}}, tok, facts, grammar)
    assert e.value.param == "sampling_params.max_new_tokens" and "max_new_tokens" in e.value.message


@pytest.mark.parametrize("body,param", [
    ({"lora_path": "adapter"}, "lora_path"),
    ({"image_data": "cat.png"}, "image_data"),
    ({"session_params": {"id": "s"}}, "session_params"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"custom_logit_processor": "..."}, "custom_logit_processor"),
    ({"token_ids_logprob": [5]}, "token_ids_logprob"),
    ({"sampling_params": {"min_p": 0.1}}, "sampling_params.min_p"),
    ({"sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    ({"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
    ({"sampling_params": {"custom_params": {"a": 1}}}, "sampling_params.custom_params"),
    ({"sampling_params": {"skip_special_tokens": False}}, "sampling_params.skip_special_tokens"),
    ({"sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim"),
])
def test_unsupported_fields_are_400s_naming_them(c, body, param):
    r = c.post("/generate", json={"text": "abc"} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[-1] in err["message"]


DEEP_LIST = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"a":' * 5000 + "1" + "}" * 5000
CHAT = "/v1/chat/completions"


# What tests/test_serve.py's bad-input test sends to /v1/completions is not repeated here.
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", DEEP_LIST, None),
    (CHAT, DEEP_OBJECT, None),
    ("/generate", '{"text": "abc", "sampling_params": ' + DEEP_LIST + "}", None),
    ("/generate", "", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', None),  # a lone surrogate
    ("/v1/completions", '{"prompt": "abc", "temperature": NaN}', None),
    ("/generate", "[1, 2]", None),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "function", "content": "x"}]}, "messages"),
    (CHAT, {"messages": [{"role": 5, "content": "hi"}]}, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 10**6}, "n"),
    ("/v1/completions", {"prompt": "abc", "top_k": 2**40}, "top_k"),  # int32 on the device
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 2**40}, "min_tokens"),
    ("/generate", {"text": "abc", "sampling_params": {"top_k": 2**40}}, "sampling_params.top_k"),
    ("/generate", {"text": "abc", "input_ids": [5, 6]}, "input_ids"),
    ("/generate", {"sampling_params": {"max_new_tokens": 4}}, "text"),
    ("/generate", {"input_ids": [5, 6, 10**6]}, "input_ids"),
    ("/generate", {"input_ids": ["a", "b"]}, "input_ids"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": []}, "text"),
    ("/generate", {"text": "abc", "sampling_params": "fast"}, "sampling_params"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ("/generate", {"text": "abc", "sampling_params": {"n": 10**6}}, "sampling_params.n"),
    ("/generate", {"text": "abc", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("/generate", {"text": "abc", "sampling_params": {"stop_token_ids": [10**6]}}, "sampling_params.stop_token_ids"),
    ("/generate", {"text": "abc", "sampling_params": {"json_schema": "{"}}, "sampling_params.json_schema"),
    ("/generate", {"text": "abc", "rid": 5}, "rid"),
    ("/generate", {"text": "abc", "stream": "yes"}, "stream"),
])
def test_hostile_requests_are_400s_and_the_server_keeps_serving(c, path, body, param):
    r = post(c, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    ok = c.post("/generate", json={"text": "abc", "sampling_params": GREEDY | {"max_new_tokens": 3}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] >= 1


def test_a_long_stop_string_costs_what_the_text_does():
    """Holding back a possible start of a stop string looks at the text's tails, not every prefix of the
    stop string (a 1M-character one took seconds per token, on the server's event loop)."""
    matcher = StopMatcher(["ab" * 500_000, "zz"])
    pieces = ["x", "a", "b", "q", "ab", "z"] * 50
    start = time.perf_counter()
    out = "".join(matcher.push(piece) for piece in pieces)
    assert time.perf_counter() - start < 5.0  # the old cost: seconds per push; now tens of microseconds
    assert out + matcher.buffer == "".join(pieces) and matcher.buffer == "z" and not matcher.stopped
    assert matcher.push("z") == "" and matcher.stopped and matcher.matched == "zz"
