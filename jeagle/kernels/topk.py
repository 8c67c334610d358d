"""The draft's top-K: softmax probabilities and indices of the K largest logits of each row, in one pass.

`softmax_topk(logits [R, V], k)` = `jax.lax.top_k(jax.nn.softmax(logits in fp32), k)`: (p [R, k] fp32,
indices [R, k] int32), the largest first, ties to the lower index (as `jax.lax.top_k`).

Why a kernel: every draft step of a round (and the draft extend) takes the top K of the draft's
softmax over its vocabulary. XLA writes the whole softmax ([R, V] fp32: a max, a sum and a divide
fusion) and then calls its TopK custom kernel, which costs ~20 us a call at any batch (37 us at 48,
R = 192): on the H100 a (5,4,8) round spent 101 / 102 / 185 us in the TopK calls alone at batch
1 / 16 / 48, plus 50 us of the divide at 48 (bench/HISTORY.md, 2026-11-26). Here one program per row
reads its logits once into registers, takes the softmax's max and sum, and picks the top k by k
argmax passes (one combined value-and-lowest-index reduction each) over order-preserving int32 keys
of the logits, a taken entry's key set below every other; only the k winners' probabilities are
computed: 4.2 / 6.9 us a call at 4 / 192 rows of 8,192 entries against XLA's 15.6 / 31.2. Rows of
up to MAX_VOCAB (16,384) entries: the shipped head's 8,192-token draft vocabulary and wider EAGLE-3
heads' (12,288 tokens fill a 16,384-entry row); longer ones take the reference.

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

__all__ = ["softmax_topk", "softmax_topk_reference", "top_k", "MAX_K", "MAX_VOCAB"]

# Entries a row may have for the kernel (one program holds the row: 8 warps for 8,192 entries, 16 for
# 16,384 (a 12,288-token EAGLE-3 head, padded), 32 fp32 registers a thread either way). Larger
# vocabularies (32k-entry EAGLE-3 heads, EAGLE-1 heads over the target's vocabulary) take the reference:
# a chunked form with a running top-k list measured no faster than XLA's TopK (21 us a call at 4 rows of
# 32,000; bench/HISTORY.md, 2026-11-26).
MAX_VOCAB = 16384
MAX_K = 64  # k passes: the kernel is for the draft's small K; larger k takes the reference
_GONE = -(2**31)  # the key of a taken or padded entry: below every real logit's (-inf's included)


def softmax_topk_reference(logits, k: int):
    """(p [..., k] fp32, indices [..., k] int32) of softmax(logits in fp32) over the last axis."""
    p, idx = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), -1), k)
    return p, idx.astype(jnp.int32)


def _kernel(x_ref, p_ref, i_ref, *, v, k, kp):
    r = pl.program_id(0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)
    x = x_ref[r, :].astype(jnp.float32)  # the whole row (padded to a power of two) in registers
    base = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    real = base < v
    x = jnp.where(real, x, -jnp.inf)
    m = jnp.max(x)
    s = jnp.where(m == -jnp.inf, 0.0, jnp.sum(jnp.exp(x - m)))  # exp(-inf - -inf) is NaN: an all -inf row
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order = float order; -inf above _GONE
    key = jnp.where(real, jnp.maximum(key, _GONE + 1), _GONE)  # (one NaN's bits would key as _GONE)
    ti = jnp.zeros((kp,), jnp.int32) + r * 0
    for j in range(k):  # argmax: the lowest index among equal keys, one combined reduction
        a = jnp.argmax(key).astype(jnp.int32)
        ti = jnp.where(lane == j, a, ti)
        key = jnp.where(base == a, _GONE, key)
    tv = x_ref[r, ti].astype(jnp.float32)  # the winners' logits (lanes past k read entry 0)
    p_ref[0, :] = jnp.where(tv == -jnp.inf, 0.0, jnp.exp(tv - m) / jnp.where(s > 0, s, 1.0))
    i_ref[0, :] = ti


def _pallas(x, k: int, *, interpret: bool):
    r, v = x.shape
    bv = pl.next_power_of_2(v)
    if bv != v:  # a power-of-two row for Triton (the pad is never picked: see `real`)
        x = jnp.pad(x, ((0, 0), (0, bv - v)))
    kp = max(16, pl.next_power_of_2(k))
    p, idx = pl.pallas_call(
        functools.partial(_kernel, v=v, k=k, kp=kp),
        grid=(r,),
        in_specs=[pl.no_block_spec],
        out_specs=[pl.BlockSpec((1, kp), lambda i: (i, 0)), pl.BlockSpec((1, kp), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((r, kp), jnp.float32), jax.ShapeDtypeStruct((r, kp), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=16 if bv >= 16384 else 8 if bv >= 4096 else 4, num_stages=1),
        interpret=interpret,
        name="softmax_topk",
    )(x)
    return p[:, :k], idx[:, :k]


def _applies(x, k: int) -> bool:
    """Whether the kernel takes a top-k of k over x [..., V] (else the reference's XLA ops)."""
    return not (backend() == "reference" or not current().topk or k > MAX_K or x.shape[-1] > MAX_VOCAB
                or not jnp.issubdtype(x.dtype, jnp.floating) or x.size == 0)


def top_k(x, k: int):
    """`jax.lax.top_k(x, k)` over the last axis — (values, indices int32) [..., k], the largest first,
    ties to the lower index — with the indices from the kernel where it applies (as `softmax_topk`;
    its probabilities unused) and the values gathered at them. XLA lowered the logprobs' top 20
    (jeagle/sampling/logprobs.py `top_k_blocked`) to two sorts of whole rows, [R, 384] and [R, 2,560] entries,
    in every logprobs round (the H100's round HLO, bench/HISTORY.md, 2026-11-27)."""
    if x.ndim < 1 or not 1 <= k <= x.shape[-1]:
        raise ValueError(f"k must be in [1, V] for x [..., V], got k={k}, x {x.shape}")
    if not _applies(x, k):
        vals, idx = jax.lax.top_k(x, k)
        return vals, idx.astype(jnp.int32)
    lead, v = x.shape[:-1], x.shape[-1]
    _, idx = _pallas(x.reshape(-1, v), k, interpret=backend() == "interpret")
    idx = idx.reshape(*lead, k)
    return jnp.take_along_axis(x, idx, -1), idx


def softmax_topk(logits, k: int):
    """Top-k softmax probabilities and indices over the last axis of `logits` [..., V]: the kernel on
    the pallas / interpret backends (k <= MAX_K) unless `KernelSettings.topk` is off (`JEAGLE_TOPK=0`),
    else the reference. Returns (p fp32, indices int32), each [..., k]."""
    if logits.ndim < 1 or not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k must be in [1, V] for logits [..., V], got k={k}, logits {logits.shape}")
    if not _applies(logits, k):
        return softmax_topk_reference(logits, k)
    lead, v = logits.shape[:-1], logits.shape[-1]
    p, idx = _pallas(logits.reshape(-1, v), k, interpret=backend() == "interpret")
    return p.reshape(*lead, k), idx.reshape(*lead, k)
