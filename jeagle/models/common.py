"""Pieces every model shares: RMSNorm, rotary embeddings, paged attention over the slot pool.

Precision: weights and the residual stream are in the model dtype (bf16 by default); RMSNorm
statistics, RoPE angles, attention scores and softmax are fp32, as in Hugging Face's Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jeagle.config import RopeScaling, rope_inv_freq


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in fp32, cast back to the input dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


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
    """

    positions: jax.Array
    write_slots: jax.Array
    kv_slots: jax.Array
    kv_len: jax.Array


def paged_attention_reference(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, attn: AttnInputs) -> jax.Array:
    """q [B,T,Hq,D]; k_ctx/v_ctx [B,S,Hkv,D] gathered from the pool; returns [B,T,Hq,D].

    Grouped-query attention without repeating K/V: q is viewed as [B,T,Hkv,G,D].
    """
    b, t, hq, d = q.shape
    hkv = k_ctx.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_ctx, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(d))
    j = jnp.arange(k_ctx.shape[1], dtype=jnp.int32)
    visible = (j[None, None, :] <= attn.positions[:, :, None]) & (j[None, None, :] < attn.kv_len[:, None, None])
    scores = jnp.where(visible[:, None, None, :, :], scores, -jnp.inf)
    # A fully masked row (a padded query) would be NaN after softmax; give it a harmless uniform row.
    scores = jnp.where(jnp.any(visible, axis=-1)[:, None, None, :, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(b, t, hq, d)
