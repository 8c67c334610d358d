"""The speculative engine stays lossless with the kernel backend on (interpreted on CPU, compiled on GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.kernels.settings import KernelSettings
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config


def run(mode):
    kernels = KernelSettings(backend=mode)
    target = bigram_target(target_config())
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(4, 96, n)) for n in (4, 9, 2)]
    sp = SamplingParams(max_new_tokens=14, ignore_eos=True)
    want = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=3, max_context=96, kernels=kernels)).generate(prompts, sp)]
    for head in (signed_identity_head(target, +1.0), signed_identity_head(target, +1.0, noise=0.08)):
        for tier in [(3, 1, 4), (5, 4, 8)]:
            engine = speculative(target, head, EngineConfig(max_batch_size=3, max_context=96, kernels=kernels), SpecConfig(*tier))
            assert [o.token_ids for o in engine.generate(prompts, sp)] == want, (mode, tier)


def test_lossless_with_interpreted_kernels():
    run("interpret")


@pytest.mark.gpu_slow  # engines on the reference and the kernels; tests/test_gpu_engine.py runs the kernels' engines
def test_lossless_with_compiled_kernels():
    run("pallas")


def sampled(mode):
    target = bigram_target(target_config())
    rng = np.random.default_rng(6)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 3)]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, seed=11)
    head = signed_identity_head(target, +1.0, noise=0.08)
    engine = speculative(target, head, EngineConfig(max_batch_size=2, max_context=96, kernels=KernelSettings(backend=mode)), SpecConfig(4, 4, 8))
    return [o.token_ids for o in engine.generate(prompts, sp)], list(engine.decoder.recent_accepts)


def test_sampling_kernel_draws_what_the_reference_draws():
    """Same seeds, same coins: the interpreted sampling kernel emits exactly the reference's tokens."""
    want, accepted = sampled("reference")
    assert max(accepted) >= 2  # the walks accept drafted tokens (bonus included), so the kernel's walk is exercised
    assert sampled("interpret")[0] == want


@pytest.mark.gpu_slow  # engines on the reference and the kernels; tests/test_gpu_engine.py runs the kernels' engines
def test_sampling_kernel_compiled_draws_what_the_reference_draws():
    want, _ = sampled("reference")
    assert sampled("pallas")[0] == want


def attention_pair():
    """A random target and head whose attention matters (the bigram targets above zero `wo`), with
    head_dim 16 so the compiled paged-attention kernel serves them too."""
    import dataclasses

    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model
    from tests.spec_models import draft_config

    cfg = dataclasses.replace(target_config(), head_dim=16)
    target = random_model(cfg, seed=1)
    target.lm_head[...] = target.lm_head[...] * 30.0  # clear argmax margins: fp32 rounding never decides a token
    head = random_draft(dataclasses.replace(draft_config(cfg), head_dim=16), seed=2)
    return target, head


def paged(mode):
    target, head = attention_pair()
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(4, 96, n)) for n in (40, 3, 75)]  # prefixes past one 64-slot block
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    cfg = EngineConfig(max_batch_size=3, max_context=256, kernels=KernelSettings(backend=mode))
    plain = target_only(target, cfg)
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = speculative(target, head, cfg, SpecConfig(3, 2, 5))
    assert [o.token_ids for o in spec.generate(prompts, sp)] == want
    return want, plain.buckets.kv, spec.buckets.kv


def test_paged_attention_kernel_in_the_engines():
    """Interpreted paged attention: one prefix bucket (the whole context) for decode and rounds, speculative
    output equal to target-only, and the same tokens as the reference attention with its prefix buckets."""
    want, plain_kv, spec_kv = paged("reference")
    assert len(plain_kv) > 1 and len(spec_kv) > 1
    got, plain_kv, spec_kv = paged("interpret")
    assert plain_kv == spec_kv == (256,)
    assert got == want


@pytest.mark.gpu_slow  # engines on the reference and the kernels; tests/test_gpu_engine.py runs the kernels' engines
def test_paged_attention_kernel_in_the_engines_compiled():
    want, _, _ = paged("reference")
    got, plain_kv, spec_kv = paged("pallas")
    assert plain_kv == spec_kv == (256,)
    assert got == want


def cached_prefills(mode, prefill_attention="paged", speculative_too=True):
    """Prompts sharing, nesting and diverging prefixes, each engine run twice (the second run all cache
    hits): every prefill after a hit attends over its cached prefix and its own suffix."""
    from tests.test_prefix_cache import prompts_with_prefixes

    target, head = attention_pair()
    prompts = prompts_with_prefixes()
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    cfg = EngineConfig(max_batch_size=3, max_context=160,
                       kernels=KernelSettings(backend=mode, prefill_attention=prefill_attention))
    outs = []
    engines = [target_only(target, cfg)] + ([speculative(target, head, cfg, SpecConfig(3, 2, 5))] if speculative_too
                                            else [])
    for engine in engines:
        first = [o.token_ids for o in engine.generate(prompts, sp)]
        assert [o.token_ids for o in engine.generate(prompts, sp)] == first and engine.last_stats.cached_tokens > 100
        engine.check_kv()
        outs.append(first)
    assert all(out == outs[0] for out in outs)
    return outs[0]


def test_prefills_after_cache_hits_through_the_causal_kernel(monkeypatch):
    """The prefills (plain and after a prefix-cache hit) take the kernel's causal form when it serves,
    and give the reference's tokens; `prefill_attention="gathered"` keeps the jnp attention."""
    from jeagle.models import common

    want = cached_prefills("reference")
    calls = []
    real = common._causal_paged
    monkeypatch.setattr(common, "_causal_paged", lambda *a: calls.append(a[0].shape) or real(*a))
    assert cached_prefills("interpret") == want
    assert calls, "no prefill took the causal kernel"
    calls.clear()
    assert cached_prefills("interpret", "gathered", speculative_too=False) == want
    assert not calls


@pytest.mark.gpu_slow  # engines on the reference and the kernels; tests/test_gpu_engine.py runs the kernels' engines
def test_prefills_after_cache_hits_through_the_causal_kernel_compiled():
    assert cached_prefills("pallas") == cached_prefills("reference")
