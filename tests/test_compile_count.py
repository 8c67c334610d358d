"""JAX's own count of XLA compilations (`jeagle.runtime.compile_count`): the engine's reading of it after a
warm-up sees every compilation in the process, its own executables' and any other jit's."""

from __future__ import annotations

import jax
import numpy as np

from jeagle.engine import EngineConfig, target_only
from jeagle.runtime import compile_count
from jeagle.sampling import SamplingParams
from tests.spec_models import bigram_target, target_config


def test_the_event_counted_is_jaxs_backend_compile_event():
    from jax._src import dispatch

    assert compile_count.BACKEND_COMPILE_EVENT == dispatch.BACKEND_COMPILE_EVENT
    before = compile_count.count()
    jax.jit(lambda x: x * 3 - 1)(np.zeros((3, 5, 7), np.float32))
    assert compile_count.count() == before + 1
    compile_count.install()  # once per process: a second call adds no second listener
    jax.jit(lambda x: x * 5 - 1)(np.zeros((3, 5, 7), np.float32))
    assert compile_count.count() == before + 2


def test_after_warmup_the_engine_reports_jaxs_count_which_sees_a_stray_jit():
    """Warmed up for its prompts, generate compiles nothing (0); a jit of anyone's in the process then counts
    (1), where the engine's own counter, which counts its executables, sees nothing."""
    engine = target_only(bigram_target(target_config()), EngineConfig(max_batch_size=2, max_context=64,
                                                                      batch_buckets=(1, 2)))
    prompts, params = [[5, 6, 7, 8, 9], [10, 11, 12]], SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.generate(prompts[:1], params)
    assert engine.xla_compilations_after_warmup is None  # no warm-up yet
    engine.warmup_for([len(p) for p in prompts], params.max_new_tokens, greedy=(True,), progress=False)
    assert engine.xla_compilations_after_warmup == 0
    engine.generate(prompts, params)
    assert engine.xla_compilations_after_warmup == 0 and engine.last_stats.compilations_after_warmup == 0
    compiled = engine.num_compiled
    jax.jit(lambda x: x.reshape(-1) + 1)(np.zeros((11, 13), np.float32))  # a shape nothing else uses
    assert engine.xla_compilations_after_warmup == 1 and engine.num_compiled == compiled


def test_warmup_for_prompts_that_share_a_start_covers_their_prefix_cache_hits():
    """Prompts with one start (a chat template's) at batch 1: every one after the first continues the cached
    prefix, a prefill of its own executables; `warmup_for` compiles those too, so generate compiles nothing
    (without them the timed pass of a benchmark compiled and read ~6x slower)."""
    from jeagle.engine import speculative
    from jeagle.speculative.round import SpecConfig
    from tests.spec_models import signed_identity_head

    target = bigram_target(target_config())
    rng = np.random.default_rng(0)
    start = list(rng.integers(5, 90, size=40))
    prompts = [start + list(rng.integers(5, 90, size=int(n))) for n in (7, 19, 12)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(max_batch_size=1, max_context=128)
    for engine in (target_only(target, config),
                   speculative(target, signed_identity_head(target, 1.0), config, SpecConfig(3, 2, 4))):
        engine.warmup_for([len(p) for p in prompts], params.max_new_tokens, greedy=(True,), progress=False)
        engine.generate(prompts, params)
        assert engine.last_stats.cached_tokens > 0  # the later prompts continued the first's prefix
        assert engine.xla_compilations_after_warmup == 0
