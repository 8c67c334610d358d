"""Pieces every model shares: RMSNorm, rotary embeddings, paged attention over the slot pool.

Precision: weights and the residual stream are in the model dtype (bf16 by default); RMSNorm
statistics, RoPE angles, attention scores and softmax are fp32, as in Hugging Face's Llama.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jeagle.config import RopeScaling, rope_inv_freq
from jeagle.kernels.linear import linear, linear_invariant, linear_serves
from jeagle.kernels.ordered_attention import ordered_attention
from jeagle.kernels.paged_attention import dense_attention, kernel_serves, paged_attention
from jeagle.kernels.settings import current
from jeagle.parallel.sharding import context_tp, over_kv_heads


class LayerWeights(Mapping):
    """One layer's view of weights stacked over layers ([L, ...] arrays, some None): `wi[name]` is that
    layer's slice (taken lazily, where used), and `project` multiplies by a stacked matrix in place
    (the `linear` kernel reads layer `layer` of the stack, so the loop copies no weight slice).
    `invariant`: every product through `linear_invariant` (deterministic mode's kernels)."""

    def __init__(self, stacked: Mapping, layer, invariant: bool = False):
        self.stacked, self.layer, self.invariant = stacked, layer, invariant

    def __getitem__(self, name):
        a = self.stacked[name]
        return None if a is None else a[self.layer]

    def __iter__(self):
        return iter(self.stacked)

    def __len__(self):
        return len(self.stacked)


def project(x: jax.Array, wi: Mapping, name: str) -> jax.Array:
    """x [..., K] @ wi[name] [K, N]. Through the skinny-matmul kernel (jeagle/kernels/linear.py) when
    `wi` is a `LayerWeights`, the rows are few enough (decode steps, rounds, draft steps), the
    settings allow it and no tensor-parallel mesh splits the weight; else XLA's dot."""
    if isinstance(wi, LayerWeights):
        w = wi.stacked[name]
        m, k, n = math.prod(x.shape[:-1]), x.shape[-1], w.shape[-1]
        if wi.invariant:
            return linear_invariant(x.reshape(m, k), w, wi.layer).reshape(*x.shape[:-1], n)
        if _linear_takes(m, k, n):
            return linear(x.reshape(m, k), w, wi.layer).reshape(*x.shape[:-1], n)
    return x @ wi[name]


def _linear_takes(m: int, k: int, n: int) -> bool:
    """Whether an [m, k] x [k, n] product of the models goes through the skinny-matmul kernel: the
    settings allow it, no tensor-parallel mesh splits the weight, and the kernel serves the shape."""
    return current().linear and context_tp() == 1 and linear_serves(m, k, n)


def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """fp32 logits x [..., H] @ head [V, H].T of an output head. Through the skinny-matmul kernel
    (transposed weight, fp32 out) when the rows are few (a draft step's B x K, the draft extend's B),
    the settings allow it and no tensor-parallel mesh is active; else XLA's dot."""
    m, h, v = math.prod(x.shape[:-1]), x.shape[-1], head.shape[0]
    if _linear_takes(m, h, v):
        return linear(x.reshape(m, h), head, transposed=True, out_dtype=jnp.float32).reshape(*x.shape[:-1], v)
    return fp32_logits(x, head.astype(x.dtype))


def fp32_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """x [..., H] @ head [V, H].T with fp32 output, through XLA's dot. On a GPU one row is padded to
    two: with XLA's Triton GEMM fusions off (the prefill and round executables, `compiler_options`), a
    one-row product of bf16 operands with fp32 output lowers to a conversion of the whole head to fp32
    and cuBLAS's fp32 gemv (2.03 ms for Llama-3-8B's 128,256 x 4,096 head on the H100, 0.33 ms for
    SmolLM2's) where two rows take a bf16 GEMM (0.63 / 0.19 ms; bench/probes/logits_dot.py, removed after
    commit `b436043`; bench/HISTORY.md, 2026-11-27). Each row's logits are the same up to fp32 rounding
    (the two products may accumulate in another order)."""
    lead, v = x.shape[:-1], head.shape[0]
    if math.prod(lead) != 1 or jax.default_backend() != "gpu":
        return jnp.einsum("...h,vh->...v", x, head, preferred_element_type=jnp.float32)
    two = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))  # the row and a zero row
    return jnp.einsum("th,vh->tv", two, head, preferred_element_type=jnp.float32)[:1].reshape(*lead, v)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in fp32, cast back to the input dtype, then scale. Deterministic mode: the
    mean square by `fixed_order_sum`, whose bits do not depend on how many rows the call has."""
    xf = x.astype(jnp.float32)
    if current().deterministic:
        # Behind a barrier: fused into the scaling below, the sum would be recomputed for every element of its row.
        ms = jax.lax.optimization_barrier(fixed_order_sum(xf * xf)) / xf.shape[-1]
    else:
        ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = xf * jax.lax.rsqrt(ms + eps)
    return weight * xf.astype(x.dtype)


def fixed_order_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (kept, size 1) as elementwise adds in one fixed order: zero-padded to a power of
    two, then halved (x[..., :h] + x[..., h:]) until one column is left. A row's sum is then the same
    scalar adds whatever the call's shape. XLA's GPU reductions are not: the emitter picks its threads per
    row, vector width and tiling (or a Triton fusion's block size) from the whole shape, so a row summed
    in a call of 1 row and of 16 rows can round differently (bench/probes/batch_rows.py)."""
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << (n - 1).bit_length()) - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None):
    """cos, sin of shape positions.shape + (head_dim/2,), fp32."""
    inv_freq = jnp.asarray(np.asarray(rope_inv_freq(head_dim, theta, scaling), np.float32))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half layout (Hugging Face): x [..., T, heads, D]; cos/sin [..., T, D/2]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass
class AttnInputs:
    """Where a forward's tokens sit in the paged cache.

    positions    [B, T] int32  absolute position of each new token (padding: any, masked by kv_len)
    write_slots  [B, T] int32  pool slot receiving each new token's K/V (padding: scratch slot 0)
    kv_slots     [B, S] int32  slots of positions 0..S-1 of each request (req_to_token row prefix)
    kv_len       [B]    int32  keys j < kv_len[b] exist; query at position p sees keys j <= p
    mask         [B, T, S] bool, optional: which keys each query sees, replacing the causal rule
                 above
    extra_slots  [B, E] int32 and extra_mask [B, T, E] bool, optional: the decode form. Every query
                 sees the whole prefix j < kv_len plus the extra keys its mask row allows (decode:
                 the token's own slot; tree verify and drafting: the tree or beam nodes, each seeing
                 its ancestors). This form goes through `jeagle/kernels/paged_attention.py`, which reads each
                 request's own prefix length, so kv_slots may be the whole slot-table row.
    """

    positions: jax.Array
    write_slots: jax.Array
    kv_slots: jax.Array
    kv_len: jax.Array
    mask: jax.Array | None = None
    extra_slots: jax.Array | None = None
    extra_mask: jax.Array | None = None


def gathered_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, attn: AttnInputs) -> jax.Array:
    """Attention over a prefix already gathered from the pool (the forms without extra keys: prefill
    and masked forwards). q [B,T,Hq,D]; k_ctx/v_ctx [B,S,Hkv,D]; returns [B,T,Hq,D]. Keys visible by
    `attn.mask`, else by the causal rule (j <= position and j < kv_len)."""
    if attn.mask is not None:
        visible = attn.mask
    else:
        j = jnp.arange(k_ctx.shape[1], dtype=jnp.int32)
        visible = (j[None, None, :] <= attn.positions[:, :, None]) & (j[None, None, :] < attn.kv_len[:, None, None])
    return dense_attention(q, k_ctx, v_ctx, visible)


def _causal_paged(q, k_pool, v_pool, layer, kv_slots, kv_len, positions):
    return paged_attention(q, k_pool, v_pool, layer, kv_slots, kv_len, positions=positions)


def write_kv(pool, layer, slots, x):
    """pool[layer, slots] = x for slots [B, T], x [B, T, Hkv, D]. Slot 0 is the scratch slot that
    padding tokens, padding rows and positions past a request's last slot point at: their writes are
    dropped (sent to distinct out-of-range indices), so every index is unique and XLA emits a plain
    scatter. Thousands of writes colliding on slot 0 serialize on the GPU: a 16 x 256 prefill spent
    1.8 s in them (bench/HISTORY.md, "prefill scatter"). Slot 0 is never written, so it stays zero."""
    n = pool.shape[1]
    flat = slots.reshape(-1)
    idx = jnp.where(flat == 0, n + jnp.arange(flat.shape[0], dtype=flat.dtype), flat).reshape(slots.shape)
    return pool.at[layer, idx].set(x.astype(pool.dtype), mode="drop", unique_indices=True)


def qkv_rope(x, wi: dict, cos, sin, cfg, groups: int = 1):
    """The attention inputs of a normalised x [B,T,Din]: q [B,T,Hq,D], k and v [B,T,Hkv,D], q and k
    rotated (and RMS-normed first when cfg.qk_norm).

    groups > 1: the fused columns are laid out per tensor-parallel shard, [q_s | k_s | v_s] for shard
    s = 0..groups-1 (jeagle/parallel/sharding.py), so a contiguous split of the columns gives every shard its
    own heads and the split below stays local to each shard."""
    b, t, _ = x.shape
    qkv = project(x, wi, "wqkv")
    if wi.get("bqkv") is not None:
        qkv = qkv + wi["bqkv"]
    qs, ks = cfg.q_size // groups, cfg.kv_size // groups
    g = qkv.reshape(b, t, groups, qs + 2 * ks)
    q = g[..., :qs].reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = g[..., qs:qs + ks].reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = g[..., qs + ks:].reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, wi["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, wi["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(o, wi: dict, cfg):
    """The output projection of attention values o [B,T,Hq,D] → [B,T,H]."""
    b, t = o.shape[:2]
    o = project(o.reshape(b, t, cfg.q_size), wi, "wo")
    if wi.get("bo") is not None:
        o = o + wi["bo"]
    return o


def attention_sublayer(x, wi: dict, layer, k_pool, v_pool, cos, sin, attn: AttnInputs, cfg, groups: int = 1):
    """Self-attention on an already-normalised input x [B,T,Din] → (output [B,T,H], k_pool, v_pool).

    `wi` holds this layer's wqkv [Din,(Hq+2Hkv)D] and optional bqkv, q_norm, k_norm, wo, bo; `layer`
    indexes the pools (a Python int or a traced index). `cfg` provides num_heads, num_kv_heads,
    head_dim, q_size, kv_size, rms_norm_eps and qk_norm (the target's or a draft's config).

    With no pools (k_pool is None) the call attends over its own tokens only, causally by index and
    up to kv_len (or by attn.mask): the dense form training and scoring use. The pools stay None.
    """
    q, k, v = qkv_rope(x, wi, cos, sin, cfg, groups)
    if k_pool is None:
        if attn.mask is not None:
            visible = attn.mask
        else:
            t = x.shape[1]
            j = jnp.arange(t, dtype=jnp.int32)
            visible = (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] < attn.kv_len[:, None, None])
        return attention_output(dense_attention(q, k, v, visible), wi, cfg), None, None
    # Write this step's K/V first so the new tokens attend to themselves through the pool.
    k_pool = write_kv(k_pool, layer, attn.write_slots, k)
    v_pool = write_kv(v_pool, layer, attn.write_slots, v)
    if isinstance(wi, LayerWeights) and wi.invariant:  # deterministic mode's target: every query the same bits in every form
        o = ordered_attention(q, k_pool, v_pool, layer, attn.kv_slots, attn.kv_len, attn.positions, attn.extra_slots,
                              attn.extra_mask)
    elif attn.extra_slots is not None:
        o = over_kv_heads(paged_attention, q, k_pool, v_pool, layer, attn.kv_slots, attn.kv_len, attn.extra_slots,
                          attn.extra_mask)  # per KV-head shard under tensor parallelism
    elif attn.mask is None and kernel_serves(q.shape[-1]) and current().prefill_attention == "paged":
        # A prefill: the kernel's causal form reads the pool through the slot table, each row to its own
        # length (no gathered copy of the context, no [T, S] score matrix).
        o = over_kv_heads(_causal_paged, q, k_pool, v_pool, layer, attn.kv_slots, attn.kv_len, attn.positions)
    else:
        o = gathered_attention(q, k_pool[layer, attn.kv_slots], v_pool[layer, attn.kv_slots], attn)
    return attention_output(o, wi, cfg), k_pool, v_pool


def mlp_sublayer(x, wi: dict, groups: int = 1):
    """SwiGLU on a normalised input: down(silu(gate) * up) with gate|up fused in w_gate_up (laid out
    [gate_s | up_s] per tensor-parallel shard when groups > 1)."""
    gu = project(x, wi, "w_gate_up")
    g = gu.reshape(*gu.shape[:-1], groups, 2, gu.shape[-1] // (2 * groups))
    gate = g[..., 0, :].reshape(*gu.shape[:-1], -1)
    up = g[..., 1, :].reshape(*gu.shape[:-1], -1)
    return project(jax.nn.silu(gate) * up, wi, "w_down")


def abstract_module(cls, cfg):
    """A module of class `cls` whose parameters are ShapeDtypeStructs (for loading without materialising)."""
    from flax import nnx

    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))


def random_module(cls, cfg, seed: int = 0):
    """A module of class `cls` with random weights, initialised on the default device in one jit."""
    from flax import nnx

    return nnx.jit(lambda: cls(cfg, rngs=nnx.Rngs(seed)))()


def run_layers_with_aux(layer, num_layers: int, aux_layers, carry, unroll):
    """The decoder layers 0..num_layers-1 over `carry` = (h, k_pool, v_pool), with `layer(i, carry)`
    one layer (`i` a Python int when unrolled, else a traced index). unroll: True (every layer
    inline), k >= 2 (k layers per `fori_loop` iteration: fewer iterations, each of which the GPU
    runtime steps from the host, bench/HISTORY.md "dispatch"), else a plain loop.

    The aux states (EAGLE-3 features) are the residual stream *entering* each layer of `aux_layers`:
    the loop runs in segments cut at those layers, so no per-layer select is needed. Returns (carry,
    aux [..., len(aux_layers) * H] in the order aux_layers lists them, or None)."""

    def run(start, stop, carry):
        if unroll is True:
            for i in range(start, stop):
                carry = layer(i, carry)
            return carry
        if stop == start:
            return carry
        k = max(1, min(int(unroll), stop - start))
        return jax.lax.fori_loop(start, stop, layer, carry, unroll=k)

    aux, start = [], 0
    for layer_id in sorted(aux_layers):
        if not 0 <= layer_id <= num_layers:
            raise ValueError(f"aux layer {layer_id} outside 0..{num_layers}")
        carry = run(start, layer_id, carry)
        aux.append(carry[0])
        start = layer_id
    carry = run(start, num_layers, carry)
    order = sorted(range(len(aux_layers)), key=lambda n: aux_layers[n])
    return carry, (jnp.concatenate([aux[order.index(n)] for n in range(len(aux_layers))], -1) if aux else None)
