"""The paged-attention kernel: interpreted on CPU and compiled with -m gpu, against its pure-jnp
reference on random pools and slot tables. Cases cover prefixes of 0, under one block, exact blocks
and several blocks; grouped and ungrouped heads; with and without extra (tree) keys; padded queries;
prefixes split into runs (KernelSettings.paged_attention_splits) and merged."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.kernels.paged_attention import (BLOCK, kernel_serves, paged_attention, paged_attention_reference,
                                            prefix_splits)
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


def check(mode, args, tol, splits=None):
    with use(KernelSettings(backend=mode, paged_attention_splits=splits)):
        got = np.asarray(paged_attention(*args), np.float32)
    want = np.asarray(paged_attention_reference(*args), np.float32)
    sees = np.asarray(args[5]) > 0  # queries with no key at all are padding (kernel: zeros)
    if args[6] is not None:
        sees = sees[:, None] | np.asarray(args[7]).any(-1)
    else:
        sees = np.broadcast_to(sees[:, None], got.shape[:2])
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


def test_prefix_splits_choice():
    assert prefix_splits(1, 3, 2048) == 16  # auto by default
    with use(KernelSettings(paged_attention_splits=None)):
        assert prefix_splits(1, 3, 2048) == 1  # off
    with use(KernelSettings(paged_attention_splits="auto")):
        assert prefix_splits(1, 3, 2048) == 16 and prefix_splits(48, 3, 2048) == 1 and prefix_splits(1, 3, 100) == 2
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


@pytest.mark.parametrize("splits", [None, "auto"])
def test_lowers_for_h100(splits):
    with use(KernelSettings(backend="pallas", paged_attention_splits=splits)):
        for e in (0, 8):
            # A fresh function object: traces are cached by function, and the settings are read while tracing.
            lower_for_h100(lambda *a: paged_attention(*a), *inputs(2, 8, 9, 3, 64, e, seed=1, dtype=jnp.bfloat16))


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
