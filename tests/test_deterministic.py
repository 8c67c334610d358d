"""Deterministic mode (`--deterministic`) and the first token in bf16, on CPU.

The target here is tuned so bf16 matters: a random 4-layer model whose embedding rows have RMS 1 and
whose attention and MLP outputs are scaled up (`MIX`), so the layers move the logits enough to make
near ties, while an EAGLE-1 head proposing lm_head(embed(token)) still gets about 1.6 tokens a round
(deep accepted paths). Without deterministic mode a few of these requests part between speculative
and target-only decoding at batch 4 (XLA CPU, 2026-11-24); with it none may, at any tier or batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.runtime.kv_cache import init_pools
from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.kernels.settings import KernelSettings, use
from jeagle.models.common import AttnInputs
from jeagle.models.llama import random_model
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import draft_config, signed_identity_head, target_config

MIX = 15.0
DET = KernelSettings(deterministic=True)


def near_tie_target(dtype="bfloat16", hidden=128, **sizes):
    """The target above; `hidden` and `sizes` (ModelConfig fields) replace its sizes."""
    cfg = dataclasses.replace(target_config(vocab=2048, hidden=hidden), dtype=dtype,
                              **({"num_layers": 4, "intermediate_size": 256, "head_dim": 32} | sizes))
    target = random_model(cfg, 1)
    e = np.asarray(target.embed[...].astype(jnp.float32))
    target.embed[...] = jnp.asarray(e / np.sqrt((e * e).mean(-1, keepdims=True)), cfg.dtype)
    target.wo[...] = target.wo[...] * MIX
    target.w_down[...] = target.w_down[...] * MIX
    return target


@pytest.fixture(scope="module")
def target():
    return near_tie_target()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(5, 2048, size=int(n))] for n in rng.integers(3, 40, size=24)]


def forward(model, tokens, attn, num_slots, settings, logits_index=None):
    k, v = init_pools(model.cfg, num_slots=num_slots)
    with use(settings):
        out = jax.jit(lambda tk, a, k, v, li: model(tk, a, k, v, logits_index=li))(
            jnp.asarray(tokens), attn, k, v, None if logits_index is None else jnp.asarray(logits_index))
    return out


def prefill_attn(lengths, t, base=1):
    b = len(lengths)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    table = (base + np.arange(b * t, dtype=np.int32).reshape(b, t)).astype(np.int32)
    write = np.where(pos < np.asarray(lengths)[:, None], table, 0)
    return AttnInputs(positions=jnp.asarray(pos), write_slots=jnp.asarray(write), kv_slots=jnp.asarray(table),
                      kv_len=jnp.asarray(lengths, jnp.int32))


def test_a_tokens_logits_do_not_depend_on_the_rest_of_the_call(target):
    """The same 20 tokens alone, in a padded batch of 5 beside other prompts (another row, other
    slots, a longer padded length), and as a tree-verify-shaped call (prefix in the pool, the last
    tokens as extra keys): bit-identical logits at every position, in bf16."""
    rng = np.random.default_rng(1)
    seq = rng.integers(5, 2048, size=20).astype(np.int32)
    alone = forward(target, seq[None], prefill_attn([20], 20), 64, DET).logits[0]

    toks = rng.integers(5, 2048, size=(5, 48)).astype(np.int32)
    toks[3, :20] = seq
    lengths = [7, 48, 1, 20, 33]
    batched = forward(target, toks, prefill_attn(lengths, 48, base=9), 512, DET).logits[3, :20]
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(batched))
    # 12 x 48 tokens: more tiles than run straight-line (the lax.map path of `tiled`).
    from jeagle.models.deterministic import TILE, UNROLL_TILES

    toks = rng.integers(5, 2048, size=(12, 48)).astype(np.int32)
    toks[10, :20] = seq
    assert 12 * 48 > TILE * UNROLL_TILES
    lengths = [48] * 10 + [20, 5]
    mapped = forward(target, toks, prefill_attn(lengths, 48, base=3), 1024, DET).logits[10, :20]
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(mapped))

    # Positions 0..14 prefilled, then 15..19 as a chain "tree" (each token sees its ancestors).
    k, v = init_pools(target.cfg, num_slots=128)
    table = np.arange(40, 80, dtype=np.int32)[None]
    with use(DET):
        run = jax.jit(lambda tk, a, k, v: target(tk, a, k, v))
        pre = AttnInputs(positions=jnp.arange(15, dtype=jnp.int32)[None], write_slots=jnp.asarray(table[:, :15]),
                         kv_slots=jnp.asarray(table[:, :15]), kv_len=jnp.asarray([15], jnp.int32))
        out = run(jnp.asarray(seq[None, :15]), pre, k, v)
        tree_slots = jnp.asarray([[100, 103, 101, 104, 102]], jnp.int32)  # not in position order
        chain = jnp.tril(jnp.ones((5, 5), bool))[None]
        tree = AttnInputs(positions=jnp.arange(15, 20, dtype=jnp.int32)[None], write_slots=tree_slots,
                          kv_slots=jnp.asarray(table[:, :32]), kv_len=jnp.asarray([15], jnp.int32),
                          extra_slots=tree_slots, extra_mask=chain)
        verified = run(jnp.asarray(seq[None, 15:]), tree, out.k, out.v).logits[0]
    np.testing.assert_array_equal(np.asarray(alone[15:]), np.asarray(verified))


def test_deterministic_forward_is_the_same_function_in_fp32():
    """The deterministic forward computes what the default one does (fp32, to rounding)."""
    model = near_tie_target("float32")
    rng = np.random.default_rng(2)
    toks = rng.integers(5, 2048, size=(3, 24)).astype(np.int32)
    attn = prefill_attn([24, 10, 17], 24)
    want = forward(model, toks, attn, 128, KernelSettings())
    got = forward(model, toks, attn, 128, DET)
    valid = np.arange(24)[None, :] < np.asarray([24, 10, 17])[:, None]
    np.testing.assert_allclose(np.asarray(got.logits)[valid], np.asarray(want.logits)[valid], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got.k), np.asarray(want.k), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def deterministic_reference(target, prompts):
    """Greedy target-only tokens in bf16, deterministic mode: the same at batch 1 and 4."""
    sp = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ref = {bs: [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=bs, max_context=128,
                                                                       kernels=DET)).generate(prompts, sp)]
           for bs in (1, 4)}
    assert ref[1] == ref[4]
    return ref[1]


@pytest.mark.parametrize("tier,bs", [((3, 2, 5), 1), ((3, 2, 5), 5), ((2, 1, 3), 4), ((4, 3, 8), 7)])
def test_deterministic_bf16_speculative_equals_target_only(target, prompts, deterministic_reference, tier, bs):
    """Greedy EAGLE in bf16 equals greedy target-only in bf16, token for token, whatever the tier and
    the batch of either, with deterministic mode on."""
    head = signed_identity_head(target, +1.0)
    sp = SamplingParams(max_new_tokens=48, ignore_eos=True)
    eng = speculative(target, head, EngineConfig(max_batch_size=bs, max_context=128, kernels=DET), SpecConfig(*tier))
    outs = [o.token_ids for o in eng.generate(prompts, sp)]
    parted = [i for i, (a, b) in enumerate(zip(outs, deterministic_reference)) if a != b]
    assert not parted, f"tier {tier}, batch {bs}: requests {parted} part from target-only"
    assert eng.last_stats.to_dict()["accept_length"] > 1.3  # the verify's deeper nodes were used


def test_deterministic_at_batch_16_continuous_and_after_prefix_cache_hits(target, prompts, deterministic_reference):
    """(5,4,8) at batch 16: the 24 prompts under continuous batching (rows admitted as others finish; the
    verify is two 64-token tiles of the jnp path, where batch 8's is one), then again, every prompt now a
    prefix-cache hit: token for token target-only's at batch 1, both times."""
    head = signed_identity_head(target, +1.0)
    sp = SamplingParams(max_new_tokens=48, ignore_eos=True)
    eng = speculative(target, head, EngineConfig(max_batch_size=16, max_context=128, kernels=DET), SpecConfig(5, 4, 8))
    for run in ("first", "again"):
        outs = [o.token_ids for o in eng.generate(prompts, sp)]
        parted = [i for i, (a, b) in enumerate(zip(outs, deterministic_reference)) if a != b]
        assert not parted, f"{run} run: requests {parted} part from target-only"
    assert eng.last_stats.cached_tokens > 0


def test_first_token_equal_in_bf16_without_deterministic_mode(target, prompts):
    """The first token comes from the prefill, the same computation with and without a draft (an
    EAGLE-3 head, whose prefill also reads the target's aux layers): equal in bf16 by default."""
    head = signed_identity_head(target, +1.0)
    from jeagle.models.eagle import random_draft

    eagle3 = random_draft(dataclasses.replace(draft_config(target.cfg, "eagle3"), dtype="bfloat16",
                                              hidden_size=128, target_hidden_size=128), seed=3)
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    want = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=5, max_context=128)
                                             ).generate(prompts, sp)]
    for h, bs in ((head, 1), (eagle3, 5)):
        got = [o.token_ids for o in speculative(target, h, EngineConfig(max_batch_size=bs, max_context=128),
                                                SpecConfig(3, 2, 5)).generate(prompts, sp)]
        assert got == want


def kernel_form_target():
    """A bf16 target that deterministic mode runs on its kernels (`kernels_serve`: head_dim 64), tuned for near
    ties as above; 4 layers, so an EAGLE-3 head's aux layers cut its layer loop."""
    return near_tie_target(hidden=192, intermediate_size=512, head_dim=64, num_heads=3, num_kv_heads=1)


KERNELS_DET = KernelSettings(deterministic=True, backend="interpret")  # on CPU the kernels run interpreted


def test_kernel_form_logits_keep_their_bits_whatever_the_layer_loops_form():
    """On the kernels (interpreted here, compiled on a GPU) the layers between the products and the attention
    are XLA's, fused as the layer loop's form allows: `unroll` layers per iteration (the decode step), the loop
    cut at EAGLE-3's aux layers (the verify), every layer inline. Compiled with the engine's options the
    logits are the same bits in every form (with XLA's excess precision on they were not: a fusion carried
    fp32 across a bf16 rounding, and greedy EAGLE parted from target-only on the GPU at batch 1)."""
    from jeagle.models.deterministic import kernels_serve
    from jeagle.runtime.executables import compiler_options

    target = kernel_form_target()
    with use(KERNELS_DET):
        assert kernels_serve(target)
    toks = jnp.asarray(np.random.default_rng(0).integers(5, 2048, size=(1, 8)).astype(np.int32))
    attn = prefill_attn([8], 8)
    got = []
    for form in (dict(unroll=3), dict(unroll=3, aux_layers=(1,)), dict(unroll=True)):
        k, v = init_pools(target.cfg, num_slots=16)
        with use(KERNELS_DET):
            run = jax.jit(lambda tk, a, k, v, form=form: target(tk, a, k, v, **form).logits)
            exe = run.lower(toks, attn, k, v).compile(compiler_options(KERNELS_DET, cublas_only=False) or None)
        got.append(np.asarray(exe(toks, attn, k, v)))
    for form in got[1:]:
        np.testing.assert_array_equal(got[0], form)


def test_deterministic_eagle3_on_the_kernels_equals_target_only():
    """Greedy EAGLE with an EAGLE-3 head (the verify's layer loop cut at its aux layers, the decode step's not)
    equals greedy target-only in bf16 on the kernels. Without the engine's deterministic XLA options request 1
    parts (XLA CPU, 2026-12-07)."""
    from jeagle.models.eagle import random_draft

    target = kernel_form_target()
    head = random_draft(dataclasses.replace(draft_config(target.cfg, "eagle3"), dtype="bfloat16",
                                            aux_layer_ids=(1, 2, 3)), seed=3)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(5, 2048, size=int(n))] for n in rng.integers(3, 30, size=8)]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    config = EngineConfig(max_batch_size=4, max_context=96, kernels=KERNELS_DET)
    want = [o.token_ids for o in target_only(target, config).generate(prompts, sp)]
    got = [o.token_ids for o in speculative(target, head, config, SpecConfig(3, 2, 4)).generate(prompts, sp)]
    assert [i for i, (a, b) in enumerate(zip(got, want)) if a != b] == []


def test_deterministic_option():
    from jeagle.config import ConfigError
    from jeagle.engine import EngineSpec

    spec = EngineSpec(deterministic=True)
    assert spec.kernels.deterministic and not EngineSpec().kernels.deterministic
    with pytest.raises(ConfigError, match="one device"):
        EngineSpec(deterministic=True, tp=2)
    with pytest.raises(ValueError, match="bool"):
        KernelSettings(deterministic=1)


@pytest.mark.gpu_slow  # the real model and head run deterministic mode in -m gpu (tests/test_gpu_engine.py)
@pytest.mark.parametrize("bs", [16, 48])
def test_deterministic_kernels_on_the_gpu_equal_target_only_at_every_batch(bs):
    """On a GPU deterministic mode runs on its own kernels (`linear_invariant`, `ordered_attention`): greedy EAGLE
    in bf16 at batch 16 / 48 — the static (5,4,8) tier, a chain and the adaptive set — equals greedy target-only
    at batch 1, every request, and the forms' logits are the same bits (the first test above, on the kernels)."""
    from jeagle.models.deterministic import kernels_serve

    target = near_tie_target()
    with use(DET):
        assert kernels_serve(target)
    test_a_tokens_logits_do_not_depend_on_the_rest_of_the_call(target)
    rng = np.random.default_rng(bs)
    prompts = [[int(t) for t in rng.integers(5, 2048, size=int(n))] for n in rng.integers(3, 120, size=bs)]
    sp = SamplingParams(max_new_tokens=48, ignore_eos=True)
    want = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=1, max_context=256, kernels=DET)
                                             ).generate(prompts, sp)]
    head = signed_identity_head(target, +1.0)
    ec = EngineConfig(max_batch_size=bs, max_context=256, kernels=DET)
    from jeagle.speculative.adaptive import AdaptiveConfig

    for name, eng in [("(5,4,8)", speculative(target, head, ec, SpecConfig(5, 4, 8))),
                      ("chain (4,1,5)", speculative(target, head, ec, SpecConfig(4, 1, 5))),
                      ("adaptive", speculative(target, head, ec, SpecConfig(5, 4, 8), adaptive=AdaptiveConfig(
                          candidate_tiers=((1, 4, 3), (3, 4, 5), (5, 4, 8)), ema_alpha=0.5, warmup_batches=2,
                          update_interval=1, policy="ema")))]:
        got = [o.token_ids for o in eng.generate(prompts, sp)]
        parted = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not parted, f"{name} at batch {bs}: requests {parted} part from target-only"
        assert eng.last_stats.to_dict()["accept_length"] > 1.3, name
