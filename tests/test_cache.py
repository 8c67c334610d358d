"""Paged cache: the slot layout never changes results; prefill + decode equals one full forward."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.runtime.slots import OutOfSlots, SlotAllocator
from jeagle.config import ModelConfig
from jeagle.engine import EngineConfig, target_only
from jeagle.models.llama import random_model
from jeagle.sampling import SamplingParams
from tests.util import kv_idle, max_rel_err, ragged_forward

CFG = ModelConfig(arch="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, dtype="float32", max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=1)


def test_random_slot_permutations_give_same_logits(model):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 128, n)) for n in (9, 4, 13)]
    base, _ = ragged_forward(model, prompts)
    for _ in range(3):
        perm = rng.permutation(3 * 13)
        got, _ = ragged_forward(model, prompts, slot_order=perm)
        for i, p in enumerate(prompts):
            assert max_rel_err(got[i, : len(p)], base[i, : len(p)]) <= 1e-5


def test_prefill_then_decode_equals_full_forward(model):
    """Greedy tokens from the engine (prefill, then decode steps through the cache) are the argmax of
    one full forward over prompt + generated tokens at every position."""
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, 128, n)) for n in (7, 3, 12)]
    for steps in (1, 3):
        engine = target_only(model, EngineConfig(max_batch_size=3, max_context=64, decode_steps=steps))
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=10))
        full = [p + o.token_ids for p, o in zip(prompts, outs)]
        logits, _ = ragged_forward(model, full)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            want = logits[i, len(p) - 1 : len(p) - 1 + len(o.token_ids)].argmax(-1).tolist()
            assert o.token_ids == want


def test_allocator_exhaustion_and_reuse():
    alloc = SlotAllocator(8)  # slot 0 is scratch: 7 usable
    a = alloc.alloc(5)
    assert 0 not in a and len(set(a.tolist())) == 5
    with pytest.raises(OutOfSlots, match="need 3, 2 free"):
        alloc.alloc(3)
    alloc.free(a)
    assert alloc.free_count == 7
    with pytest.raises(ValueError):
        alloc.free([0])


def test_engine_frees_every_slot(model):
    engine = target_only(model, EngineConfig(max_batch_size=2, max_context=64, max_total_tokens=40))
    idle = kv_idle(engine)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, 128, n)) for n in (5, 9, 2, 11)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert kv_idle(engine) == idle
    engine.flush_cache()
    assert engine.pool.free_slots == idle[0]


def test_kv_slots_exhausted_is_a_clear_error(model):
    engine = target_only(model, EngineConfig(max_batch_size=2, max_context=64, max_total_tokens=16))
    with pytest.raises(OutOfSlots, match="needs 19 KV slots, the pool has 16"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=10))


def test_capacity_from_memory_fraction():
    from jeagle.runtime.kv_cache import kv_bytes_per_token
    from jeagle.runtime.slots import slots_for_memory_fraction

    class FakeGPU:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 2**30}

    per_token = kv_bytes_per_token(CFG)
    slots = slots_for_memory_fraction(CFG, 0.5, weight_bytes=2**30, device=FakeGPU())
    assert slots == (40 * 2**30 - 2 * 2**30) // per_token

    class FakeCPU:
        platform = "cpu"

        def memory_stats(self):
            return None

    with pytest.raises(ValueError, match="pass --max-total-tokens"):
        slots_for_memory_fraction(CFG, 0.5, weight_bytes=0, device=FakeCPU())
