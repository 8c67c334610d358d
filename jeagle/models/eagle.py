"""EAGLE draft heads in Flax NNX: EAGLE-1/2 and EAGLE-3, over their own KV pool in the shared slot layout.

EAGLE-1/2 (`Eagle1`), one or more decoder layers:
    h = fc(concat(embed(token), feature))           2H → H, bias unless the config says "bias": false
    layer 0 has no input_layernorm (identity); later layers have one; no final norm
    logits = lm_head_target(h)                       the target's head, no norm
EAGLE-3 (`Eagle3`), one "midlayer":
    h = fc(aux)  if the feature is the target's low|mid|high states (3·Ht wide), else the recycled h
    x = concat(input_layernorm(embed(token)), hidden_norm(h))       2H wide into q/k/v
    h = h + attn(x);  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head_draft(norm(h))  over draft_vocab_size; target id = draft id + d2t[draft id]
Both return the pre-norm h, which EAGLE recycles as the next step's feature. The token embedding
(and for EAGLE-1 the lm_head) are the target's and are passed in, never copied.

Parameter layout (matmul weights [in, out]; layers stacked on the first axis, unrolled at run time:
heads have one or a few layers):
    fc_w [F, H]  fc_b [H]          F = 2H (EAGLE-1) or 3·Ht (EAGLE-3)
    attn_norm [Ld-1, H]            EAGLE-1 layers 1.. (absent for a single layer)
    input_norm [H] hidden_norm [H] final_norm [H] lm_head [Vd, H] d2t [Vd]   (EAGLE-3)
    wqkv [Ld, Din, (Hq+2Hkv)D] bqkv [Ld, ...] wo [Ld, Hq D, H] mlp_norm [Ld, H] w_gate_up [Ld, H, 2I] w_down [Ld, I, H]
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jeagle.config import DraftConfig
from jeagle.models.common import (AttnInputs, LayerWeights, abstract_module, attention_sublayer, head_logits,
                                   mlp_sublayer, random_module, rms_norm, rope_cos_sin)
from jeagle.parallel.sharding import embed_rows


class Buffer(nnx.Variable):
    """A non-trainable array saved with the parameters (EAGLE-3's d2t)."""


@jax.tree_util.register_dataclass
@dataclass
class DraftOut:
    hidden: jax.Array  # [B, T, H] pre-norm output, recycled as the next feature
    logits: jax.Array  # [B, V] at logits_index or [B, T, V]; fp32; draft vocab for EAGLE-3
    k: jax.Array  # [Ld, num_slots, Hkv, D]
    v: jax.Array


LAYER_PARAMS = ("wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


class EagleHead(nnx.Module):
    # Tensor-parallel shards of the fused q|k|v and gate|up columns (jeagle/parallel/sharding.py, tp_draft="shard").
    tp_groups: int = 1

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        H, I, Ld = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
        dt = jnp.dtype(cfg.dtype)
        normal = nnx.initializers.normal(0.02)
        qkv = cfg.q_size + 2 * cfg.kv_size

        def w(*shape):
            return nnx.Param(normal(rngs.params(), shape, dt))

        def ones(*shape):
            return nnx.Param(jnp.ones(shape, dt))

        def zeros(*shape):
            return nnx.Param(jnp.zeros(shape, dt))

        eagle3 = cfg.kind == "eagle3"
        self.fc_w = w(3 * cfg.target_hidden_size if eagle3 else 2 * H, H)
        self.fc_b = zeros(H) if cfg.fc_bias else None
        self.attn_norm = ones(Ld - 1, H) if (not eagle3 and Ld > 1) else None
        self.input_norm = ones(H) if eagle3 else None
        self.hidden_norm = ones(H) if eagle3 else None
        self.final_norm = ones(H) if eagle3 else None
        self.lm_head = w(cfg.draft_vocab_size, H) if eagle3 else None
        self.d2t = Buffer(jnp.zeros((cfg.draft_vocab_size,), jnp.int32)) if eagle3 else None
        self.wqkv = w(Ld, 2 * H if eagle3 else H, qkv)
        self.bqkv = zeros(Ld, qkv) if cfg.qkv_bias else None
        self.wo = w(Ld, cfg.q_size, H)
        self.mlp_norm = ones(Ld, H)
        self.w_gate_up = w(Ld, H, 2 * I)
        self.w_down = w(Ld, I, H)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T]
        feature: jax.Array,  # [B, T, F]: target features, or the recycled draft hidden [B, T, H]
        attn: AttnInputs,
        k_pool: jax.Array,
        v_pool: jax.Array,
        *,
        embed: jax.Array,  # [V, H] the target's embedding
        embed_split: bool = False,  # the target's embedding is split by vocabulary rows on the mesh
        lm_head: jax.Array | None = None,  # [V, H] the target's head (EAGLE-1)
        logits_index: jax.Array | None = None,
    ) -> DraftOut:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        e = embed_rows(embed, tokens, embed_split).astype(cfg.dtype)
        feature = feature.astype(cfg.dtype)
        cos, sin = rope_cos_sin(attn.positions, cfg.head_dim, cfg.rope_theta, None)

        def fc(x):
            y = x @ self.fc_w[...]
            return y + self.fc_b[...] if self.fc_b is not None else y

        if cfg.kind == "eagle1":
            h = fc(jnp.concatenate([e, feature], axis=-1))
        else:
            h = fc(feature) if feature.shape[-1] != cfg.hidden_size else feature

        stacked = {name: (getattr(self, name)[...] if getattr(self, name) is not None else None)
                   for name in LAYER_PARAMS}
        for j in range(cfg.num_layers):
            wi = LayerWeights(stacked, j)
            if cfg.kind == "eagle3":
                x = jnp.concatenate([rms_norm(e, self.input_norm[...], eps), rms_norm(h, self.hidden_norm[...], eps)], -1)
            else:
                x = h if j == 0 else rms_norm(h, self.attn_norm[j - 1], eps)
            o, k_pool, v_pool = attention_sublayer(x, wi, j, k_pool, v_pool, cos, sin, attn, cfg, self.tp_groups)
            h = h + o
            h = h + mlp_sublayer(rms_norm(h, wi["mlp_norm"], eps), wi, self.tp_groups)

        if cfg.kind == "eagle3":
            x, head = rms_norm(h, self.final_norm[...], eps), self.lm_head[...]
        else:
            if lm_head is None:
                raise ValueError("an EAGLE-1 head needs the target's lm_head")
            x, head = h, lm_head
        if logits_index is not None:
            x = x[jnp.arange(x.shape[0]), logits_index]
        logits = head_logits(x, head)
        return DraftOut(hidden=h, logits=logits, k=k_pool, v=v_pool)

    def draft_to_target(self, draft_ids: jax.Array) -> jax.Array:
        """Target token ids of draft-vocabulary ids (identity for EAGLE-1)."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[...][draft_ids]


def abstract_draft(cfg: DraftConfig) -> EagleHead:
    return abstract_module(EagleHead, cfg)


def random_draft(cfg: DraftConfig, seed: int = 0) -> EagleHead:
    return random_module(EagleHead, cfg, seed)
