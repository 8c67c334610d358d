"""The engine: batch composition never changes outputs, sampling is seeded per request, stop rules."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.config import ModelConfig
from jeagle.engine import EngineConfig, PromptTooLong, target_only
from jeagle.runtime.buckets import default_batch_buckets, pick_bucket
from jeagle.models.llama import random_model
from jeagle.sampling import SamplingParams

CFG = ModelConfig(arch="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=1, head_dim=8, dtype="float32", max_position_embeddings=128, eos_token_ids=(3,))


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=2)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(4, 96, n)) for n in (3, 11, 6, 1, 17, 8)]


def test_buckets():
    b = default_batch_buckets(48)
    assert b[:8] == (1, 2, 3, 4, 5, 6, 7, 8) and b[8:12] == (10, 12, 14, 16) and b[-1] == 48 and 44 in b
    assert pick_bucket(b, 9) == 10 and pick_bucket(b, 48) == 48
    with pytest.raises(ValueError, match="largest bucket"):
        pick_bucket(b, 49)


def test_batch_composition_does_not_change_greedy_output(model, prompts):
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [target_only(model, EngineConfig(max_batch_size=1, max_context=64)).generate([p], sp)[0].token_ids
             for p in prompts]
    for batch, steps in ((6, 1), (4, 2), (2, 4)):
        engine = target_only(model, EngineConfig(max_batch_size=batch, max_context=64, decode_steps=steps))
        outs = engine.generate(prompts, sp)
        assert [o.token_ids for o in outs] == alone, (batch, steps)


def test_sampling_is_seeded_per_request(model, prompts):
    engine = target_only(model, EngineConfig(max_batch_size=6, max_context=64))
    sp = [SamplingParams(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=i, ignore_eos=True)
          for i in range(len(prompts))]
    together = engine.generate(prompts, sp)
    alone = engine.generate([prompts[2]], [sp[2]])[0]
    assert together[2].token_ids == alone.token_ids
    other_seed = engine.generate([prompts[2]], [SamplingParams(max_new_tokens=16, temperature=1.0, seed=99,
                                                               ignore_eos=True)])[0]
    assert other_seed.token_ids != alone.token_ids
    # Mixed greedy and sampled rows in one batch: the greedy row is unaffected.
    greedy = engine.generate([prompts[0]], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    mixed = engine.generate([prompts[0], prompts[1]], [SamplingParams(max_new_tokens=16, ignore_eos=True), sp[1]])
    assert mixed[0].token_ids == greedy.token_ids


def test_top_k_one_is_greedy(model, prompts):
    engine = target_only(model, EngineConfig(max_batch_size=2, max_context=64))
    g = engine.generate(prompts[:2], SamplingParams(max_new_tokens=10, ignore_eos=True))
    k1 = engine.generate(prompts[:2], SamplingParams(max_new_tokens=10, temperature=0.7, top_k=1, seed=5,
                                                     ignore_eos=True))
    assert [o.token_ids for o in g] == [o.token_ids for o in k1]


def test_sampled_tokens_follow_the_distribution():
    """Empirical frequencies of the sampler match softmax(logits / T) restricted by top-k/top-p."""
    import jax.numpy as jnp

    from jeagle.sampling import sample

    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]], jnp.float32))
    n = 4000
    seeds = jnp.arange(n, dtype=jnp.uint32)
    tile = lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:])  # noqa: E731
    toks = sample(tile(logits), seeds, jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n, jnp.int32),
                  jnp.ones(n), all_greedy=False)
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    assert np.abs(freq - [0.5, 0.25, 0.15, 0.1]).max() < 0.03
    # top_p 0.7 keeps {0, 1} (mass before token 1 is 0.5 < 0.7, before token 2 is 0.75): renormalised 2/3, 1/3.
    toks = sample(tile(logits), seeds, jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.zeros(n, jnp.int32),
                  jnp.full(n, 0.7), all_greedy=False)
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    assert freq[2] == freq[3] == 0 and abs(freq[0] - 2 / 3) < 0.03


def test_stop_rules(model, prompts):
    engine = target_only(model, EngineConfig(max_batch_size=2, max_context=64))
    free = engine.generate([prompts[1]], SamplingParams(max_new_tokens=20, ignore_eos=True))[0].token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    out = engine.generate([prompts[1]], SamplingParams(max_new_tokens=20, stop_token_ids=(stop_at,),
                                                       ignore_eos=True))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    out = engine.generate([prompts[1]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == free[:4] and out.finish_reason == "length"


def test_context_limits(model):
    engine = target_only(model, EngineConfig(max_batch_size=1, max_context=32))
    with pytest.raises(PromptTooLong, match="prompt 0 has 32 tokens; the context holds 32"):
        engine.generate([[5] * 32], SamplingParams(max_new_tokens=1))
    # A prompt that fits but leaves less room than max_new_tokens stops at the context end.
    out = engine.generate([[5] * 30], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[500]], SamplingParams(max_new_tokens=1))


def test_executables_take_the_params_as_leaves_and_follow_replaced_params(model, prompts):
    """Executables take the params as one flat tuple built once (`FlatParams.param_leaves`); a decoder
    whose params are replaced (bench/adaptive.py swaps heads this way) runs on the new ones."""
    import jax
    from flax import nnx

    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    eng = target_only(model, EngineConfig(max_batch_size=2, max_context=64))
    dec = eng.decoder
    leaves = dec.param_leaves
    assert leaves is dec.param_leaves and len(leaves) == len(jax.tree.leaves(dec.params))
    before = [o.token_ids for o in eng.generate(prompts[:2], sp)]
    other = random_model(CFG, seed=3)
    dec.params = nnx.split(other)[1]
    assert dec.param_leaves is not leaves
    swapped = [o.token_ids for o in eng.generate(prompts[:2], sp)]
    fresh = [o.token_ids for o in target_only(other, EngineConfig(max_batch_size=2, max_context=64))
             .generate(prompts[:2], sp)]
    assert swapped == fresh and swapped != before
