"""The target's forward in deterministic mode (`--deterministic`, `KernelSettings.deterministic`):
every token's logits are the same bits whatever else is in the call — how many rows, how many tokens
per row (a prefill, a one-token decode step, a tree verify), where its keys sit in the pool.

Why the default forward is not: a matmul's reduction order depends on its M (cuBLAS and XLA pick
other algorithms, split-K or tiles for M = 1, 8 or 128), so the one-token decode step and the tree
verify over N tokens round a token's activations differently in bf16, and greedy EAGLE parts from
greedy target-only at near ties. SGLang's `--enable-deterministic-inference` fixes this with
batch-invariant Triton kernels (fixed tiles, no split-K) and fixed attention splits. jeagle has two
forms of the same idea:

- **On its kernels** (a kernel backend: `pallas` on a GPU, `interpret`; `kernels_serve` below): the
  model's ordinary forward with every product through `linear_invariant` (fixed 64-row tiles, K splits
  added in a fixed order) and attention through `ordered_attention` (each query's keys walked by
  position in fixed blocks, one program per query and KV head). What stays in XLA between them (RMSNorm,
  RoPE, SwiGLU, residual adds) works row by row.
- **In plain jnp** (`forward` below: the reference backend, CPUs by default), so it runs on every backend:
  - *Per-token work in fixed tiles.* Everything between the attentions (RMSNorm, q|k|v, RoPE, the output
    projection, the MLP, the residual adds, the final norm and the lm_head) runs through `tiled`: the
    call's tokens, flattened and padded to a multiple of `TILE`, go through the same computation `TILE`
    tokens at a time, one tile after another, and no op in it mixes rows, so a token's result depends
    only on the token. (On a GPU these executables also compile with cuBLAS for every matmul and no
    autotuning: `runtime.executables.compiler_options`.)
  - *Attention in position order, in fixed blocks.* Each query gathers its keys by *position*
    (0..p: the prefix from the slot table, then — in a tree verify — its ancestors' tree slots at the
    positions they would have in target-only decoding) and runs an online softmax over blocks of
    `KV_BLOCK` positions, `TILE` queries at a time. A block past a query's position is masked entirely
    and leaves (max, sum, accumulator) bit-for-bit unchanged (x·1 + 0), so the number of blocks a call
    loops over does not matter; a partly visible block holds the same keys at the same offsets in every
    form. Scores and sums are explicit products and reductions of fixed shapes (no batched dots).

The cost (measured on the GPU in bench/RESULTS.md): the kernels' fixed tiles re-read a layer's weights
once per 64 rows and walk each query's keys alone; the jnp tiles also re-read the weights per tile and
gather the keys instead of reading them in place. The draft head keeps the fast path: its numbers never
reach the output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jeagle.kernels.backend import backend
from jeagle.kernels.linear import invariant_tiles
from jeagle.kernels.ordered_attention import ordered_attention_serves
from jeagle.models.common import (AttnInputs, attention_output, mlp_sublayer, qkv_rope, rms_norm, rope_cos_sin,
                                   run_layers_with_aux, write_kv)

TILE = 64  # tokens per tile of the per-token work, and queries per attention tile
KV_BLOCK = 64  # key positions per online-softmax step


UNROLL_TILES = 8  # up to this many tiles run as straight-line code; more go through a lax.map loop


def kernels_serve(model) -> bool:
    """Whether deterministic mode runs on its kernels here (`linear_invariant` for every product,
    `ordered_attention`): a kernel backend (pallas, interpret), one device, and shapes the kernels tile. Else
    `forward` below, in plain jnp (the reference backend: CPUs by default)."""
    cfg = model.cfg
    if backend() == "reference" or model.tp_groups != 1 or model.vocab_split:
        return False
    if not ordered_attention_serves(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads):
        return False
    i, h = cfg.intermediate_size, cfg.hidden_size
    shapes = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h), (h, 2 * i), (i, h), (h, cfg.vocab_size)]
    return all(invariant_tiles(k, n) is not None for k, n in shapes)


def tiled(fn, *xs):
    """fn over `TILE`-row tiles of arrays whose leading dimension is the call's tokens (M): padded to a
    multiple of `TILE` with zeros, each tile through fn, unpadded. fn takes and returns tiles.

    A few tiles (decode steps, rounds, short prefills) run one after another as straight-line code: a
    loop would cost a host round trip per iteration on a GPU (XLA reads a while loop's predicate
    back). Many (long prefills) go through `lax.map`. Either way every tile is the same computation."""
    m = xs[0].shape[0]
    n = max(1, math.ceil(m / TILE))

    def split(x):
        x = jnp.pad(x, [(0, n * TILE - m)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(n, TILE, *x.shape[1:])

    # The barriers keep XLA from seeing through the padding: it would sink a pad below a matmul (or a
    # slice above one) and run that matmul at the unpadded M, which is what the tiles are there to avoid.
    def one(t):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(t)))

    tiles = tuple(split(x) for x in xs)
    if n <= UNROLL_TILES:
        # Each tile waits on the one before (its inputs pass a barrier with that tile's outputs): XLA may merge
        # the products of independent tiles on the same weight (its dot merger) into one of 2·TILE rows, another
        # GEMM algorithm with other bits. The suspected cause of greedy EAGLE parting from target-only at batch
        # 16, whose verify is two tiles, and not at 8, whose verify is one (bench/HISTORY.md 2026-12-07).
        outs = []
        for i in range(n):
            inputs = tuple(x[i] for x in tiles)
            if outs:
                inputs, _ = jax.lax.optimization_barrier((inputs, outs[-1]))
            outs.append(one(inputs))
        out = jax.tree.map(lambda *ys: jnp.stack(ys), *outs)
    else:
        out = jax.lax.map(one, tiles)
    return jax.tree.map(lambda y: y.reshape(n * TILE, *y.shape[2:])[:m], out)


def key_positions(attn: AttnInputs, t: int):
    """Each query's keys in position order: (slots [B, T, P], visible [B, T, P]) with P a multiple of
    KV_BLOCK. Forms: the gathered prefill (keys j <= position, j < kv_len, or attn.mask) and the paged
    decode / tree verify, whose extra keys are the call's own tokens (extra e at positions[b, e])."""
    b = attn.positions.shape[0]
    s = attn.kv_slots.shape[1]
    if attn.extra_slots is None:
        p = KV_BLOCK * max(1, math.ceil(s / KV_BLOCK))
        j = jnp.arange(p, dtype=jnp.int32)
        slots = jnp.pad(attn.kv_slots, ((0, 0), (0, p - s)))
        if attn.mask is not None:
            visible = jnp.pad(attn.mask, ((0, 0), (0, 0), (0, p - s)))
        else:
            visible = (j[None, None, :] <= attn.positions[:, :, None]) & (j[None, None, :] < attn.kv_len[:, None, None])
        return jnp.broadcast_to(slots[:, None, :], (b, t, p)), visible
    e = attn.extra_slots.shape[1]
    if e != t:
        raise ValueError(f"deterministic attention: the extra keys must be the call's own {t} tokens, got {e}")
    p = KV_BLOCK * max(1, math.ceil((s + e) / KV_BLOCK))
    j = jnp.arange(p, dtype=jnp.int32)
    in_prefix = j[None, :] < attn.kv_len[:, None]  # [B, P]
    prefix_slots = jnp.pad(attn.kv_slots, ((0, 0), (0, p - s)))
    # Extra key e, seen by query t when extra_mask[b, t, e], sits at position positions[b, e].
    hit = attn.extra_mask[:, :, :, None] & (attn.positions[:, None, :, None] == j[None, None, None, :])  # [B,T,E,P]
    extra_slot = jnp.sum(jnp.where(hit, attn.extra_slots[:, None, :, None], 0), axis=2)
    slots = jnp.where(in_prefix[:, None, :], prefix_slots[:, None, :], extra_slot)
    visible = in_prefix[:, None, :] | jnp.any(hit, axis=2)
    return slots, visible


def attend(q, slots, visible, k_pool, v_pool, layer, cfg):
    """Attention of queries q [M, Hq, D] over their keys (slots, visible [M, P]) in the pools' layer
    `layer`, `TILE` queries at a time, in blocks of KV_BLOCK positions; fp32, cast to q's dtype."""
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    nblocks = slots.shape[1] // KV_BLOCK
    scale = 1.0 / math.sqrt(d)

    def one_tile(qt, st, vt):
        qf = qt.astype(jnp.float32).reshape(TILE, hkv, g, d) * scale

        def block(i, carry):
            m, l, acc = carry
            sl = jax.lax.dynamic_slice_in_dim(st, i * KV_BLOCK, KV_BLOCK, axis=1)  # [TILE, KB]
            ok = jax.lax.dynamic_slice_in_dim(vt, i * KV_BLOCK, KV_BLOCK, axis=1)
            k = k_pool[layer, sl].astype(jnp.float32)  # [TILE, KB, Hkv, D]
            v = v_pool[layer, sl].astype(jnp.float32)
            s = jnp.sum(qf[:, None] * k[:, :, :, None, :], axis=-1)  # [TILE, KB, Hkv, G]
            s = jnp.where(ok[:, :, None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(jnp.where(m_new == -jnp.inf, 0.0, m - m_new))
            p = jnp.where(ok[:, :, None, None], jnp.exp(s - m_new[:, None]), 0.0)
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[..., None] + jnp.sum(p[..., None] * v[:, :, :, None, :], axis=1)
            return m_new, l, acc

        init = (jnp.full((TILE, hkv, g), -jnp.inf, jnp.float32), jnp.zeros((TILE, hkv, g), jnp.float32),
                jnp.zeros((TILE, hkv, g, d), jnp.float32))
        # Every block of the call, unrolled: a block past all of the tile's queries changes nothing
        # (skipping it would need a while loop, which costs more on a GPU than the block).
        _, l, acc = jax.lax.fori_loop(0, nblocks, block, init, unroll=True)
        out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return out.reshape(TILE, hkv * g, d).astype(qt.dtype)

    return tiled(one_tile, q, slots, visible)


def forward(model, w: dict, tokens, attn: AttnInputs, k_pool, v_pool, *, logits_index, aux_layers, unroll):
    """`Llama.__call__` in deterministic mode: the same inputs (`w`: the stacked layer weights by name)
    and the fields of its `ForwardOut` as a tuple (logits, hidden, aux_hidden, k, v)."""
    cfg = model.cfg
    if model.tp_groups != 1:
        raise ValueError("deterministic mode runs on one device (tp 1)")
    b, t = tokens.shape
    embed = model.embed[...]
    h = embed[tokens.reshape(-1)]  # [M, H]
    pos = attn.positions.reshape(-1)
    slots, visible = key_positions(attn, t)
    slots, visible = slots.reshape(b * t, -1), visible.reshape(b * t, -1)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [M, D/2]
    write = attn.write_slots.reshape(1, -1)

    def layer(i, carry):
        h, kp, vp = carry
        wi = {name: (a[i] if a is not None else None) for name, a in w.items()}

        def pre(ht, ct, st):
            x = rms_norm(ht, wi["attn_norm"], cfg.rms_norm_eps)
            q, k, v = qkv_rope(x[None], wi, ct[None], st[None], cfg)
            return q[0], k[0], v[0]

        q, k, v = tiled(pre, h, cos, sin)
        kp = write_kv(kp, i, write, k[None])
        vp = write_kv(vp, i, write, v[None])
        o = attend(q, slots, visible, kp, vp, i, cfg)

        def post(ht, ot):
            ht = ht + attention_output(ot[None], wi, cfg)[0]
            return ht + mlp_sublayer(rms_norm(ht, wi["mlp_norm"], cfg.rms_norm_eps)[None], wi)[0]

        return tiled(post, h, o), kp, vp

    (h, k_pool, v_pool), aux_hidden = run_layers_with_aux(layer, cfg.num_layers, aux_layers, (h, k_pool, v_pool),
                                                          unroll)
    if aux_hidden is not None:
        aux_hidden = aux_hidden.reshape(b, t, -1)

    final_norm = model.final_norm[...]
    hidden = tiled(lambda ht: rms_norm(ht, final_norm, cfg.rms_norm_eps), h)
    head = embed if model.lm_head is None else model.lm_head[...]
    x = hidden if logits_index is None else hidden.reshape(b, t, -1)[jnp.arange(b), logits_index]
    logits = tiled(lambda xt: jnp.einsum("th,vh->tv", xt, head, preferred_element_type=jnp.float32), x)
    if logits_index is None:
        logits = logits.reshape(b, t, -1)
    return logits, hidden.reshape(b, t, -1), aux_hidden, k_pool, v_pool
