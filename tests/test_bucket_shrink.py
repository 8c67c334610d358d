"""A draining batch keeps its bucket (`EngineConfig.bucket_shrink_ratio`): the same greedy tokens as
target-only decoding and as the smallest-bucket rule, fewer buckets passed, every slot free afterwards,
nothing compiled after warm-up. fp32, tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import kv_idle

MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def workload():
    """Eight requests on eight rows that finish one after another (max new tokens 3 ... 38)."""
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9, 3, 7, 4, 6, 8)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (3, 38, 8, 13, 18, 23, 28, 33)]
    return prompts, params


@pytest.fixture(scope="module")
def reference(target, workload):
    prompts, params = workload
    eng = target_only(target, EngineConfig(max_batch_size=8, max_context=MAX_CONTEXT))
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("speculate", [False, True], ids=["target", "eagle"])
def test_a_draining_batch_keeps_its_bucket_and_its_tokens(target, workload, reference, speculate):
    prompts, params = workload
    head = signed_identity_head(target, +1.0, noise=0.08)  # partial acceptance: rows finish raggedly
    used = {}
    cfg = EngineConfig(max_batch_size=8, max_context=MAX_CONTEXT)
    eng = speculative(target, head, cfg, SpecConfig(3, 2, 5)) if speculate else target_only(target, cfg)
    assert eng.bucket_shrink_ratio == 2.0  # the default
    eng.warmup_for([len(p) for p in prompts], max(sp.max_new_tokens for sp in params), greedy=(True,), progress=False)
    for ratio in (1.0, 2.0, 8.0):
        eng.bucket_shrink_ratio = ratio  # the rule is the scheduler's, changeable between runs (bench/decode.py does)
        got = [o.token_ids for o in eng.generate(prompts, params)]
        assert got == reference, ratio
        assert kv_idle(eng)[0] == eng.pool.num_slots - 1, ratio
        stats = eng.last_stats
        assert stats.compilations_after_warmup == 0, ratio
        used[ratio] = stats.buckets_used
    # The smallest-bucket rule passes every bucket the batch drains through; ratio 2 only those its rows
    # fill at most half of first (8, then 4 or less, ...); ratio 8 keeps 8 until one row is left.
    assert len(used[1.0]) >= 6, used
    assert set(used[2.0]) < set(used[1.0]) and len(used[2.0]) <= 4, used
    assert used[8.0] == [1, 8], used
