"""The host's one place for KV slots and rows (jeagle/runtime/slots.py) and for buckets
(jeagle/runtime/buckets.py), without a model: layouts, the pool's hand-out and take-back, planning a
padded batch, padding and trimming."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.runtime.kv_cache import SCRATCH_SLOT
from jeagle.runtime.buckets import Buckets, batch_buckets, pad, pick_bucket, prefill_batch_buckets, unpad
from jeagle.runtime.config import EngineConfig
from jeagle.runtime.slots import OutOfSlots, SlotLayout, SlotPool, flat_slots, pool_size


def test_layout_parts_are_disjoint_and_capped_at_the_context():
    spec = SlotLayout(past_last=6, tree=8, scratch=12)  # S=5, N=8, (S-1)K=12
    assert spec.context_reserve == 6 and SlotLayout().context_reserve == 0
    slots = np.arange(100, 100 + spec.slots_needed(10, 20, 512))
    positions, tree, scratch = spec.split(slots, 10, 20, 512)
    assert (len(positions), len(tree), len(scratch)) == (36, 8, 12)
    assert len(set(positions) | set(tree) | set(scratch)) == len(slots)
    # Near the context end the positions stop at max_ctx; the tree and scratch stay whole.
    assert spec.positions(500, 100, 512) == 512 and spec.slots_needed(500, 100, 512) == 532
    # Target-only: the last token's KV is never written.
    assert SlotLayout().slots_needed(10, 20, 512) == 29


def test_pool_hands_out_rows_and_slots_and_takes_them_back():
    pool = SlotPool(num_slots=11, max_reqs=2)
    assert (pool.free_rows, pool.free_slots, pool.scratch_row) == (2, 10, 2)
    row_a, a = pool.take_row(), pool.allocator.alloc(4)
    row_b, b = pool.take_row(), pool.allocator.alloc(5)
    assert {row_a, row_b} == {0, 1}
    taken = np.concatenate([a, b])
    assert SCRATCH_SLOT not in taken and len(set(taken)) == 9 and taken.max() <= 10
    assert pool.free_rows == 0 and pool.free_slots == 1  # no row left
    pool.allocator.free(a)
    pool.give_row(row_a)
    assert (pool.free_rows, pool.free_slots) == (1, 5)
    with pytest.raises(ValueError, match="free or not a row"):
        pool.give_row(row_a)
    row_c, c = pool.take_row(), pool.allocator.alloc(5)
    assert row_c == row_a and len(c) == 5 and not set(c) & set(b)
    with pytest.raises(OutOfSlots, match="need 3, 0 free of 10"):
        pool.allocator.alloc(3)
    with pytest.raises(ValueError, match="invalid slot"):
        pool.allocator.free([SCRATCH_SLOT])


def test_a_cpu_pool_fits_the_hosts_memory(monkeypatch, caplog):
    """With no --max-total-tokens a CPU pool takes at most HOST_KV_FRACTION of the host's available
    memory (target and draft pools) in full requests, a power of two of them (the same size while free
    memory moves a little), never less than one, and says so; a GPU's and an explicit size are left alone."""
    import dataclasses

    import jax

    import jeagle.runtime.slots as slots
    from jeagle.runtime.kv_cache import kv_bytes_per_token
    from jeagle.config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=1024, dtype="float32")
    draft = dataclasses.replace(cfg, num_layers=1)
    per_slot = kv_bytes_per_token(cfg) + kv_bytes_per_token(draft)
    layout, ctx = SlotLayout(past_last=6, tree=8, scratch=12), 1024
    per_request = layout.slots_needed(ctx, 1, ctx)
    config = EngineConfig(max_batch_size=16, max_context=ctx)
    full = 16 * per_request
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(slots, "HOST_KV_FRACTION", 0.5)
    room = lambda n: lambda: 2 * n * per_request * per_slot  # noqa: E731 - memory for n full requests' KV
    monkeypatch.setattr(slots, "host_available_bytes", room(6.5))  # 6 fit: 4 (a power of two, stable)
    with caplog.at_level("WARNING", logger="jeagle.runtime"):
        assert pool_size(config, cfg, layout, ctx, 0, draft) == 4 * per_request + 1
    assert "--max-total-tokens" in caplog.text
    with monkeypatch.context() as gpu:
        gpu.setattr(jax, "default_backend", lambda: "gpu")
        assert pool_size(config, cfg, layout, ctx, 0, draft) == full + 1
    assert pool_size(EngineConfig(max_batch_size=16, max_context=ctx, max_total_tokens=999), cfg, layout, ctx, 0,
                     draft) == 1000
    monkeypatch.setattr(slots, "host_available_bytes", room(7.9))  # the same pool while free memory moves
    assert pool_size(config, cfg, layout, ctx, 0, draft) == 4 * per_request + 1
    monkeypatch.setattr(slots, "host_available_bytes", room(0.3))  # not even one request fits: one anyway
    assert pool_size(config, cfg, layout, ctx, 0, draft) == per_request + 1
    monkeypatch.setattr(slots, "host_available_bytes", room(16))  # room for all: every row's full context
    assert pool_size(config, cfg, layout, ctx, 0, draft) == full + 1
    monkeypatch.undo()
    assert slots.host_available_bytes() > 0  # this Linux host's MemAvailable


def test_flat_slots_pads_with_the_scratch_slot():
    count, flat = flat_slots(4, 8, [np.array([5, 6, 7]), np.array([9])])
    assert count.tolist() == [3, 1, 0, 0]
    assert flat.shape == (32,) and flat[:4].tolist() == [5, 6, 7, 9] and (flat[4:] == SCRATCH_SLOT).all()


def config(**kw):
    return EngineConfig(**{"max_batch_size": 16, "max_context": 1024, **kw})


def test_batch_tables():
    assert batch_buckets(12, config()) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12)
    assert batch_buckets(12, config(disable_padding=True)) == tuple(range(1, 13))
    assert batch_buckets(12, config(batch_buckets=(16, 4))) == (4, 16)
    assert batch_buckets(12, config(max_bucket=12)) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12)
    with pytest.raises(ValueError, match="largest batch bucket 8 < max running requests 12"):
        batch_buckets(12, config(batch_buckets=(4, 8)))
    with pytest.raises(ValueError, match="--max-bucket 8 < max running requests 12"):
        batch_buckets(12, config(max_bucket=8))
    decode = batch_buckets(48, config())
    assert prefill_batch_buckets(decode, config()) == (1, 4, 16, 48)
    assert pick_bucket(decode, 9) == 10
    with pytest.raises(ValueError, match="exceeds the largest bucket 48"):
        pick_bucket(decode, 49)


def test_a_running_batch_keeps_its_bucket_until_it_fills_at_most_one_over_the_ratio():
    b = Buckets(batch=batch_buckets(48, config()), prefill_batch=(1, 48), prefill_len=(64,), kv=(1024,), max_ctx=1024,
                max_prefill_tokens=8192)
    assert b.decode(47, 10, current=48) == (48, 1024)  # ratio 1: the smallest bucket that fits (SGLang's)
    assert b.decode(30, 10, current=48, shrink_ratio=2.0) == (48, 1024)  # 30 rows fill more than half of 48
    assert b.decode(24, 10, current=48, shrink_ratio=2.0) == (24, 1024)  # half: down to the smallest that fits
    assert b.decode(13, 10, current=24, shrink_ratio=2.0) == (24, 1024)
    assert b.decode(11, 10, current=24, shrink_ratio=2.0) == (12, 1024)
    assert b.decode(33, 10, current=24, shrink_ratio=2.0) == (40, 1024)  # growing is never held back
    assert b.decode(5, 10, current=0, shrink_ratio=4.0) == (5, 1024)  # a new batch starts at its own bucket
    with pytest.raises(ValueError, match="bucket_shrink_ratio must be >= 1"):
        config(bucket_shrink_ratio=0.5)


def test_plans_pick_the_smallest_covering_buckets():
    b = Buckets(batch=(1, 2, 4, 8), prefill_batch=(1, 4, 8), prefill_len=(16, 64, 256), kv=(128, 256, 512),
                max_ctx=512, max_prefill_tokens=512)
    assert b.prefill(3, 17) == (4, 64)
    assert b.decode(5, 129) == (8, 256)
    assert b.decode(1, 10_000) == (1, 512)  # prefixes are capped at the context
    assert b.prefill_fits(8, 64) and not b.prefill_fits(4, 200) and b.prefill_fits(1, 256)
    prefill, decode = b.warmup_plan()
    assert (1, 256, 0) in prefill and (4, 256, 0) not in prefill and (8, 64, 0) in prefill
    assert all(bb == 1 or bb * t <= 512 for bb, t, _ in prefill) and all(c == 0 for *_, c in prefill)
    assert len(decode) == 12
    prefill, decode = b.warmup_plan(batch_sizes=[3], prefill_lengths=[20], kv_lengths=[100, 300])
    assert (prefill, decode) == ([(4, 64, 0)], [(4, 128), (4, 512)])
    # After a prefix-cache hit a prefill attends over a context bucket >= its length, up to the longest prompt's.
    prefill, _ = b.warmup_plan(batch_sizes=[1], prefill_lengths=[10, 60], prefix=(False, True))
    assert prefill == [(1, 16, 0), (1, 64, 0), (1, 16, 16), (1, 16, 64), (1, 64, 64)]
    assert b.context(65) == 256


def test_pad_and_unpad():
    out = pad([3, 4], 4, -1, np.int32)
    assert out.tolist() == [3, 4, -1, -1] and out.dtype == np.int32
    rows = pad(np.ones((2, 3)), 4, 0.0, np.float32)
    assert rows.shape == (4, 3) and rows[2:].sum() == 0
    assert pad([], 2, 7, np.int32).tolist() == [7, 7]
    assert unpad(np.arange(8).reshape(4, 2), 2).tolist() == [[0, 1], [2, 3]]


def test_kv_buckets_follow_the_kernel_settings():
    """One bucket (the context) where the paged-attention kernel serves every attention, powers of two
    with the reference: decided by the config's KernelSettings, not the environment."""
    from jeagle.kernels.settings import KernelSettings

    heads = (16,)
    ref = Buckets.for_engine(config(kernels=KernelSettings(backend="reference")), 4, 1024, heads)
    ker = Buckets.for_engine(config(kernels=KernelSettings(backend="interpret")), 4, 1024, heads)
    assert len(ref.kv) > 1 and ref.kv[-1] == 1024
    assert ker.kv == (1024,)
    # Prefills after a cache hit: every context bucket with the reference, the whole context with the
    # kernel's causal form (or the prompt-length buckets again when prefills are told to gather).
    assert ref.contexts == ref.prefill_len and ker.contexts == (1024,)
    assert ref.context(200) == pick_bucket(ref.prefill_len, 200) < 1024
    assert ker.context(20) == ker.context(1000) == 1024
    gathered = Buckets.for_engine(config(kernels=KernelSettings(backend="interpret", prefill_attention="gathered")),
                                  4, 1024, heads)
    assert gathered.contexts == gathered.prefill_len
    prefill, _ = ker.warmup_plan(batch_sizes=[1], prefill_lengths=[10, 200], prefix=(False, True))
    short, long_ = pick_bucket(ker.prefill_len, 10), pick_bucket(ker.prefill_len, 200)
    assert short < long_ and [p for p in prefill if p[2]] == [(1, short, 1024), (1, long_, 1024)]


def test_small_prefills_unroll_their_layers_on_a_gpu(monkeypatch):
    """Prefills of b x t <= SMALL_PREFILL_TOKENS run 3 layers per iteration on a GPU (their time is the
    layer loop's launches); larger ones keep the plain loop; an explicit unroll_layers applies to
    both."""
    import jax

    from jeagle.config import ModelConfig
    from jeagle.runtime import steps

    mc = ModelConfig(arch="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=8)
    cfg = EngineConfig()
    assert steps.layer_unroll("prefill", cfg, mc) is False
    assert steps.layer_unroll("small_prefill", cfg, mc) == (3 if jax.default_backend() == "gpu" else False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert steps.layer_unroll("small_prefill", cfg, mc) == 3
    assert steps.layer_unroll("small_prefill", EngineConfig(unroll_layers=True), mc) is True
    step_only = EngineConfig(step_unroll_layers=True)  # the decode step and round only
    assert [steps.layer_unroll(p, step_only, mc) for p in ("prefill", "small_prefill", "step", "round")] == [False, 3, True, True]
    static = type("S", (), {"unroll_prefill": False, "unroll_small_prefill": 3})()
    n = steps.SMALL_PREFILL_TOKENS
    assert steps.prefill_unroll(static, 1, n) == 3 and steps.prefill_unroll(static, 4, n // 4) == 3
    assert steps.prefill_unroll(static, 1, 2 * n) is False and steps.prefill_unroll(static, 2, n) is False


@pytest.mark.parametrize("kind", ["target", "eagle"])
def test_slot_table_reads_in_flight_together_each_read_their_rows(kind):
    """Reads share a pool of output buffers (donated on a GPU: tests/test_gpu.py): two in flight at once
    each get their own, and a buffer handed back serves the next read with that read's values."""
    from jeagle.engine import speculative, target_only
    from jeagle.speculative.round import SpecConfig
    from tests.spec_models import bigram_target, signed_identity_head, target_config

    target = bigram_target(target_config())
    cfg = EngineConfig(max_batch_size=3, max_context=64)
    eng = (target_only(target, cfg) if kind == "target"
           else speculative(target, signed_identity_head(target, 1.0), cfg, SpecConfig(3, 2, 4)))
    dec = eng.decoder
    dec.assign_slots([(0, 0, np.arange(10, 15)), (1, 0, np.arange(20, 23)), (2, 3, np.arange(30, 32))])
    if kind == "eagle":  # committed lengths per row (speculative rows keep them on the device)
        import dataclasses

        import jax.numpy as jnp

        dec.state = dataclasses.replace(dec.state, rows=dataclasses.replace(
            dec.state.rows, seq_len=jnp.arange(4, dtype=jnp.int32) + 7))
    a, b = dec.read_tables([1]), dec.read_tables([2, 0])
    ta, la = dec.tables_of(a)
    tb, lengths = dec.tables_of(b)
    assert ta[0, :4].tolist() == [20, 21, 22, 0]
    assert tb[0, :6].tolist() == [0, 0, 0, 30, 31, 0] and tb[1, :6].tolist() == [10, 11, 12, 13, 14, 0]
    # speculative: the rows' own lengths; target-only: zeros (the host knows them), also from a reused buffer
    assert (la.tolist(), lengths.tolist()) == (([8], [9, 7]) if kind == "eagle" else ([0], [0, 0]))
    c = dec.read_tables([0])  # a buffer handed back above
    tc, lc = dec.tables_of(c)
    assert tc[0, :5].tolist() == [10, 11, 12, 13, 14] and lc.tolist() == ([7] if kind == "eagle" else [0])
    assert ta[0, :4].tolist() == [20, 21, 22, 0]  # the host's copies stay as read
