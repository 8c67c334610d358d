"""The server's OpenAI features with EAGLE on, over loopback HTTP with the real `openai`
client: logprobs (chat and completions, streamed and whole, echo's prompt logprobs) equal target-only
decoding's to 1e-4; n choices with their own seeds, indices and usage; bad values are 400s. A tiny
fp32 target with soft next-token distributions and a character tokenizer."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.test_serve import MODEL, char_tokenizer, start_server
from tests.util import ragged_forward


@pytest.fixture(scope="module")
def parts():
    target = bigram_target(target_config(), scale=4.0)
    return target, signed_identity_head(target, +1.0, noise=0.08), char_tokenizer()


@pytest.fixture(scope="module")
def server(parts):
    from jeagle.serve import create_app

    target, head, tok = parts
    engine = speculative(target, head, EngineConfig(max_batch_size=8, max_context=128), SpecConfig(3, 2, 5))
    srv, thread, url = start_server(create_app(engine, tok, MODEL))
    yield url, engine
    srv.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(parts):
    """Greedy target-only decoding with logprobs → Output."""
    target, _, _ = parts
    eng = target_only(target, EngineConfig(max_batch_size=1, max_context=128))

    def run(ids, max_tokens, k):
        return eng.generate([ids], SamplingParams(max_new_tokens=max_tokens, logprobs=k, ignore_eos=True))[0]
    return run


def test_chat_logprobs_equal_target_only(client, parts, reference):
    tok = parts[2]
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ref = reference(tok.encode_chat(messages), 16, 4)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=4, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.token_text(t) for t in ref.token_ids]
    assert "".join(c.token for c in content) == r.choices[0].message.content
    np.testing.assert_allclose([c.logprob for c in content], [x.logprob for x in ref.logprobs], atol=1e-4)
    for c, x in zip(content, ref.logprobs):
        assert [t.token for t in c.top_logprobs] == [tok.token_text(i) for i, _ in x.top(4)]
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs], [p for _, p in x.top(4)], atol=1e-4)
        assert bytes(c.bytes) == c.token.encode()
    # Streamed: the same entries, spread over the chunks.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    np.testing.assert_allclose([c.logprob for c in streamed], [c.logprob for c in content], atol=1e-6)
    # Without logprobs: none.
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_and_echo(client, parts, reference):
    target, _, tok = parts
    prompt = "hello world"
    ids = tok.encode(prompt)
    ref = reference(ids, 12, 3)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, [x.logprob for x in ref.logprobs], atol=1e-4)
    assert lp.tokens == [tok.token_text(t) for t in ref.token_ids]
    assert all(len(d) <= 3 for d in lp.top_logprobs)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))

    # echo: the prompt's text and its tokens' logprobs first (the first has none).
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith(prompt) and c.text[len(prompt):] == tok.decode(ref.token_ids)
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 12
    logits, _ = ragged_forward(target, [ids])
    x = logits[0].astype(np.float64)
    want = [x[j - 1, ids[j]] - np.log(np.exp(x[j - 1]).sum()) for j in range(1, len(ids))]
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, atol=1e-4)
    np.testing.assert_allclose(lp.token_logprobs[len(ids):], [x.logprob for x in ref.logprobs], atol=1e-4)
    # echo streamed: the prompt comes first, in the first chunk.
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(ch.choices[0].text for ch in chunks).startswith(prompt)


def test_n_choices(client, parts):
    tok = parts[2]
    prompt = "abc"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, n=3, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts  # each choice its own seed stream
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 30
    assert r.usage.total_tokens == r.usage.prompt_tokens + 30
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, n=3, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts  # seeded: reproducible
    # Streamed chat: every chunk names its choice; the choices' texts agree with the whole response's.
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, n=2,
                                           seed=11, extra_body={"ignore_eos": True})
    got = {0: "", 1: ""}
    finished = set()
    for ch in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, n=2,
                                             seed=11, stream=True, extra_body={"ignore_eos": True}):
        c = ch.choices[0]
        got[c.index] += c.delta.content or ""
        if c.finish_reason:
            finished.add(c.index)
    assert finished == {0, 1}
    assert got == {c.index: c.message.content for c in whole.choices}


def test_penalties_equal_target_only(client, parts):
    """OpenAI's and SGLang's penalty fields over HTTP, EAGLE on: the tokens of target-only decoding
    under the same SamplingParams."""
    target, _, tok = parts
    eng = target_only(target, EngineConfig(max_batch_size=1, max_context=128))
    prompt = "The quick brown fox"
    fields = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(repetition_penalty=1.4),
              dict(logit_bias={str(tok.encode("e")[0]): 4.0, "50": -100}, min_tokens=5)]
    for f in fields:
        kw = dict(f)
        if "logit_bias" in kw:
            kw["logit_bias"] = tuple((int(k), float(v)) for k, v in kw["logit_bias"].items())
        want = eng.generate([tok.encode(prompt)], SamplingParams(max_new_tokens=16, ignore_eos=True, **kw))[0]
        extra = {"ignore_eos": True} | {k: v for k, v in f.items() if k not in ("frequency_penalty", "presence_penalty",
                                                                               "logit_bias")}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, extra_body=extra,
                                      frequency_penalty=f.get("frequency_penalty"),
                                      presence_penalty=f.get("presence_penalty"), logit_bias=f.get("logit_bias"))
        assert r.choices[0].text == tok.decode(want.token_ids), f
    plain = eng.generate([tok.encode(prompt)], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert plain.token_ids != want.token_ids  # the penalties changed the output


@pytest.mark.parametrize("body,param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"n": 2.5}, "n"),
])
def test_bad_chat_values_are_400(server, body, param):
    with httpx.Client(base_url=server[0], timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]} | body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param


def test_prefix_cache_shows_in_usage_and_server_info(client, server):
    """A shared system prompt is prefilled once: the next request's usage reports it as cached, with
    the same answer as without the cache."""
    system = "You are a terse assistant; answer in lowercase words only."
    usages, texts = [], []
    for q in ["first question", "second question", "first question"]:
        r = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
                                           messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
        usages.append(r.usage)
        texts.append(r.choices[0].message.content)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[1] >= len(system) and cached[1] < usages[1].prompt_tokens
    assert cached[2] == usages[2].prompt_tokens - 1  # all of it but the last token, which is always prefilled
    assert texts[2] == texts[0]
    info = httpx.get(f"{server[0]}/server_info").json()
    assert info["prefix_cache"] and info["retractions"] == 0 and info["cached_tokens_total"] >= sum(cached)


def test_chat_logprobs_pieces_encode_what_json_would():
    """The pre-encoded chat logprobs (cached per-token pieces joined as bytes) parse to the object built
    the plain way, for tokens needing JSON escapes and a partial UTF-8 character."""
    import json

    import orjson

    from jeagle.sampling.logprobs import LOGPROB_COLUMNS, LOGPROB_TOP, TokenLogprob
    from jeagle.serve.protocol import TokenJSON, chat_logprobs

    raws = [b'say "hi"', b"back\\slash", b"new\nline\t", b"\xe2\x82", b"\xac", b"plain", b"\x00ctl"]

    class Pieces:  # token_piece as jeagle.loading.tokenizer.Tokenizer gives it
        def token_piece(self, t):
            raw = raws[t % len(raws)]
            return raw, raw.decode("utf-8", errors="replace"), list(raw)

    rng = np.random.default_rng(0)
    pairs = []
    for t in range(6):
        row = np.zeros(LOGPROB_COLUMNS, np.int32)
        row[:1] = np.float32([-rng.random()]).view(np.int32)
        row[1:1 + LOGPROB_TOP] = rng.permutation(LOGPROB_TOP * 2)[:LOGPROB_TOP]
        row[1 + LOGPROB_TOP:] = np.sort(-rng.random(LOGPROB_TOP).astype(np.float32))[::-1].view(np.int32)
        pairs.append((t, TokenLogprob(row)))
    pieces = Pieces()

    def entry(t, lp):
        _, text, raw = pieces.token_piece(t)
        return {"token": text, "logprob": lp, "bytes": raw}

    want = {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, p) for i, p in lp.top(5)]}
                        for t, lp in pairs], "refusal": None}
    got = chat_logprobs(TokenJSON(pieces), pairs, 5)
    assert json.loads(orjson.dumps({"logprobs": got}))["logprobs"] == want
    assert json.loads(orjson.dumps(chat_logprobs(TokenJSON(pieces), [], 5))) == {"content": [], "refusal": None}


def test_packed_chat_logprobs_encode_what_json_would():
    """`chat_logprobs_packed` (every number of a piece read with struct, encoded by one orjson call and
    filled into per-token templates with `%`) parses to the plain object for any top k, tokens holding
    `%` and JSON escapes, and non-finite logprobs (null), and is the bytes `chat_logprobs` gives."""
    import json

    import orjson

    from jeagle.sampling.logprobs import LOGPROB_COLUMNS, LOGPROB_TOP, from_bytes, to_bytes
    from jeagle.serve.protocol import TokenJSON, chat_logprobs, chat_logprobs_packed

    raws = [b"100%", b"%s%d%%", b'q"\\', b"\xe2\x82", b"plain"]

    class Pieces:
        def token_piece(self, t):
            raw = raws[t % len(raws)]
            return raw, raw.decode("utf-8", errors="replace"), list(raw)

    rng = np.random.default_rng(1)
    rows = np.zeros((7, LOGPROB_COLUMNS), np.int32)
    lp = np.sort(np.log(rng.random((7, LOGPROB_TOP))) * rng.choice([1e-7, 1.0, 40.0], (7, 1)), -1)[:, ::-1]
    lp = np.ascontiguousarray(lp, np.float32)
    lp[2, 5:] = -np.inf
    rows[:, 1:1 + LOGPROB_TOP] = rng.integers(0, 50, (7, LOGPROB_TOP))
    rows[:, 1 + LOGPROB_TOP:] = lp.view(np.int32)
    rows[:, 0] = np.float32([-0.0, -1e-8, -2.5e-7, -0.6931472, -13.25, -np.inf, -3.0]).view(np.int32)
    ids = [int(t) for t in rng.integers(0, 50, 7)]
    packed, pieces = rows.tobytes(), TokenJSON(Pieces())

    def number(x):
        return None if not np.isfinite(x) else x

    def entry(t, x):
        _, text, raw = Pieces().token_piece(t)
        return {"token": text, "logprob": number(x), "bytes": raw}

    for k in (0, 1, 5, LOGPROB_TOP):
        lps = from_bytes(packed)
        want = {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, p) for i, p in lp.top(k)]}
                            for t, lp in zip(ids, lps)], "refusal": None}
        got = orjson.dumps(chat_logprobs_packed(pieces, ids, packed, k))
        assert json.loads(got) == want
        assert got == orjson.dumps(chat_logprobs(pieces, list(zip(ids, lps)), k))
        assert to_bytes(lps) == packed
