"""Deterministic mode's kernels, `linear_invariant` and `ordered_attention`: interpreted on CPU and compiled
with -m gpu. Each is checked against its reference (fp32-close) and for its own property: a row's (a query's)
result is the same bits whatever else is in the call — how many rows, which form (prefill, decode step,
tree verify), where its keys sit in the pool. Sizes cross the kernels' tiles (64 rows, 64-position blocks)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.kernels.linear import ROW_TILE, linear_invariant, linear_reference
from jeagle.kernels.ordered_attention import BLOCK, ordered_attention
from jeagle.kernels.paged_attention import paged_attention_reference
from jeagle.kernels.settings import KernelSettings, use
from tests.kernels.lowering import lower_for_h100


def rows_of(mode, x, w, layer, rows, **kw):
    with use(KernelSettings(backend=mode, deterministic=True)):
        f = jax.jit(lambda x, w, l: linear_invariant(x, w, l, **kw))
        return np.asarray(f(x[rows], w, layer).astype(jnp.float32))


# (K, N): three K splits with five column blocks; four K splits at SmolLM2's q|k|v width.
@pytest.mark.parametrize("k,n", [(96, 160), (576, 960)])
def test_interpreted_linear_rows_do_not_depend_on_the_call(k, n):
    rng = np.random.default_rng(k + n)
    m = 2 * ROW_TILE + 5
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, k, n)) * 0.05, jnp.bfloat16)
    layer = jnp.int32(1)
    full = rows_of("interpret", x, w, layer, slice(None))
    for rows in (slice(3, 4), slice(0, 16), slice(60, 70), slice(ROW_TILE, m)):
        np.testing.assert_array_equal(full[rows], rows_of("interpret", x, w, layer, rows))
    want = np.asarray(linear_reference(x, w, 1).astype(jnp.float32))
    np.testing.assert_allclose(full, want, atol=3e-2, rtol=3e-2)


def test_interpreted_transposed_head_rows_do_not_depend_on_the_call():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((70, 64)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((512, 64)), jnp.float32)  # [V, H]
    kw = dict(transposed=True, out_dtype=jnp.float32)
    full = rows_of("interpret", x, head, None, slice(None), **kw)
    np.testing.assert_array_equal(full[65:66], rows_of("interpret", x, head, None, slice(65, 66), **kw))
    np.testing.assert_allclose(full, np.asarray(x @ head.T), atol=1e-4, rtol=1e-4)


def test_linear_invariant_refuses_mismatched_operands():
    with pytest.raises(ValueError, match="same K"):
        linear_invariant(jnp.zeros((2, 8)), jnp.zeros((1, 16, 16)), 0)
    with pytest.raises(ValueError, match="needs its layer"):
        linear_invariant(jnp.zeros((2, 16)), jnp.zeros((1, 16, 16)))


def pools(seed, hkv, d, dtype, layers=2, slots=600):
    rng = np.random.default_rng(seed)
    kp = jnp.asarray(rng.standard_normal((layers, slots, hkv, d)), dtype)
    vp = jnp.asarray(rng.standard_normal((layers, slots, hkv, d)), dtype)
    return kp, vp


def attend(mode, *args):
    with use(KernelSettings(backend=mode, deterministic=True)):
        return np.asarray(jax.jit(ordered_attention)(*args).astype(jnp.float32))


def forms(length, hq, hkv, d, seed, dtype):
    """The same sequence of `length` tokens (query vectors and K/V in the pool at a shuffled slot table)
    asked for in three forms: a causal prefill of all of it; a decode step of its last token (prefix
    length - 1, its own slot as the extra key) beside two other requests; and a tree verify whose chain of
    the last 4 tokens sits at tree slots with two decoy siblings, beside another request."""
    rng = np.random.default_rng(seed)
    kp, vp = pools(seed, hkv, d, dtype)
    q_seq = jnp.asarray(rng.standard_normal((length, hq, d)), dtype)
    table = rng.permutation(np.arange(1, 400))[:length].astype(np.int32)
    layer = jnp.int32(1)
    cols = 320
    tbl = np.zeros((1, cols), np.int32)
    tbl[0, :length] = table
    pos = jnp.arange(length, dtype=jnp.int32)[None]
    prefill = (q_seq[None], kp, vp, layer, jnp.asarray(tbl), jnp.asarray([length], jnp.int32), pos)

    # Decode: row 1 is ours (prefix = all but the last, which is the extra key at its own slot).
    dtbl = np.asarray(rng.integers(1, 400, size=(3, cols)), np.int32)
    dtbl[1] = tbl[0]
    dq = jnp.asarray(rng.standard_normal((3, 1, hq, d)), dtype).at[1, 0].set(q_seq[-1])
    dlen = jnp.asarray([5, length - 1, 130], jnp.int32)
    dpos = dlen[:, None]
    dslots = jnp.asarray(dtbl[np.arange(3), np.asarray(dlen)][:, None])
    decode = (dq, kp, vp, layer, jnp.asarray(dtbl), dlen, dpos, dslots, jnp.ones((3, 1, 1), bool))

    # Verify: row 0 is ours. Tree nodes 0..5: the chain root(=token L)..L+3 at nodes 0, 2, 3, 5; decoys 1, 4.
    n_tree, root = 6, length - 4
    vtbl = np.asarray(rng.integers(1, 400, size=(2, cols)), np.int32)
    vtbl[0, :root] = table[:root]
    chain_nodes = [0, 2, 3, 5]
    node_slot = np.asarray(rng.integers(400, 600, size=(2, n_tree)), np.int32)
    node_slot[0, chain_nodes] = table[root:]
    depth = np.asarray([0, 1, 1, 2, 2, 3])
    mask = np.zeros((2, n_tree, n_tree), bool)
    parents = {0: None, 1: 0, 2: 0, 3: 2, 4: 2, 5: 3}  # each node one deeper than its parent
    for node in range(n_tree):
        a = node
        while a is not None:
            mask[:, node, a] = True
            a = parents[a]
    vq = jnp.asarray(rng.standard_normal((2, n_tree, hq, d)), dtype)
    vq = vq.at[0, jnp.asarray(chain_nodes)].set(q_seq[root:])
    vlen = jnp.asarray([root, 77], jnp.int32)
    vpos = vlen[:, None] + jnp.asarray(depth)[None]
    verify = (vq, kp, vp, layer, jnp.asarray(vtbl), vlen, vpos, jnp.asarray(node_slot), jnp.asarray(mask))
    return prefill, decode, verify, chain_nodes


# Lengths: a block's edge inside the tree, several blocks; SmolLM2's grouping (3 per KV head).
@pytest.mark.parametrize("length,hq,hkv,d", [(67, 9, 3, 32), (200, 4, 1, 16)])
def test_interpreted_attention_is_the_same_in_every_form(length, hq, hkv, d):
    prefill, decode, verify, chain = forms(length, hq, hkv, d, seed=length, dtype=jnp.bfloat16)
    p = attend("interpret", *prefill)[0]
    dec = attend("interpret", *decode)[1, 0]
    ver = attend("interpret", *verify)[0]
    np.testing.assert_array_equal(p[-1], dec)
    np.testing.assert_array_equal(p[-4:], ver[chain])
    # And each form is the attention its reference computes.
    for args, causal in ((prefill, True), (decode, False), (verify, False)):
        want = paged_attention_reference(*args[:6], *(args[7:] if not causal else (None, None, args[6])))
        np.testing.assert_allclose(attend("interpret", *args), np.asarray(want.astype(jnp.float32)), atol=3e-2,
                                   rtol=3e-2)


def test_ordered_attention_refuses_extra_keys_that_are_not_the_calls_tokens():
    kp, vp = pools(0, 2, 16, jnp.float32)
    q = jnp.zeros((1, 2, 4, 16))
    with pytest.raises(ValueError, match="call's own tokens"):
        ordered_attention(q, kp, vp, 0, jnp.zeros((1, 8), jnp.int32), jnp.asarray([3]), jnp.zeros((1, 2), jnp.int32),
                          jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 2, 3), bool))


def test_lowers_for_h100():
    with use(KernelSettings(backend="pallas", deterministic=True)):
        for m, k, n in [(1, 576, 960), (128, 576, 576), (130, 1536, 576)]:
            x = jnp.zeros((m, k), jnp.bfloat16)
            w = jnp.zeros((3, k, n), jnp.bfloat16)
            lower_for_h100(lambda x, w: linear_invariant(x, w, jnp.int32(1)), x, w)
        lower_for_h100(lambda x, w: linear_invariant(x, w, transposed=True, out_dtype=jnp.float32),
                       jnp.zeros((16, 576), jnp.bfloat16), jnp.zeros((49152, 576), jnp.bfloat16))
        prefill, decode, verify, _ = forms(67, 9, 3, 64, seed=1, dtype=jnp.bfloat16)
        for args in (prefill, decode, verify):
            lower_for_h100(ordered_attention, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("length,hq,hkv,d", [(67, 9, 3, 64), (300, 32, 8, 128)])
def test_compiled_attention_is_the_same_in_every_form(length, hq, hkv, d):
    prefill, decode, verify, chain = forms(length, hq, hkv, d, seed=length, dtype=jnp.bfloat16)
    p = attend("pallas", *prefill)[0]
    np.testing.assert_array_equal(p[-1], attend("pallas", *decode)[1, 0])
    np.testing.assert_array_equal(p[-4:], attend("pallas", *verify)[0][chain])
    want = paged_attention_reference(*prefill[:6], None, None, prefill[6])
    np.testing.assert_allclose(p, np.asarray(want.astype(jnp.float32))[0], atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(576, 960), (576, 3072), (1536, 576), (4096, 6144), (576, 49152)])
def test_compiled_linear_rows_do_not_depend_on_the_call(k, n):
    rng = np.random.default_rng(k + n)
    m = 3 * ROW_TILE + 7
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, k, n)) * 0.05, jnp.bfloat16)
    full = rows_of("pallas", x, w, jnp.int32(0), slice(None))
    for rows in (slice(0, 1), slice(5, 21), slice(ROW_TILE - 3, 2 * ROW_TILE + 1)):
        np.testing.assert_array_equal(full[rows], rows_of("pallas", x, w, jnp.int32(0), rows))
    want = np.asarray(linear_reference(x, w, 0).astype(jnp.float32))
    np.testing.assert_allclose(full, want, atol=5e-2, rtol=5e-2)


# RMSNorm, which XLA owns between the kernels: in deterministic mode its mean square is `fixed_order_sum`'s
# elementwise adds, not an XLA reduction (whose GPU emitter tiles a row by the call's whole shape).


def norm_rows(x, rows):
    from jeagle.models.common import rms_norm

    from jeagle.runtime.executables import compiler_options

    w = jnp.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype)
    ks = KernelSettings(deterministic=True)
    with use(ks):  # compiled as the engine's deterministic executables are
        lowered = jax.jit(lambda x: rms_norm(x, w, 1e-5)).lower(x[rows])
    exe = lowered.compile(compiler_options(ks, cublas_only=True) or None)
    return np.asarray(exe(x[rows]).astype(jnp.float32))


def test_deterministic_rms_norm_sums_without_an_xla_reduction():
    from jeagle.models.common import fixed_order_sum, rms_norm

    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 576)), jnp.float32)
    w = jnp.ones((576,), jnp.float32)
    with use(KernelSettings(deterministic=True)):
        jaxpr = str(jax.make_jaxpr(lambda x: rms_norm(x, w, 1e-5))(x))
    assert "reduce_sum" not in jaxpr and "reduce_precision" not in jaxpr
    with use(KernelSettings()):
        assert "reduce_sum" in str(jax.make_jaxpr(lambda x: rms_norm(x, w, 1e-5))(x))  # the default keeps XLA's
    for n in (1, 7, 64, 576, 1000):
        y = np.random.default_rng(n).standard_normal((3, n)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(fixed_order_sum(jnp.asarray(y)))[:, 0], y.sum(-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(norm_rows(x, slice(None)), np.asarray(x / np.sqrt((np.asarray(x) ** 2).mean(-1,
                               keepdims=True) + 1e-5) * np.linspace(0.5, 1.5, 576)), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_compiled_rms_norm_rows_do_not_depend_on_the_call():
    for h in (576, 4096):
        x = jnp.asarray(np.random.default_rng(h).standard_normal((3 * ROW_TILE + 7, h)) * 3, jnp.bfloat16)
        full = norm_rows(x, slice(None))
        for rows in (slice(0, 1), slice(0, 16), slice(5, 53), slice(0, 2 * ROW_TILE)):
            np.testing.assert_array_equal(full[rows], norm_rows(x, rows))
