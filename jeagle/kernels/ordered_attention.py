"""Attention whose every query is computed the same way whatever else is in the call: deterministic
mode's attention (`--deterministic`, jeagle/models/deterministic.py) on a GPU.

A query's output must be the same bits in a prefill, a one-token decode step and a tree verify, at any
batch. `paged_attention` cannot promise that: it walks the prefix in blocks that start at the prefix's
end and then the extra (tree) keys, so the same token's keys fall into other blocks in a decode step
(prefix = everything before it) than in a verify (prefix = everything before the tree root); it splits
prefixes by a count that depends on the batch; and it puts all of a request's queries in one tile.
This kernel walks each query's keys **by position**, in blocks of BLOCK positions starting at 0,
one program per (query token, KV head), whatever the form:

    position j < kv_len[b]        slot kv_slots[b, j]                     (the pool's prefix)
    position j >= kv_len[b]       slot extra_slots[b, e] for the extra key e the query sees
                                  (extra_mask[b, t, e]) that sits at j (positions[b, e] == j)
    visible                       j <= positions[b, t]

(the causal form: no extra keys, kv_len the prefix plus the call's own tokens, already in the pool).
A tree node at depth d of a verify thus sees its ancestors at the positions target-only decoding gives
them, in the same blocks, through the same [16, D] x [D, BLOCK] products and the same online-softmax
updates; positions past the query's are never visited. The heads of one KV head are the rows of the
query tile, padded to 16 (Triton's smallest dot), so the tile's shape is one constant.

Semantics (the reference is the specification): `paged_attention_reference`'s, fp32-close. Bit-identical
across forms is this kernel's own property (tests/kernels/test_ordered_attention.py); the reference backend
gets deterministic mode's jnp attention instead (models/deterministic.py).

Cost: no split of long prefixes (a split's merge would have to be the same in every form), so at batch 1
only Hkv programs walk the prefix; a verify re-reads the prefix once per tree node (from L2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import backend
from jeagle.kernels.paged_attention import check_pools, paged_attention_reference

__all__ = ["ordered_attention", "ordered_attention_serves", "BLOCK"]

BLOCK = 64  # key positions per online-softmax step
_NEG = -1e30  # finite "minus infinity", as in paged_attention
GROUP_TILE = 16  # the query heads of one KV head, padded: Triton's smallest dot


def ordered_attention_serves(head_dim: int, group: int) -> bool:
    """Whether `ordered_attention` runs the kernel for this head size and heads per KV head: the compiled
    kernel needs a power-of-two head_dim >= 16 and at most GROUP_TILE query heads per KV head."""
    mode = backend()
    if mode == "reference" or group > GROUP_TILE:
        return False
    return mode == "interpret" or (head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def _kernel(layer_ref, len_ref, qpos_ref, q_ref, tbl_ref, k_ref, v_ref, *rest, t, s_cols, has_extra, scale):
    if has_extra:
        xslot_ref, xpos_ref, xmask_ref, o_ref = rest
    else:
        (o_ref,) = rest
    r, h = pl.program_id(0), pl.program_id(1)
    b = r // t
    layer, n, p = layer_ref[0], len_ref[b], qpos_ref[r]
    q = q_ref[0, 0, :, :]  # [GROUP_TILE, D]
    col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    if has_extra:
        xslot = xslot_ref[0, :]  # [Ep] the call's tokens' slots
        xpos = xpos_ref[0, :]  # [Ep] and positions
        xsee = xmask_ref[0, :] != 0  # [Ep] which of them this query sees

    def block(i, carry):
        m, l, acc = carry
        j = i * BLOCK + col
        in_prefix = j < n
        slots = jnp.where(in_prefix, tbl_ref[b, jnp.minimum(j, s_cols - 1)], 0)
        visible = in_prefix & (j <= p)
        if has_extra:  # position j past the prefix: the extra key at j that this query sees, if any
            hit = xsee[:, None] & (xpos[:, None] == j[None, :])  # [Ep, BLOCK]
            slots = jnp.where(in_prefix, slots, jnp.sum(jnp.where(hit, xslot[:, None], 0), axis=0))
            visible = visible | ((jnp.max(hit.astype(jnp.int32), axis=0) > 0) & (j <= p))
        k = k_ref[layer, slots, h, :]  # [BLOCK, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible[None, :], s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        pr = jnp.where(visible[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        v = v_ref[layer, slots, h, :]
        pv = jax.lax.dot_general(pr.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(pr, axis=1), acc * alpha[:, None] + pv

    d = q.shape[1]
    zero = jnp.zeros((GROUP_TILE,), jnp.float32) + (n * 0).astype(jnp.float32)  # typed loop carries
    carry = (zero + _NEG, zero, jnp.zeros((GROUP_TILE, d), jnp.float32) + zero[:, None])
    # Blocks 0 .. the query's own: the trip count is the query's, never the call's (p >= -1 for padding).
    _, l, acc = jax.lax.fori_loop(0, (p + BLOCK) // BLOCK, block, carry)
    o_ref[0, 0, :, :] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def _pallas(q, k_pool, v_pool, layer, kv_slots, kv_len, positions, extra_slots, extra_mask, *, interpret):
    b, t, hq, d = q.shape
    hkv = k_pool.shape[2]
    g = hq // hkv
    # [B, T, Hkv, G, D] -> [B·T, Hkv, GROUP_TILE, D]: one program's query heads are the rows of its tile.
    qh = jnp.pad(q.reshape(b * t, hkv, g, d), ((0, 0), (0, 0), (0, GROUP_TILE - g), (0, 0)))
    qpos = positions.reshape(b * t).astype(jnp.int32)
    has_extra = extra_slots is not None
    inputs = [jnp.reshape(layer, (1,)).astype(jnp.int32), kv_len, qpos, qh, kv_slots, k_pool, v_pool]
    specs = [pl.no_block_spec, pl.no_block_spec, pl.no_block_spec,
             pl.BlockSpec((1, 1, GROUP_TILE, d), lambda i, j: (i, j, 0, 0)),
             pl.no_block_spec, pl.no_block_spec, pl.no_block_spec]
    if has_extra:
        e = extra_slots.shape[1]
        ep = max(16, pl.next_power_of_2(e))
        # Padded extra keys: the scratch slot at position -1, never seen.
        inputs += [jnp.pad(extra_slots, ((0, 0), (0, ep - e))),
                   jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, ep - e)), constant_values=-1),
                   jnp.pad(extra_mask.astype(jnp.int8).reshape(b * t, e), ((0, 0), (0, ep - e)))]
        specs += [pl.BlockSpec((1, ep), lambda i, j: (i // t, 0)), pl.BlockSpec((1, ep), lambda i, j: (i // t, 0)),
                  pl.BlockSpec((1, ep), lambda i, j: (i, 0))]
    out = pl.pallas_call(
        functools.partial(_kernel, t=t, s_cols=kv_slots.shape[1], has_extra=has_extra,
                          scale=1.0 / float(np.sqrt(d))),
        grid=(b * t, hkv),
        in_specs=specs,
        out_specs=pl.BlockSpec((1, 1, GROUP_TILE, d), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b * t, hkv, GROUP_TILE, d), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ordered_attention",
    )(*inputs)
    return out[:, :, :g].reshape(b, t, hq, d)


def ordered_attention(q, k_pool, v_pool, layer, kv_slots, kv_len, positions, extra_slots=None, extra_mask=None):
    """q [B,T,Hq,D] at positions [B,T]; k_pool/v_pool [L,slots,Hkv,D]; layer int32 scalar; kv_slots [B,S];
    kv_len [B]; extra_slots [B,T] and extra_mask [B,T,T] (the call's own tokens as extra keys: decode steps,
    tree verifies) or both None (the causal form). → [B,T,Hq,D]; see the module docstring. The kernel where
    `ordered_attention_serves`, else `paged_attention_reference`."""
    b, t, hq, d = check_pools(q, k_pool, v_pool)
    if kv_slots.ndim != 2 or kv_slots.shape[0] != b or kv_len.shape != (b,) or positions.shape != (b, t):
        raise ValueError(f"kv_slots must be [B={b}, S], kv_len [B] and positions [B, T={t}], got {kv_slots.shape}, "
                         f"{kv_len.shape}, {positions.shape}")
    if (extra_slots is None) != (extra_mask is None):
        raise ValueError("extra_slots and extra_mask come together")
    if extra_slots is not None and (extra_slots.shape != (b, t) or extra_mask.shape != (b, t, t)):
        raise ValueError(f"the extra keys must be the call's own tokens: extra_slots [B={b}, T={t}] and extra_mask "
                         f"[B, T, T], got {extra_slots.shape}, {extra_mask.shape}")
    kv_slots, kv_len, positions = kv_slots.astype(jnp.int32), kv_len.astype(jnp.int32), positions.astype(jnp.int32)
    if extra_slots is not None:
        extra_slots, extra_mask = extra_slots.astype(jnp.int32), extra_mask.astype(jnp.bool_)
    layer = jnp.asarray(layer, jnp.int32)
    if not ordered_attention_serves(d, hq // k_pool.shape[2]):
        return paged_attention_reference(q, k_pool, v_pool, layer, kv_slots, kv_len, extra_slots, extra_mask,
                                         None if extra_slots is not None else positions)
    return _pallas(q, k_pool, v_pool, layer, kv_slots, kv_len, positions, extra_slots, extra_mask,
                   interpret=backend() == "interpret")
