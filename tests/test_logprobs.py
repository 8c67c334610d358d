"""Log-probabilities: every emitted token's logprob and top-k, from the prefill, the
decode steps and the speculative rounds' accepted tokens, equal a teacher-forced forward of the
whole sequence (the target's own log-softmax at each position) and agree between EAGLE and
target-only decoding to 1e-4; batches that mix requests with and without logprobs; rounds looped
on the device. fp32, tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling.logprobs import LOGPROB_TOP
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import ragged_forward, kv_idle

MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def target():
    # Soft next-token distributions (the bigram target's default scale makes them one-hot).
    return bigram_target(target_config(), scale=4.0)


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.08)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [list(map(int, rng.integers(4, 96, n))) for n in (5, 2, 9, 3)]


def reference_logprobs(target, prompt, tokens):
    """log-softmax of a teacher-forced forward of prompt + tokens at the positions that emitted them."""
    logits, _ = ragged_forward(target, [prompt + tokens[:-1]])
    x = logits[0, len(prompt) - 1:].astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def check_against_forward(target, prompt, out, k):
    ref = reference_logprobs(target, prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp.logprob - ref[j, tok]) < 1e-4, (j, lp.logprob, ref[j, tok])
        top = lp.top(k)
        assert len(top) == k
        order = np.argsort(-ref[j], kind="stable")[:k]
        np.testing.assert_allclose([p for _, p in top], ref[j, order], atol=1e-4)
        assert all(top[i][1] >= top[i + 1][1] for i in range(k - 1))


def params(i, k, sampled=False, **kw):
    extra = dict(temperature=0.8, seed=10 + i) if sampled else {}
    return SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=k, **extra, **kw)


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_equal_a_teacher_forced_forward_and_target_only(target, head, prompts, sampled):
    ks = [5, 0, LOGPROB_TOP, 3]
    ps = [params(i, k, sampled) for i, k in enumerate(ks)]
    cfg = EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4))
    ref = target_only(target, cfg).generate(prompts, ps)
    eng = speculative(target, head, cfg, SpecConfig(3, 2, 5))
    got = eng.generate(prompts, ps)
    assert eng.last_stats.to_dict()["accept_length"] > 1.05  # drafts were accepted
    for p, k, r, g in zip(prompts, ks, ref, got):
        check_against_forward(target, p, g, k)
        check_against_forward(target, p, r, k)
        if not sampled:  # sampled speculation follows the target's law, not target-only's draws
            assert g.token_ids == r.token_ids
            np.testing.assert_allclose([x.logprob for x in g.logprobs], [x.logprob for x in r.logprobs], atol=1e-4)


def test_batches_mixing_logprobs_and_none(target, head, prompts):
    """Requests without logprobs get none and the same tokens; those with them get theirs, with
    rounds looped on the device (R = 3) and requests finishing inside a dispatch."""
    ps = [SamplingParams(max_new_tokens=m, ignore_eos=True, logprobs=k) for m, k in ((7, 2), (13, None), (4, 1),
                                                                                        (10, None))]
    plain = [SamplingParams(max_new_tokens=p.max_new_tokens, ignore_eos=True) for p in ps]
    cfg = EngineConfig(max_batch_size=2, max_context=MAX_CONTEXT, batch_buckets=(1, 2))
    base = [o.token_ids for o in target_only(target, cfg).generate(prompts, plain)]
    for eng in (target_only(target, EngineConfig(max_batch_size=2, max_context=MAX_CONTEXT, batch_buckets=(1, 2),
                                                 decode_steps=3)),
                speculative(target, head, EngineConfig(max_batch_size=2, max_context=MAX_CONTEXT,
                                                       batch_buckets=(1, 2), rounds_per_dispatch=3),
                            SpecConfig(3, 2, 5))):
        outs = eng.generate(prompts, ps)
        assert [o.token_ids for o in outs] == base
        for p, sp, o in zip(prompts, ps, outs):
            if sp.logprobs is None:
                assert o.logprobs is None
            else:
                check_against_forward(target, p, o, sp.logprobs)
        assert kv_idle(eng)[0] == eng.pool.num_slots - 1


def test_logprobs_out_of_range_is_refused():
    for k in (-1, LOGPROB_TOP + 1):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=k)


@pytest.mark.parametrize("kind", ["target", "eagle"])
def test_prompt_logprobs(target, head, prompts, kind, monkeypatch):
    """Completions' echo: each prompt token's logprob (the first: None) given the ones before it,
    computed a few positions at a time (a chunk of 4 here, so prompts span several)."""
    import jeagle.sampling.logprobs

    monkeypatch.setattr(jeagle.sampling.logprobs, "PROMPT_CHUNK", 4)
    ps = [SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=i != 1) for i in range(4)]
    cfg = EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4))
    eng = target_only(target, cfg) if kind == "target" else speculative(target, head, cfg, SpecConfig(3, 2, 5))
    outs = eng.generate(prompts, ps)
    for p, sp, o in zip(prompts, ps, outs):
        check_against_forward(target, p, o, 2)
        if not sp.prompt_logprobs:
            assert o.prompt_logprobs is None
            continue
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        logits, _ = ragged_forward(target, [p])
        x = logits[0].astype(np.float64)
        ref = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        for j in range(1, len(p)):
            lp = o.prompt_logprobs[j]
            assert abs(lp.logprob - ref[j - 1, p[j]]) < 1e-4
            np.testing.assert_allclose([v for _, v in lp.top(2)], np.sort(ref[j - 1])[::-1][:2], atol=1e-4)


def test_blocked_top_k_equals_top_k():
    """The two-step top-k the logprobs use on a large vocabulary (jeagle.sampling.logprobs.top_k_blocked)."""
    import jax

    from jeagle.sampling.logprobs import top_k_blocked

    for shape in [(3, 49152), (2, 5, 5001), (4, 3000), (2, 96)]:
        x = jax.random.normal(jax.random.key(1), shape)
        want, got = jax.lax.top_k(x, LOGPROB_TOP), jax.jit(top_k_blocked, static_argnums=1)(x, LOGPROB_TOP)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_requests_keep_packed_rows():
    """A request keeps its tokens' packed blocks as the chunks that arrived (no TokenLogprob per token
    on the engine thread): `Output.logprobs` reads them as TokenLogprobs with the blocks' values, a
    stop token drops the blocks of the tokens after it, a served event's bytes are the last tokens'
    blocks, and TokenLogprob lists still go in (`Output(logprobs=...)`, `take`)."""
    from jeagle.sampling.logprobs import LOGPROB_COLUMNS, LogprobRows, from_bytes, to_bytes, unpack
    from jeagle.runtime.requests import Output, Request

    rng = np.random.default_rng(0)
    blocks = rng.integers(-2**31, 2**31 - 1, (9, LOGPROB_COLUMNS)).astype(np.int32)
    r = Request(index=0, prompt=[1], params=SamplingParams(logprobs=3), eos=frozenset({7}), max_new=100,
                out=Output(prompt_ids=[1], logprobs=[]))
    assert r.out.logprobs == [] and len(r.out.logprob_rows) == 0 and r.out.logprob_rows.tail_bytes(2) == b""
    assert r.take(np.array([4, 5]), 0.0, blocks[:2]) == [4, 5]
    assert r.out.logprob_rows.tail_bytes(2) == blocks[:2].tobytes()
    assert r.take([6], 0.0, unpack(blocks[2:3])) == [6]  # a list of TokenLogprobs
    assert r.take(np.array([3, 7, 9]), 0.0, blocks[3:6]) == [3, 7]  # the stop token ends it: 9 is dropped
    assert r.out.token_ids == [4, 5, 6, 3, 7] and r.done
    assert r.out.logprob_rows.tail_bytes(4) == blocks[1:5].tobytes()  # across chunks
    lps = r.out.logprobs
    assert len(lps) == 5 and r.out.logprobs is lps  # built once while nothing arrives
    assert to_bytes(lps) == blocks[:5].tobytes()
    for lp, want in zip(lps, from_bytes(blocks[:5].tobytes())):  # the same numbers, bit for bit
        assert lp.top_ids.tolist() == want.top_ids.tolist()
        assert np.array_equal([lp.logprob], [want.logprob], equal_nan=True)
        assert lp.top_logprobs.tobytes() == want.top_logprobs.tobytes()
    assert Output(prompt_ids=[1], logprobs=lps).logprob_rows == LogprobRows(blocks[:5])
    assert Output(prompt_ids=[1]).logprobs is None
    with pytest.raises(AssertionError, match="without them"):
        Request(index=1, prompt=[1], params=SamplingParams(logprobs=0), eos=frozenset(), max_new=5,
                out=Output(prompt_ids=[1], logprobs=[])).take([4], 0.0, None)
