"""Tensor parallelism on real GPUs (`JEAGLE_TEST_GPU=1 pytest -m gpu` on a runner with 2+ GPUs): with
the compiled Pallas kernels (paged attention per KV-head shard under shard_map, the other kernels on
replicated bookkeeping), target-only and speculative output at tp 2 equals the single-GPU output
(greedy, fp32 with full-precision matmuls), and the KV pools live split by KV heads."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.gpu
def test_tp2_on_gpus_equals_one_gpu():
    import jax

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 GPUs")
    from jeagle.engine import EngineConfig, speculative, target_only
    from jeagle.kernels.backend import backend
    from jeagle.sampling import SamplingParams
    from jeagle.speculative.round import SpecConfig
    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model
    from tests.spec_models import draft_config, target_config

    assert backend() == "pallas"
    # random weights, attention and MLP live (a wrong shard of the attention changes the tokens)
    cfg = target_config(vocab=256, hidden=128).replace(num_heads=4, num_kv_heads=2, head_dim=32)
    target = random_model(cfg, 0)
    head = random_draft(draft_config(cfg).replace(head_dim=32), seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 256, n).tolist() for n in (5, 9, 3, 12, 7, 30)]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with jax.default_matmul_precision("highest"):
        one = EngineConfig(max_batch_size=4, max_context=128)
        ref = [o.token_ids for o in target_only(target, one).generate(prompts, params)]
        two = EngineConfig(max_batch_size=4, max_context=128, tp=2)
        eng = target_only(target, two)
        assert eng.decoder.state.cache.k.sharding.spec[2] == "tp"
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
        spec = speculative(target, head, two, SpecConfig(num_steps=3, topk=2, num_draft_tokens=4))
        assert [o.token_ids for o in spec.generate(prompts, params)] == ref
