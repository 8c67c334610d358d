"""The paged-attention kernel: interpreted on CPU and compiled with -m gpu, against its pure-jnp
reference on random pools and slot tables. Cases cover prefixes of 0, under one block, exact blocks
and several blocks; grouped and ungrouped heads; with and without extra (tree) keys; padded queries;
prefixes split into runs (KernelSettings.paged_attention_splits) and merged; the causal (prefill) form
over one and several query tiles, after a cached prefix and from position 0."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.kernels.paged_attention import (BLOCK, MIN_DECODE_SPLITS, QUERY_TILE, kernel_serves, paged_attention,
                                            paged_attention_reference, prefix_splits)
from jeagle.kernels.settings import KernelSettings, use
from tests.kernels.lowering import lower_for_h100


def inputs(b, t, hq, hkv, d, e, seed, dtype=jnp.float32, layers=3, slots=700, cols=300):
    rng = np.random.default_rng(seed)
    kp = jnp.asarray(rng.normal(size=(layers, slots, hkv, d)), dtype)
    vp = jnp.asarray(rng.normal(size=(layers, slots, hkv, d)), dtype)
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    table = jnp.asarray(rng.integers(1, slots, size=(b, cols)), jnp.int32)
    lengths = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, cols]
    kv_len = jnp.asarray([lengths[(seed + i) % len(lengths)] for i in range(b)], jnp.int32)
    extra = (None, None)
    if e:
        xs = jnp.asarray(rng.integers(1, slots, size=(b, e)), jnp.int32)
        xm = rng.random((b, t, e)) < 0.4
        xm[:, :, 0] = True  # every query sees at least its root, as in a tree
        extra = (xs, jnp.asarray(xm))
    return q, kp, vp, jnp.int32(seed % layers), table, kv_len, *extra


def causal_inputs(b, t, hq, hkv, d, seed, dtype=jnp.float32, cols=300, fresh=False):
    """A prefill's arguments: row i continues a cached prefix of starts[i] positions with lengths[i]
    new tokens (padded to t; the padding continues the positions), or starts at 0 when `fresh`."""
    q, kp, vp, layer, table, *_ = inputs(b, t, hq, hkv, d, 0, seed, dtype=dtype, cols=cols)
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0] = t
    starts = np.zeros(b, np.int64) if fresh else rng.integers(0, cols - t + 1, size=b)
    if not fresh:
        starts[-1] = BLOCK - 1  # a suffix that straddles a block edge
    positions = jnp.asarray(starts[:, None] + np.arange(t)[None, :], jnp.int32)
    return q, kp, vp, layer, table, jnp.asarray(starts + lengths, jnp.int32), None, None, positions


def check(mode, args, tol, splits=None):
    with use(KernelSettings(backend=mode, paged_attention_splits=splits)):
        got = np.asarray(paged_attention(*args), np.float32)
    want = np.asarray(paged_attention_reference(*args), np.float32)
    sees = np.asarray(args[5]) > 0  # queries with no key at all are padding (kernel: zeros)
    if args[6] is not None:
        sees = sees[:, None] | np.asarray(args[7]).any(-1)
    else:
        sees = np.broadcast_to(sees[:, None], got.shape[:2])
    if len(args) > 8 and args[8] is not None:
        sees = sees & (np.asarray(args[8]) >= 0)
    np.testing.assert_allclose(got[sees], want[sees], atol=tol, rtol=tol)
    assert np.all(got[~sees] == 0)


CASES = [  # b, t, hq, hkv, d, e
    (1, 1, 4, 4, 16, 0),  # decode, no grouping
    (3, 1, 6, 2, 16, 1),  # decode with its own slot as the extra key
    (4, 5, 6, 2, 16, 7),  # draft-like: K beams over scratch slots
    (2, 8, 9, 3, 32, 8),  # SmolLM2's grouping (3 query heads per KV head), a tree of 8
    (3, 20, 4, 1, 16, 20),  # a 20-node tree, one KV head
]


@pytest.mark.parametrize("case", CASES)
def test_interpreted_matches_reference(case):
    check("interpret", inputs(*case, seed=sum(case)), tol=2e-5)


@pytest.mark.parametrize("case,splits", [(CASES[1], "auto"), (CASES[3], 2)], ids=["decode-auto", "tree-2"])
def test_split_prefixes_match_reference(case, splits):
    """Runs of a split prefix (some empty: past the request's end) merge to the reference, the tree keys
    counted once; lengths 0..300 over 5 table blocks."""
    args = inputs(*case, seed=sum(case))
    with use(KernelSettings(paged_attention_splits=splits)):
        assert prefix_splits(case[0], case[3], args[4].shape[1]) > 1
    check("interpret", args, tol=2e-5, splits=splits)


CAUSAL = [  # b, t, hq, hkv, d
    (1, 16, 9, 3, 32),  # a short suffix after a cached prefix: one query tile (48 rows)
    (2, 64, 9, 3, 16),  # SmolLM2's grouping, 192 rows: three tiles
    (3, 7, 4, 4, 16),  # no grouping, a tile padded past the last row
]


@pytest.mark.parametrize("case", CAUSAL)
@pytest.mark.parametrize("splits", [None, "auto"])
def test_causal_form_matches_reference(case, splits):
    """Queries continuing cached prefixes see the prefix and the suffix up to themselves."""
    args = causal_inputs(*case, seed=sum(case))
    check("interpret", args, tol=2e-5, splits=splits)


def test_causal_form_from_position_zero():
    """A plain prefill (every row from position 0) across several query tiles and key blocks."""
    args = causal_inputs(2, 2 * BLOCK + 5, 6, 2, 16, seed=3, cols=2 * BLOCK + 5, fresh=True)
    assert (2 * BLOCK + 5) * 3 > 2 * QUERY_TILE
    check("interpret", args, tol=2e-5)
    check("interpret", args, tol=2e-5, splits=3)


def test_causal_form_equals_gathered_causal_attention():
    """The causal form is the prefill's gathered causal attention (models/common.py) over the pool."""
    from jeagle.models.common import AttnInputs, gathered_attention

    q, kp, vp, layer, table, kv_len, _, _, pos = causal_inputs(2, 16, 6, 2, 16, seed=9)
    ctx = 200
    want = gathered_attention(q, kp[layer, table[:, :ctx]], vp[layer, table[:, :ctx]],
                              AttnInputs(positions=pos, write_slots=pos, kv_slots=table[:, :ctx], kv_len=kv_len))
    with use(KernelSettings(backend="interpret")):
        got = paged_attention(q, kp, vp, layer, table[:, :ctx], kv_len, positions=pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_prefix_splits_choice():
    assert prefix_splits(1, 3, 2048) == 16  # auto by default
    with use(KernelSettings(paged_attention_splits=None)):
        assert prefix_splits(1, 3, 2048) == 1  # off
    with use(KernelSettings(paged_attention_splits="auto")):
        assert prefix_splits(1, 3, 2048) == 16 and prefix_splits(1, 3, 100) == 2
        # a decode-form call never below MIN_DECODE_SPLITS (batch 48 x 3 KV heads: ~1 program per SM
        # otherwise); the causal (prefill) form keeps the plain rule; never more runs than table blocks
        assert prefix_splits(48, 3, 2048) == prefix_splits(16, 3, 2048) == MIN_DECODE_SPLITS == 4
        assert prefix_splits(48, 3, 2048, causal=True) == 1 and prefix_splits(48, 3, 128) == 2
    with use(KernelSettings(paged_attention_splits=8)):
        assert prefix_splits(64, 8, 2048) == 8 and prefix_splits(1, 1, 64) == 1
    with pytest.raises(ValueError, match="a count >= 1"):
        KernelSettings(paged_attention_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_compiled_matches_reference(case):
    check("pallas", inputs(*case, seed=sum(case)), tol=2e-2)  # TF32-free fp32 dots; bf16 below


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, "auto"])
def test_compiled_bf16_smollm2_shape(splits):
    check("pallas", inputs(16, 8, 9, 3, 64, 8, seed=5, dtype=jnp.bfloat16, slots=5000, cols=2048), tol=3e-2,
          splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, "auto"])
@pytest.mark.parametrize("fresh", [False, True], ids=["after-cache", "from-zero"])
def test_compiled_causal_bf16_smollm2_shape(splits, fresh):
    t = 256 if fresh else 64
    check("pallas", causal_inputs(2, t, 9, 3, 64, seed=7, dtype=jnp.bfloat16, cols=1400 if not fresh else t,
                                  fresh=fresh), tol=3e-2, splits=splits)


@pytest.mark.parametrize("splits", [None, "auto"])
def test_lowers_for_h100(splits):
    with use(KernelSettings(backend="pallas", paged_attention_splits=splits)):
        for e in (0, 8):
            # A fresh function object: traces are cached by function, and the settings are read while tracing.
            lower_for_h100(lambda *a: paged_attention(*a), *inputs(2, 8, 9, 3, 64, e, seed=1, dtype=jnp.bfloat16))
        args = causal_inputs(1, 64, 9, 3, 64, seed=2, dtype=jnp.bfloat16)
        lower_for_h100(lambda *a: paged_attention(*a[:6], positions=a[8]), *args)


def test_switch():
    with use(KernelSettings(backend="pallas")):
        assert kernel_serves(64) and kernel_serves(128)
        assert not kernel_serves(8) and not kernel_serves(80)  # Triton tiles: power of two, >= 16
    with use(KernelSettings(backend="interpret")):
        assert kernel_serves(8)
    with use(KernelSettings(backend="reference")):
        assert not kernel_serves(64)


def test_rejects_bad_shapes():
    q, kp, vp, layer, table, kv_len, xs, xm = inputs(2, 3, 4, 2, 16, 4, seed=0)
    with pytest.raises(ValueError, match="come together"):
        paged_attention(q, kp, vp, layer, table, kv_len, xs, None)
    with pytest.raises(ValueError, match="extra_mask"):
        paged_attention(q, kp, vp, layer, table, kv_len, xs, xm[:, :2])
    with pytest.raises(ValueError, match="KV heads"):
        paged_attention(q[..., :3, :], kp, vp, layer, table, kv_len)
    with pytest.raises(ValueError, match="kv_len"):
        paged_attention(q, kp, vp, layer, table, kv_len[:1])
    pos = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="without extra keys"):
        paged_attention(q, kp, vp, layer, table, kv_len, xs, xm, positions=pos)
    with pytest.raises(ValueError, match="positions must be"):
        paged_attention(q, kp, vp, layer, table, kv_len, positions=pos[:, :2])
