"""The draft's top-K: softmax probabilities and indices of the K largest logits of each row, in one pass.

`softmax_topk(logits [R, V], k)` = `jax.lax.top_k(jax.nn.softmax(logits in fp32), k)`: (p [R, k] fp32,
indices [R, k] int32), the largest first, ties to the lower index (as `jax.lax.top_k`).

Why a kernel: every draft step of a round (and the draft extend) takes the top K of the draft's
softmax over its vocabulary. XLA writes the whole softmax ([R, V] fp32: a max, a sum and a divide
fusion) and then calls its TopK custom kernel, which costs ~20 us a call at any batch (37 us at 48,
R = 192): on the H100 a (5,4,8) round spent 101 / 102 / 185 us in the TopK calls alone at batch
1 / 16 / 48, plus 50 us of the divide at 48 (bench/HISTORY.md, session 24). Here one program per row
reads its logits once into registers, takes the softmax's max and sum, and picks the top k by k
argmax passes (one combined value-and-lowest-index reduction each) over order-preserving int32 keys
of the logits, a taken entry's key set below every other. Vocabularies over CHUNK go in chunks with
a running max, sum and top-k list (k passes of max-then-lowest-index over the chunk and the list).
Only the k winners' probabilities are computed.

Semantics (the reference is the specification): the probabilities are exp(x - max) / sum(exp(x - max))
in fp32; the sum's order differs from XLA's, so p may differ from the reference by a few ulps; the
indices equal the reference's whenever no two of the k + 1 largest logits tie (on a tie both pick the
lower index). Every index is distinct and in [0, V) also when logits are -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import backend
from jeagle.kernels.settings import current

__all__ = ["softmax_topk", "softmax_topk_reference", "MAX_K"]

CHUNK = 8192  # logits a program holds at once (8 warps: 32 fp32 registers a thread)
MAX_K = 64  # k passes per chunk: the kernel is for the draft's small K; larger k takes the reference
_BIG = 2**31 - 1  # "no index": larger than every real one
_GONE = -(2**31)  # the key of a taken or padded entry: below every real logit's (-inf's included)


def softmax_topk_reference(logits, k: int):
    """(p [..., k] fp32, indices [..., k] int32) of softmax(logits in fp32) over the last axis."""
    p, idx = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), -1), k)
    return p, idx.astype(jnp.int32)


def _kernel(x_ref, p_ref, i_ref, *, v, bv, chunks, k, kp):
    r = pl.program_id(0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)
    base = jax.lax.broadcasted_iota(jnp.int32, (bv,), 0)

    def chunk(c, carry):
        m, s, tv, ti = carry
        cols = c * bv + base
        x = x_ref[r, pl.ds(pl.multiple_of(c * bv, bv), bv)].astype(jnp.float32)  # [bv]
        real = cols < v  # the wrapper pads the row to whole chunks
        x = jnp.where(real, x, -jnp.inf)
        cm = jnp.max(x)
        m_new = jnp.maximum(m, cm)
        # exp(-inf - -inf) is NaN: a row (so far) all -inf keeps sum 0
        s = jnp.where(m_new == -jnp.inf, 0.0, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new)))
        # The top k of (this chunk) U (the running list), largest first, ties to the lower index: k passes.
        nv = jnp.full((kp,), -jnp.inf, jnp.float32)
        ni = jnp.full((kp,), _BIG, jnp.int32)
        free_x, free_t = real, ti < _BIG
        for j in range(k):
            a = jnp.max(jnp.where(free_x, x, -jnp.inf))
            ai = jnp.min(jnp.where(free_x & (x == a), cols, _BIG))
            b = jnp.max(jnp.where(free_t, tv, -jnp.inf))
            bi = jnp.min(jnp.where(free_t & (tv == b), ti, _BIG))
            take_a = (a > b) | ((a == b) & (ai < bi))
            nv = jnp.where(lane == j, jnp.where(take_a, a, b), nv)
            ni = jnp.where(lane == j, jnp.where(take_a, ai, bi), ni)
            free_x = free_x & ~(take_a & (cols == ai))
            free_t = free_t & ~(~take_a & (ti == bi))
        return m_new, s, nv, ni

    if chunks == 1:  # the whole row in registers: k argmax passes over order-preserving int32 keys
        x = x_ref[r, :].astype(jnp.float32)
        real = base < v
        x = jnp.where(real, x, -jnp.inf)
        m = jnp.max(x)
        s = jnp.where(m == -jnp.inf, 0.0, jnp.sum(jnp.exp(x - m)))
        bits = jax.lax.bitcast_convert_type(x, jnp.int32)
        key = jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order = float order; -inf above _GONE
        key = jnp.where(real, key, _GONE)
        ti = jnp.zeros((kp,), jnp.int32) + r * 0
        for j in range(k):  # argmax: the lowest index among equal keys, one combined reduction
            a = jnp.argmax(key).astype(jnp.int32)
            ti = jnp.where(lane == j, a, ti)
            key = jnp.where(base == a, _GONE, key)
        tv = x_ref[r, ti].astype(jnp.float32)  # the winners' logits (lanes past k read entry 0)
    else:
        zero = (r * 0).astype(jnp.float32)  # typed loop carries (the Triton lowering needs them traced)
        carry = (zero - jnp.inf, zero, jnp.full((kp,), -jnp.inf, jnp.float32) + zero,
                 jnp.full((kp,), _BIG, jnp.int32) + (r * 0))
        m, s, tv, ti = jax.lax.fori_loop(0, chunks, chunk, carry)
    p = jnp.where(tv == -jnp.inf, 0.0, jnp.exp(tv - m) / jnp.where(s > 0, s, 1.0))
    p_ref[0, :] = p
    i_ref[0, :] = ti


def _pallas(x, k: int, *, interpret: bool):
    r, v = x.shape
    bv = min(CHUNK, pl.next_power_of_2(v))
    chunks = -(-v // bv)
    if chunks * bv != v:  # whole chunks: every load in bounds (the pad is never picked, see `real`)
        x = jnp.pad(x, ((0, 0), (0, chunks * bv - v)))
    kp = max(16, pl.next_power_of_2(k))
    p, idx = pl.pallas_call(
        functools.partial(_kernel, v=v, bv=bv, chunks=chunks, k=k, kp=kp),
        grid=(r,),
        in_specs=[pl.no_block_spec],
        out_specs=[pl.BlockSpec((1, kp), lambda i: (i, 0)), pl.BlockSpec((1, kp), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=8 if bv >= 4096 else 4, num_stages=1),
        interpret=interpret,
        name="softmax_topk",
    )(x)
    return p[:, :k], idx[:, :k]


def softmax_topk(logits, k: int):
    """Top-k softmax probabilities and indices over the last axis of `logits` [..., V]: the kernel on
    the pallas / interpret backends (k <= MAX_K) unless `KernelSettings.topk` is off (`JEAGLE_TOPK=0`),
    else the reference. Returns (p fp32, indices int32), each [..., k]."""
    if logits.ndim < 1 or not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, V] for logits [..., V], got k={k}, logits {logits.shape}")
    if backend() == "reference" or not current().topk or k > MAX_K or not jnp.issubdtype(logits.dtype, jnp.floating):
        return softmax_topk_reference(logits, k)
    lead, v = logits.shape[:-1], logits.shape[-1]
    p, idx = _pallas(logits.reshape(-1, v), k, interpret=backend() == "interpret")
    return p.reshape(*lead, k), idx.reshape(*lead, k)
