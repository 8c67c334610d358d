"""Structured outputs: JSON schemas (nested objects, enums, arrays), any JSON object, regexes
and EBNF through llguidance. Greedy constrained decoding equals a numpy reference (a teacher-forced
forward per token, the grammar's mask applied by hand) in target-only decoding and with EAGLE (tree
nodes masked by their paths), mixed with unconstrained requests in one batch; every output parses and
validates. fp32, a tiny target over a 100-token ASCII vocabulary."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling.grammar import GrammarBackend, GrammarError
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
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


@pytest.mark.parametrize("tier,threaded,ids", [((3, 2, 5), False, True), ((2, 1, 3), False, False),
                                               ((4, 3, 8), False, True), ((3, 2, 5), True, True)])
def test_eagle_equals_the_reference(tok, target, head, workload, expected, tier, threaded, ids):
    """(threaded: the executables called on the dispatch thread, `EngineConfig.dispatch_thread`; ids:
    `EngineConfig.grammar_token_ids`, walked rounds' masks sent as token ids, else always bitmasks.)"""
    prompts, params = workload
    eng = speculative(target, head, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4),
                      rounds_per_dispatch=2, dispatch_thread=threaded, grammar_token_ids=ids), SpecConfig(*tier))
    assert eng.decoder.threaded == threaded
    outs = eng.generate(prompts, params)
    check_outputs(tok, outs, params)
    assert all(o.token_ids == e for o, e in zip(outs, expected) if e is not None)
    assert eng.last_stats.to_dict()["accept_length"] > 1.0
    assert (eng.decoder.grammar_compact_rounds > 0) == ids  # walked rounds' masks as token ids (none: option off)
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


def test_matchers_build_in_the_background(tok, target, head, workload, expected, monkeypatch):
    """A grammar request's matcher builds on a worker thread (`Grammar.matcher(background=True)`, from
    `submit`): the engine keeps stepping the running requests meanwhile, admits the request once its
    matcher is built, and emits the reference's tokens."""
    import threading

    import jeagle.sampling.grammar as grammar

    go, real = threading.Event(), grammar._build
    monkeypatch.setattr(grammar, "_build", lambda g: (go.wait(30), real(g))[1])
    prompts, params = workload
    eng = target_only(target, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4)))
    free = eng.submit(prompts[-1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    eng.step()
    r = eng.submit(prompts[0], params[0])
    for _ in range(3):
        eng.step()
    assert not r.matcher.ready and r.row == -1 and r.out.token_ids == []  # waiting for its matcher ...
    assert len(free.out.token_ids) > 0  # ... while the running request steps
    go.set()
    while eng.has_work:
        eng.step()
    assert r.out.token_ids == expected[0] and len(free.out.token_ids) == 40
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1
    # A speculative engine's greedy rows are walked on its thread: their matchers are copies of the
    # grammar's template (ready at once, the blocked builds notwithstanding); sampled rows build their own.
    go.clear()
    spec = speculative(target, head, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4)),
                       SpecConfig(3, 2, 5))
    greedy = spec.submit(prompts[0], params[0])
    sampled = spec.submit(prompts[1], dataclasses.replace(params[1], temperature=0.7, seed=1))
    assert greedy.matcher.ready and not sampled.matcher.ready
    go.set()
    while spec.has_work:
        spec.step()
    assert greedy.out.token_ids == expected[0]
    check_outputs(tok, [sampled.out], [params[1]])


@pytest.mark.parametrize("spec", [False, True])
def test_warmup_compiles_the_grammar_executables(tok, backend, target, head, spec):
    """warmup(grammar=(False, True)) compiles what grammar batches run (target-only: one-step decodes;
    EAGLE: the draft, the verify's forward and its masked accept): a grammar request compiles nothing
    after it, and its stats report the host's mask time."""
    cfg = EngineConfig(max_batch_size=2, max_context=MAX_CONTEXT, batch_buckets=(1, 2))
    eng = speculative(target, head, cfg, SpecConfig(3, 2, 5)) if spec else target_only(target, cfg)
    prompt = tok.encode("pet:", add_special_tokens=False)
    eng.warmup(prefill_lengths=[len(prompt)], greedy=(True,), grammar=(False, True), progress=False)
    sp = SamplingParams(max_new_tokens=60, grammar=backend.compile("json_schema", SCHEMAS[0]))
    out = eng.generate([prompt, prompt[:-1]], [sp, SamplingParams(max_new_tokens=8, ignore_eos=True)])
    json.loads(text_of(tok, out[0].token_ids))
    stats = eng.last_stats
    assert stats.compilations_after_warmup == 0 and stats.grammar_mask_ms > 0


def test_bad_grammars_are_refused(backend):
    for kind, src in [("regex", "a(b"), ("json_schema", {"type": 5}), ("json_schema", "[1, 2]"),
                      ("ebnf", "root ::= missing"), ("json_schema", "{not json")]:
        with pytest.raises(GrammarError):
            backend.compile(kind, src)


def _random_tree(rng, n: int, path: list[int]):
    """A draft tree of n nodes (parents before children) whose tokens follow `path` (a valid
    continuation: the root is its first token) along some branches and are random elsewhere."""
    parents, depth, tokens = [-1], [0], [path[0]]
    for j in range(1, n):
        p = int(rng.integers(0, j)) if rng.random() < 0.5 else j - 1
        parents.append(p)
        depth.append(depth[p] + 1)
        d = depth[-1]
        tokens.append(path[d] if d < len(path) and rng.random() < 0.7 else int(rng.integers(4, VOCAB)))
    return np.array(tokens, np.int32), np.array(parents, np.int32)


def test_batched_tree_masks_equal_the_one_request_walk(tok, backend):
    """`grammar.tree_masks` (chains in waves on llguidance's threads) gives every node the mask
    `Matcher.tree_masks` (each path consumed alone) gives it, over random trees at every position of
    valid outputs, with requests without a grammar (all allowed) mixed in; the matchers are left as
    they were (the next mask unchanged)."""
    from jeagle.sampling.grammar import tree_masks

    rng = np.random.default_rng(0)
    docs = [json.dumps({"name": "rex", "kind": "dog"}, separators=(",", ":")),
            json.dumps({"id": 42, "tags": ["a", "ccc"], "owner": {"ok": True, "level": 2}}, separators=(",", ":"))]
    for round_ in range(6):
        matchers, trees = [], []
        for i in range(7):
            if i == 3:
                matchers.append(None)  # an unconstrained request in the batch
                trees.append(_random_tree(rng, 8, [5, 6]))
                continue
            k = int(rng.integers(0, 2))
            ids = tok.encode(docs[k], add_special_tokens=False)
            m = backend.compile("json_schema", SCHEMAS[k]).matcher()
            pos = int(rng.integers(1, len(ids) - 1))
            for t in ids[:pos]:
                m.consume(t)
            matchers.append(m)
            trees.append(_random_tree(rng, int(rng.choice([2, 5, 8, 12])) if i else 8, ids[pos - 1:]))
        n = max(len(t) for t, _ in trees)  # pad the trees to one N with nodes off the tree (parent -1)
        tokens = np.stack([np.pad(t, (0, n - len(t))) for t, _ in trees])
        parents = np.stack([np.pad(p, (0, n - len(p)), constant_values=-1) for _, p in trees])
        before = [m.mask() if m is not None else None for m in matchers]
        got = tree_masks(matchers, tokens, parents, VOCAB)
        for i, m in enumerate(matchers):
            want = m.tree_masks(tokens[i], parents[i]) if m is not None else np.full_like(got[i], -1)
            np.testing.assert_array_equal(got[i], want, err_msg=f"round {round_} request {i}")
            if m is not None:
                np.testing.assert_array_equal(m.mask(), before[i])


def _greedy_walk(logits, masks, tokens, parents):
    """The verify's greedy accept walk under per-node masks: the tokens it emits."""
    ids = np.arange(logits.shape[1])
    node, out = 0, []
    while True:
        allowed = ((masks[node][ids // 32] >> (ids % 32)) & 1).astype(bool)
        c = int(np.argmax(np.where(allowed, logits[node], -np.inf)))
        out.append(c)
        nxt = [j for j in range(1, len(tokens)) if parents[j] == node and tokens[j] == c]
        if not nxt:
            return out
        node = nxt[0]


def test_walk_masks_give_the_full_masks_walk(tok, backend):
    """`grammar.walk_masks` (greedy rows: the verify's top tokens checked, not a mask per node) makes
    the accept walk emit what it emits under every node's full mask, over random logits with planted
    ties, trees that follow the grammar's own choices, and every position of valid documents (EOS
    and nodes where no candidate is allowed decided by the node's own mask); where it cannot decide
    (several tokens allowed, none a candidate; a tie at the last candidate) it says so."""
    from jeagle.sampling.grammar import masks_from_ids
    from jeagle.sampling.grammar_walk import CANDIDATES, compact, walk_masks, walk_nodes

    rng = np.random.default_rng(1)
    as_ids, as_bits = [], []  # compact rows: their masks as token ids, and as the walk's bitmasks
    docs = [json.dumps({"name": "rex", "kind": "dog"}, separators=(",", ":")),
            json.dumps({"id": 42, "tags": ["a", "ccc"], "owner": {"ok": True, "level": 2}}, separators=(",", ":"))]
    decided = undecided = 0
    for trial in range(300):
        k = trial % 2
        ids = tok.encode(docs[k], add_special_tokens=False)
        m = backend.compile("json_schema", SCHEMAS[k]).matcher()
        pos = int(rng.integers(1, len(ids) + 1))  # the whole document: the grammar is complete
        for t in ids[:pos]:
            m.consume(t)
        n = 8
        logits = rng.normal(size=(n, VOCAB)).astype(np.float32)
        follow = ids[pos:] + [EOS]
        for j in range(min(n, len(follow))):  # the document's next tokens often lead
            if rng.random() < 0.6:
                logits[j, follow[j]] = 4.0
                if rng.random() < 0.3:  # tied with another token (allowed or not)
                    logits[j, int(rng.integers(4, VOCAB))] = 4.0
        if rng.random() < 0.3:  # ties, some at the candidates' boundary
            row = int(rng.integers(0, n))
            top = np.argsort(-logits[row])[: CANDIDATES + 2]
            logits[row, top[int(rng.integers(1, len(top)))]] = logits[row, top[0]]
        parents, depth, tokens = [-1], [0], [ids[pos - 1]]
        for j in range(1, n):
            p = int(rng.integers(0, j)) if rng.random() < 0.4 else j - 1
            parents.append(p)
            depth.append(depth[p] + 1)
            d = depth[-1] - 1  # node j at depth d + 1 follows the document's token d
            t = follow[d] if d < len(follow) and rng.random() < 0.7 else int(rng.integers(4, VOCAB))
            while any(parents[i] == p and tokens[i] == t for i in range(1, j)):  # siblings differ, as top-K's do
                t = int(rng.integers(4, VOCAB))
            tokens.append(t)
        tokens, parents = np.array(tokens, np.int32), np.array(parents, np.int32)
        # The device's top-k may order tied logits either way: here lower ids first or last.
        ix = np.broadcast_to(np.arange(VOCAB), logits.shape)
        order = np.lexsort((ix if trial % 3 else -ix, -logits), axis=1)[:, :CANDIDATES]
        top_ids = order.astype(np.int32)
        top_vals = np.take_along_axis(logits, order, 1)
        full = m.tree_masks(tokens, parents)
        want = _greedy_walk(logits, full, tokens, parents)
        out = np.empty_like(full)
        before = m.mask()
        if walk_masks(m, tokens, parents, top_ids, top_vals, out):
            decided += 1
            assert _greedy_walk(logits, out, tokens, parents) == want, trial
            nodes = walk_nodes(m, tokens, parents, top_ids, top_vals, out.shape[1])
            if compact(nodes):
                ids = np.full((n, CANDIDATES), -1, np.int32)
                for node, allowed in nodes.items():
                    ids[node, :len(allowed)] = allowed
                as_ids.append(ids)
                as_bits.append(out.copy())
        else:
            undecided += 1
        np.testing.assert_array_equal(m.mask(), before)  # the matcher did not move
    from jeagle.sampling.grammar_walk import UNDECIDED
    print("decided", decided, "undecided", undecided, dict(UNDECIDED), "compact", len(as_ids))
    assert decided > 200 and undecided > 10, (decided, undecided)
    # The accept's compact form (`masks_from_ids` on the device) gives the same bitmasks.
    assert len(as_ids) > 150
    np.testing.assert_array_equal(np.asarray(masks_from_ids(np.stack(as_ids), out.shape[1])), np.stack(as_bits))


def test_walk_masks_leave_a_tie_at_the_last_candidate_undecided(tok, backend):
    """After '{"id":' only digits may follow. The candidates are C-1 letters and then '5'; '3', no
    candidate, may tie '5' (the masked argmax would then be '3', the lower id): the walk must not
    decide '5' at the last candidate."""
    from jeagle.sampling.grammar_walk import CANDIDATES, walk_masks

    m = backend.compile("json_schema", SCHEMAS[1]).matcher()
    for t in tok.encode('{"id":', add_special_tokens=False):
        m.consume(t)
    letters = tok.encode("abcdefghijklm", add_special_tokens=False)[: CANDIDATES - 1]
    five, three = tok.encode("5", add_special_tokens=False)[0], tok.encode("3", add_special_tokens=False)[0]
    top_ids = np.array([letters + [five]], np.int32)
    top_vals = np.array([[9.0 - i for i in range(CANDIDATES - 1)] + [1.0]], np.float32)
    out = np.empty((1, (VOCAB + 31) // 32), np.int32)
    tokens, parents = np.array([tok.encode(":", add_special_tokens=False)[0]], np.int32), np.array([-1], np.int32)
    assert not walk_masks(m, tokens, parents, top_ids, top_vals, out)
    assert three < five
    # '5' one place up, above the last candidate (a letter): every other token is below it, decided.
    top_ids[0, -2:] = [five, letters[-1]]
    top_vals[0, -2:] = [1.5, 1.0]
    assert walk_masks(m, tokens, parents, top_ids, top_vals, out) and allowed(out[0]).nonzero()[0].tolist() == [five]


def test_compiled_grammars_are_reused(tok, backend):
    """The same schema compiles once, a different one anew; each request's matcher is its own."""
    a = backend.compile("json_schema", SCHEMAS[0])
    assert backend.compile("json_schema", json.loads(json.dumps(SCHEMAS[0]))) is a
    assert backend.compile("json_schema", SCHEMAS[1]) is not a
    m1, m2 = a.matcher(), a.matcher()
    m1.consume(tok.encode("{", add_special_tokens=False)[0])
    assert not np.array_equal(m1.mask(), m2.mask())  # one advancing leaves the other at the start


@pytest.fixture(scope="module")
def server(tok, target, head):
    from jeagle.serve import create_app
    from tests.test_serve import start_server

    engine = speculative(target, head, EngineConfig(max_batch_size=32, batch_buckets=(1, 8, 32),
                                                    max_context=MAX_CONTEXT), SpecConfig(3, 2, 5))
    srv, thread, url = start_server(create_app(engine, tok, "tiny"))
    yield url
    srv.should_exit = True
    thread.join(timeout=30)


def test_server_features_under_32_concurrent_requests(server, tok):
    """Every structured-output form (json_schema, json_object, regex, EBNF) mixed with logprobs, n > 1,
    penalties, streaming with usage and plain requests: 32 at once over HTTP with the openai client,
    EAGLE on, one batch of up to 32 rows. Every output parses, validates and matches; each greedy
    request answers what it answers alone (masks, penalties and logprobs stay with their rows)."""
    import concurrent.futures

    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    email = r"[a-z]{2,5}@(x|yy)\.com"
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "z"'

    def ask(i):
        kind = i % 8
        if kind < 2:  # sampled, seeded
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{kind}", "schema": SCHEMAS[kind]}}
            r = client.completions.create(model="tiny", prompt=f"pet {i}:", max_tokens=80, temperature=0.7, seed=i,
                                          extra_body={"response_format": fmt})
            jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[kind])
            return r.choices[0].finish_reason, None
        if kind == 2:  # greedy, with logprobs
            # Free-form keys sampled from this random target can outrun max_tokens (finish "length").
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"obj {i}"}],
                                               max_tokens=80, temperature=0, logprobs=True, top_logprobs=3,
                                               response_format={"type": "json_object"})
            text = r.choices[0].message.content
            assert isinstance(json.loads(text), dict)
            lps = r.choices[0].logprobs.content
            assert "".join(t.token for t in lps) == text and all(len(t.top_logprobs) == 3 for t in lps)
            return r.choices[0].finish_reason, (text, [round(t.logprob, 4) for t in lps])
        if kind == 3:  # greedy, penalized
            r = client.completions.create(model="tiny", prompt=f"mail {i}:", max_tokens=40, temperature=0,
                                          frequency_penalty=0.8, extra_body={"regex": email})
            assert re.fullmatch(email, r.choices[0].text), r.choices[0].text
            return r.choices[0].finish_reason, r.choices[0].text
        if kind == 4:  # streamed chat under an EBNF grammar, usage in the last event
            chunks = list(client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"list {i}"}], max_tokens=40, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ebnf": ebnf}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert re.fullmatch(r"\(([0-9]|z)(,([0-9]|z))*\)", text), text
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= len(text)
            return [c.choices[0].finish_reason for c in chunks if c.choices][-1], text
        if kind == 5:  # n = 2 sampled choices under a schema
            fmt = {"type": "json_schema", "json_schema": {"name": "s0", "schema": SCHEMAS[0]}}
            r = client.completions.create(model="tiny", prompt=f"two pets {i}:", max_tokens=80, temperature=1.0, n=2,
                                          seed=i, extra_body={"response_format": fmt})
            assert sorted(c.index for c in r.choices) == [0, 1]
            for c in r.choices:
                jsonschema.validate(json.loads(c.text), SCHEMAS[0])
            assert r.usage.completion_tokens == sum(len(tok.encode(c.text)) + 1 for c in r.choices)  # + EOS each
            return r.choices[0].finish_reason, None
        # plain requests (greedy, with logprobs, or sampled) beside the constrained ones
        r = client.completions.create(model="tiny", prompt=f"text {i}:", max_tokens=12, temperature=0 if kind == 6 else 0.9,
                                      seed=i, logprobs=2 if kind == 6 else None, extra_body={"ignore_eos": True})
        return "stop" if kind == 6 else r.choices[0].finish_reason, r.choices[0].text if kind == 6 else None

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(ask, range(32)))
    assert all(f in ("stop", "length") for f, _ in together)
    assert [f for i, (f, _) in enumerate(together) if i % 8 not in (2, 6, 7)] == ["stop"] * 20
    for i in (2, 3, 4, 6):  # greedy ones: alone, the same answer (logprobs to 1e-4)
        alone = ask(i)[1]
        if i == 2:
            assert alone[0] == together[i][1][0]
            np.testing.assert_allclose(alone[1], together[i][1][1], atol=1e-4)
        else:
            assert alone == together[i][1], i


def test_stream_options_need_a_stream(server):
    import httpx

    for body in ({"stream_options": {"include_usage": True}}, {"stream": True, "stream_options": {"usage": True}},
                 {"stream": True, "stream_options": {"include_usage": "yes"}}):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "abc", "max_tokens": 4} | body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


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
