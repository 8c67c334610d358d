"""Attention of a few new tokens per request over the paged KV pool, reading each request's own prefix
length: the decode step, the tree verify, the draft steps and (causally) prefills. A Pallas kernel
(Triton lowering), one program per (request, KV head[, query tile]); flash-decoding style online
softmax over blocks of the prefix.

Why a kernel: the pure-jnp reference gathers the prefix slots of a *static* length into a dense
[B, S, Hkv, D] copy per layer, so every executable is tied to a prefix-length bucket (five buckets for a
2,048-token context, each a separate compilation per batch bucket). The kernel loops over
`ceil(kv_len[b] / BLOCK)` blocks of request b's own row of the slot table, a trip count read on the
device: one executable serves every prefix length, and it reads only the slots that exist.

Semantics (the reference is the specification). For request b, query t (of T) and query head h:
    keys = prefix positions j < kv_len[b], slots kv_slots[b, j]           (every query sees them)
         + extra keys e < E, slots extra_slots[b, e], where extra_mask[b, t, e]
    out[b, t, h] = softmax(q·k / sqrt(D)) · v over those keys, in fp32, cast to q's dtype.
The causal form (`positions` [B, T], no extra keys): query t sees prefix position j only when also
j <= positions[b, t]. This is a prefill over the pool, its own tokens already written: after a
prefix-cache hit (the cached prefix plus the new suffix, causally) or from position 0. Its rows are cut
into tiles of QUERY_TILE (a third grid axis), and a tile stops at its last query's position.
Grouped-query: query head h reads KV head h // (Hq / Hkv). A query that sees no key gets zeros from
the kernel (the reference: a uniform average); such queries are padding whose output nobody reads.

`layer` picks the pool layer inside a layer loop: the pools stay [L, num_slots, Hkv, D] buffers that
the loop updates in place, and the kernel reads layer `layer` through pointer arithmetic (64-bit
offsets once a pool passes 4 GiB, which the Triton lowering switches to by itself).

Split prefixes (flash-decoding's split-K). One program per (request, KV head) is 3 programs at batch 1
for SmolLM2 (3 KV heads) on a GPU with 132 SMs. With `KernelSettings.paged_attention_splits` = `auto`
or a count (`JEAGLE_PAGED_ATTENTION_SPLITS` through `KernelSettings.from_env`) a fourth grid axis
splits each prefix into that many contiguous runs of blocks, sized on the device from the request's
own length; each program writes its unnormalised (max, sum, accumulator) and the wrapper merges them
(one small XLA fusion). `auto`, the default since it measured faster on the H100 (a batch-1 SmolLM2
round 15% faster, an 8B one 4%; bench/HISTORY.md, 2026-11-25), splits while requests x KV heads x query
tiles stay under TARGET_PROGRAMS, and a decode-form call into at least MIN_DECODE_SPLITS runs (batch
16 and 48 faster, 2026-11-26); None (= 1) is the single-pass kernel.

Layers, as in JAX's own Pallas ops: `_kernel`, `_pallas` (wrapper: queries regrouped per KV head and
padded to Triton's power-of-two tiles; the merge of split prefixes), `paged_attention` (public:
validates, asks the backend switch) and `paged_attention_reference`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import backend
from jeagle.kernels.settings import current

__all__ = ["paged_attention", "paged_attention_reference", "dense_attention", "kernel_serves", "prefix_splits"]

BLOCK = 64  # prefix positions per loop iteration
_NEG = -1e30  # finite "minus infinity": exp(_NEG - _NEG) stays defined in the online softmax
MAX_SPLITS = 16
QUERY_TILE = 64  # query rows (token x group) per program in the causal (prefill) form
TARGET_PROGRAMS = 128  # `auto`: split until (requests x KV heads x splits) reaches about this many programs
# `auto`'s least split of a decode-form call (steps, verifies, draft steps): with one program per (request,
# KV head) at batch 48 (144 programs, ~1 per SM) the verify's attention waited on its loads; 4 runs took
# a SmolLM2 (5,4,8) round at batch 48 from 2.44 to 2.30 ms of device time, at 16 from 1.80 to 1.73, a
# batch-48 target step from 1.36 to 1.24 (8 runs: 2.42 / 1.74; bench/HISTORY.md, 2026-11-26).
MIN_DECODE_SPLITS = 4


def prefix_splits(b: int, hkv: int, s_cols: int, *, causal: bool = False) -> int:
    """How many runs each prefix is split into (static: part of the executable), from the current
    settings' `paged_attention_splits`: None (no split), `auto`, or a count; never more than the
    table's blocks. `auto` gives the decode form (not `causal`) at least MIN_DECODE_SPLITS."""
    choice = current().paged_attention_splits
    most = max(1, math.ceil(s_cols / BLOCK))
    if choice is None:
        return 1
    if choice == "auto":
        n = TARGET_PROGRAMS // max(1, b * hkv)
        return max(1, min(MAX_SPLITS, n if causal else max(n, MIN_DECODE_SPLITS), most))
    return min(choice, most)


def kernel_serves(head_dim: int) -> bool:
    """Whether `paged_attention` runs the kernel (pallas or interpret) for this head size. The compiled
    kernel needs a power-of-two head_dim >= 16 (Triton tiles; tl.dot's minimum); interpret runs any."""
    mode = backend()
    if mode == "reference":
        return False
    return mode == "interpret" or (head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def dense_attention(q, k_ctx, v_ctx, visible):
    """q [B,T,Hq,D]; k_ctx/v_ctx [B,S,Hkv,D] already gathered; visible [B,T,S] bool → [B,T,Hq,D].

    Grouped-query attention without repeating K/V (q viewed as [B,T,Hkv,G,D]); scores and softmax in
    fp32. The math every jnp attention path shares (this reference and the prefill's causal one).
    """
    b, t, hq, d = q.shape
    hkv = k_ctx.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_ctx, preferred_element_type=jnp.float32) * (1.0 / np.sqrt(d))
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    # A fully masked row (a padded query) would be NaN after softmax; give it a harmless uniform row.
    scores = jnp.where(jnp.any(visible, axis=-1)[:, None, None, :, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, hq, d)


def paged_attention_reference(q, k_pool, v_pool, layer, kv_slots, kv_len, extra_slots=None, extra_mask=None,
                              positions=None):
    """q [B,T,Hq,D]; k_pool/v_pool [L,num_slots,Hkv,D]; layer int32 scalar; kv_slots [B,S] (S >= every
    kv_len); kv_len [B]; extra_slots [B,E] and extra_mask [B,T,E] bool, or both None; positions [B,T]
    int32 or None (the causal form: query t also needs j <= positions[b, t]). → [B,T,Hq,D]."""
    b, t = q.shape[:2]
    s = kv_slots.shape[1]
    j = jnp.arange(s)
    visible = jnp.broadcast_to((j[None, :] < kv_len[:, None])[:, None, :], (b, t, s))
    if positions is not None:
        visible = visible & (j[None, None, :] <= positions[:, :, None])
    slots = kv_slots
    if extra_slots is not None:
        slots = jnp.concatenate([kv_slots, extra_slots], 1)
        visible = jnp.concatenate([visible, extra_mask], 2)
    return dense_attention(q, k_pool[layer, slots], v_pool[layer, slots], visible)


def _kernel(layer_ref, len_ref, q_ref, tbl_ref, k_ref, v_ref, *rest, s_cols, has_extra, causal, scale, splits):
    rest = list(rest)
    xslot_ref, xmask_ref = (rest.pop(0), rest.pop(0)) if has_extra else (None, None)
    qpos_ref = rest.pop(0) if causal else None
    out_refs = rest
    b, h = pl.program_id(0), pl.program_id(1)
    layer, n = layer_ref[0], len_ref[b]
    q = q_ref[0, 0, :, :]  # [QT, D]: a tile of the queries of KV head h, row = t * G + g
    tg = q.shape[0]
    col = jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
    if causal:  # row r sees key j <= qpos[r]; the tile needs no block past its last query's position
        qpos = qpos_ref[0, :]  # [QT] int32, -1 for padded rows
        n = jnp.minimum(n, jnp.max(qpos) + 1)

    def scores_of(slots, valid):
        k = k_ref[layer, slots, h, :]  # [BLOCK, D] gathered rows of this layer's pool
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        return jnp.where(valid, s, _NEG)

    def update(carry, s, valid, slots):
        m, l, acc = carry
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        v = v_ref[layer, slots, h, :]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    def block(i, carry):
        j = i * BLOCK + col
        ok = j < n
        slots = jnp.where(ok, tbl_ref[b, jnp.minimum(j, s_cols - 1)], 0)  # scratch slot past the prefix
        if causal:
            valid = ok[None, :] & (j[None, :] <= qpos[:, None])
        else:
            valid = jnp.broadcast_to(ok[None, :], (tg, BLOCK))
        return update(carry, scores_of(slots, valid), valid, slots)

    d = q.shape[1]
    # Loop carries start as traced values (the Triton lowering needs typed loop-carried values).
    zero = jnp.zeros((tg,), jnp.float32) + (n * 0).astype(jnp.float32)
    carry = (zero + _NEG, zero, jnp.zeros((tg, d), jnp.float32) + zero[:, None])
    blocks = (n + BLOCK - 1) // BLOCK
    if splits == 1:
        first, last, owner = 0, blocks, True
    else:  # this program's contiguous run of the request's own blocks (empty past its end)
        part = pl.program_id(3)
        run = (blocks + splits - 1) // splits
        first = jnp.minimum(part * run, blocks)
        last = jnp.minimum(first + run, blocks)
        owner = part == 0  # the extra (tree) keys are merged in once, by the first run
    carry = jax.lax.fori_loop(first, last, block, carry)
    if has_extra:
        slots = xslot_ref[0, :]
        visible = (xmask_ref[0, :, :] != 0) & owner  # [QT, Ep]
        k = k_ref[layer, slots, h, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        carry = update(carry, jnp.where(visible, s, _NEG), visible, slots)
    m, l, acc = carry
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[0, 0, :, :] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        m_ref, l_ref, acc_ref = out_refs
        m_ref[0, 0, 0, :] = m
        l_ref[0, 0, 0, :] = l
        acc_ref[0, 0, 0, :, :] = acc


def _pallas(q, k_pool, v_pool, layer, kv_slots, kv_len, extra_slots, extra_mask, positions, *, interpret):
    b, t, hq, d = q.shape
    hkv = k_pool.shape[2]
    g = hq // hkv
    tg = t * g
    causal = positions is not None
    if causal:  # query tiles of QUERY_TILE rows (a prefill's thousands of rows do not fit one tile)
        qt = min(QUERY_TILE, max(16, pl.next_power_of_2(tg)))
        tgp = -(-tg // qt) * qt
    else:  # the decode form: every query of a KV head in one tile
        tgp = qt = max(16, pl.next_power_of_2(tg))
    tiles = tgp // qt
    splits = prefix_splits(b * tiles, hkv, kv_slots.shape[1], causal=causal)
    # [B, T, Hkv, G, D] → [B, Hkv, T·G, D]: one program's queries are contiguous rows of one tile.
    qh = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, tg, d)
    qh = jnp.pad(qh, ((0, 0), (0, 0), (0, tgp - tg), (0, 0)))
    has_extra = extra_slots is not None
    inputs = [jnp.reshape(layer, (1,)).astype(jnp.int32), kv_len, qh, kv_slots, k_pool, v_pool]
    specs = [pl.no_block_spec, pl.no_block_spec, pl.BlockSpec((1, 1, qt, d), lambda i, j, c, *_: (i, j, c, 0)),
             pl.no_block_spec, pl.no_block_spec, pl.no_block_spec]
    if has_extra:
        e = extra_slots.shape[1]
        ep = max(16, pl.next_power_of_2(e))
        # Padded extra keys point at the scratch slot and are never visible; the mask repeats per group.
        inputs.append(jnp.pad(extra_slots, ((0, 0), (0, ep - e))))
        mask = jnp.repeat(extra_mask.astype(jnp.int8), g, axis=1)  # [B, T·G, E], row = t * G + g
        inputs.append(jnp.pad(mask, ((0, 0), (0, tgp - tg), (0, ep - e))))
        specs += [pl.BlockSpec((1, ep), lambda i, j, c, *_: (i, 0)),
                  pl.BlockSpec((1, qt, ep), lambda i, j, c, *_: (i, c, 0))]
    if causal:  # each row's position; padded rows -1 (they see nothing)
        qpos = jnp.repeat(positions.astype(jnp.int32), g, axis=1)  # [B, T·G], row = t * G + g
        inputs.append(jnp.pad(qpos, ((0, 0), (0, tgp - tg)), constant_values=-1))
        specs.append(pl.BlockSpec((1, qt), lambda i, j, c, *_: (i, c)))
    if splits == 1:
        grid = (b, hkv, tiles)
        out_specs = pl.BlockSpec((1, 1, qt, d), lambda i, j, c: (i, j, c, 0))
        out_shape = jax.ShapeDtypeStruct((b, hkv, tgp, d), q.dtype)
    else:  # per run: the running max, the sum of exponentials and the unnormalised accumulator, fp32
        grid = (b, hkv, tiles, splits)
        out_specs = [pl.BlockSpec((1, 1, 1, qt), lambda i, j, c, r: (i, j, r, c)),
                     pl.BlockSpec((1, 1, 1, qt), lambda i, j, c, r: (i, j, r, c)),
                     pl.BlockSpec((1, 1, 1, qt, d), lambda i, j, c, r: (i, j, r, c, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, hkv, splits, tgp), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, splits, tgp), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, splits, tgp, d), jnp.float32)]
    out = pl.pallas_call(
        functools.partial(_kernel, s_cols=kv_slots.shape[1], has_extra=has_extra, causal=causal,
                          scale=1.0 / float(np.sqrt(d)), splits=splits),
        grid=grid,
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_attention",
    )(*inputs)
    if splits > 1:  # merge the runs: rescale each to the common max, sum, normalise
        m, l, acc = out
        w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # runs with no key: l = acc = 0, any weight
        total = jnp.sum(w * l, axis=2)
        out = (jnp.sum(w[..., None] * acc, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]).astype(q.dtype)
    out = out[:, :, :tg].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)


def check_pools(q, k_pool, v_pool) -> tuple[int, int, int, int]:
    """q's (B, T, Hq, D) after refusing queries and pools that do not fit each other (ValueError)."""
    if q.ndim != 4 or k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"q must be [B,T,Hq,D] and the pools equal [L,slots,Hkv,D], got {q.shape}, {k_pool.shape}, "
                         f"{v_pool.shape}")
    b, t, hq, d = q.shape
    if k_pool.shape[3] != d or hq % k_pool.shape[2]:
        raise ValueError(f"head_dim {d} / heads {hq} do not match the pool's {k_pool.shape[2]} KV heads of "
                         f"{k_pool.shape[3]}")
    return b, t, hq, d


def paged_attention(q, k_pool, v_pool, layer, kv_slots, kv_len, extra_slots=None, extra_mask=None, positions=None):
    """See paged_attention_reference; the kernel when `kernel_serves(head_dim)`, else the reference.
    Either the decode form (extra keys, or none) or the causal form (`positions`), not both."""
    b, t, hq, d = check_pools(q, k_pool, v_pool)
    if kv_slots.ndim != 2 or kv_slots.shape[0] != b or kv_len.shape != (b,):
        raise ValueError(f"kv_slots must be [B={b}, S] and kv_len [B], got {kv_slots.shape}, {kv_len.shape}")
    if (extra_slots is None) != (extra_mask is None):
        raise ValueError("extra_slots and extra_mask come together")
    if extra_slots is not None and (extra_slots.ndim != 2 or extra_slots.shape[0] != b
                                    or extra_mask.shape != (b, t, extra_slots.shape[1])):
        raise ValueError(f"extra_slots must be [B={b}, E] and extra_mask [B, T={t}, E], got {extra_slots.shape}, "
                         f"{extra_mask.shape}")
    if positions is not None and (extra_slots is not None or positions.shape != (b, t)):
        raise ValueError(f"positions must be [B={b}, T={t}] and come without extra keys, got {positions.shape}")
    kv_slots, kv_len = kv_slots.astype(jnp.int32), kv_len.astype(jnp.int32)
    if positions is not None:
        positions = positions.astype(jnp.int32)
    if extra_slots is not None:
        extra_slots, extra_mask = extra_slots.astype(jnp.int32), extra_mask.astype(jnp.bool_)
    layer = jnp.asarray(layer, jnp.int32)
    if not kernel_serves(d):
        return paged_attention_reference(q, k_pool, v_pool, layer, kv_slots, kv_len, extra_slots, extra_mask,
                                         positions)
    return _pallas(q, k_pool, v_pool, layer, kv_slots, kv_len, extra_slots, extra_mask, positions,
                   interpret=backend() == "interpret")
