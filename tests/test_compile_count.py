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
