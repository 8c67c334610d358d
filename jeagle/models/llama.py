"""The target model: Llama 2/3/3.1, SmolLM2, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm), in Flax NNX.

Weights are stacked over layers ([L, ...]) so the layer loop compiles once (`lax.fori_loop`, the
default) or unrolls (`unroll=True`, slower to compile, faster for large models whose per-layer
weight slices a loop does not read in place; see shared/GPU.md). q/k/v and gate/up are fused into one
matmul each: a small model is bound by kernel launches, not by FLOPs.

The module is split once (`nnx.split`) and its state passed to plain `jax.jit` functions that merge it
at trace time only: no graph traversal per call. The KV pools are explicit arguments and results, so
callers can donate them.

Parameter layout (matmul weights are [in, out]; embeddings [vocab, hidden]):
    embed       [V, H]            lm_head [V, H] (absent when tied)
    attn_norm   [L, H]            mlp_norm [L, H]            final_norm [H]
    wqkv        [L, H, (Hq+2Hkv)D] bqkv [L, (Hq+2Hkv)D]  (qkv_bias)
    q_norm      [L, D]            k_norm  [L, D]           (qk_norm)
    wo          [L, Hq D, H]      bo      [L, H]           (o_bias)
    w_gate_up   [L, H, 2I]        w_down  [L, I, H]
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jeagle.config import ModelConfig
from jeagle.kernels.linear import linear_invariant
from jeagle.kernels.settings import current
from jeagle.models import deterministic
from jeagle.models.common import (AttnInputs, LayerWeights, abstract_module, attention_sublayer, fp32_logits,
                                   mlp_sublayer, random_module, rms_norm, rope_cos_sin, run_layers_with_aux)
from jeagle.parallel.sharding import embed_rows

# The per-layer weights, in the order a layer uses them.
LAYER_PARAMS = ("attn_norm", "wqkv", "bqkv", "q_norm", "k_norm", "wo", "bo", "mlp_norm", "w_gate_up", "w_down")


@jax.tree_util.register_dataclass
@dataclass
class ForwardOut:
    logits: jax.Array  # [B, V] at logits_index, or [B, T, V]; fp32
    hidden: jax.Array  # [B, T, H] final post-norm hidden state
    aux_hidden: jax.Array | None  # [B, T, len(aux_layers) * H] residual stream entering each aux layer
    k: jax.Array  # [L, num_slots, Hkv, D] updated pool
    v: jax.Array


class Llama(nnx.Module):
    # Tensor-parallel shards the fused q|k|v and gate|up columns are laid out for (jeagle/parallel/sharding.py).
    tp_groups: int = 1
    vocab_split: bool = False  # embed / lm_head split by vocabulary rows on the mesh

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        L, H, I, V, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
        qkv = cfg.q_size + 2 * cfg.kv_size
        dt = jnp.dtype(cfg.dtype)
        normal = nnx.initializers.normal(0.02)

        def w(*shape):
            return nnx.Param(normal(rngs.params(), shape, dt))

        def ones(*shape):
            return nnx.Param(jnp.ones(shape, dt))

        def zeros(*shape):
            return nnx.Param(jnp.zeros(shape, dt))

        self.embed = w(V, H)
        self.lm_head = None if cfg.tie_word_embeddings else w(V, H)
        self.final_norm = ones(H)
        self.attn_norm = ones(L, H)
        self.wqkv = w(L, H, qkv)
        self.bqkv = zeros(L, qkv) if cfg.qkv_bias else None
        self.q_norm = ones(L, D) if cfg.qk_norm else None
        self.k_norm = ones(L, D) if cfg.qk_norm else None
        self.wo = w(L, cfg.q_size, H)
        self.bo = zeros(L, H) if cfg.o_bias else None
        self.mlp_norm = ones(L, H)
        self.w_gate_up = w(L, H, 2 * I)
        self.w_down = w(L, I, H)

    # ------------------------------------------------------------------------------------------
    def _layer(self, i, h, k_pool, v_pool, w, cos, sin, attn: AttnInputs):
        """One decoder layer. `i` is a Python int (unrolled) or a traced index (loop)."""
        cfg = self.cfg
        wi = LayerWeights(w, i, invariant=current().deterministic)
        o, k_pool, v_pool = attention_sublayer(rms_norm(h, wi["attn_norm"], cfg.rms_norm_eps), wi, i, k_pool,
                                               v_pool, cos, sin, attn, cfg, self.tp_groups)
        h = h + o
        h = h + mlp_sublayer(rms_norm(h, wi["mlp_norm"], cfg.rms_norm_eps), wi, self.tp_groups)
        return h, k_pool, v_pool

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        attn: AttnInputs,
        k_pool: jax.Array,
        v_pool: jax.Array,
        *,
        logits_index: jax.Array | None = None,  # [B] index into T; None = logits for every token
        aux_layers: tuple[int, ...] = (),
        unroll: bool | int = False,  # True: every layer inline; k >= 2: k layers per loop iteration
    ) -> ForwardOut:
        cfg = self.cfg
        w = {name: (getattr(self, name)[...] if getattr(self, name) is not None else None) for name in LAYER_PARAMS}
        deterministic_kernels = current().deterministic and deterministic.kernels_serve(self)
        if current().deterministic and not deterministic_kernels:  # batch-invariant jnp (models/deterministic.py)
            return ForwardOut(*deterministic.forward(self, w, tokens, attn, k_pool, v_pool, logits_index=logits_index,
                                                     aux_layers=aux_layers, unroll=unroll))
        embed = self.embed[...]
        h = embed_rows(embed, tokens, self.vocab_split)
        cos, sin = rope_cos_sin(attn.positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

        (h, k_pool, v_pool), aux_hidden = run_layers_with_aux(
            lambda i, carry: self._layer(i, *carry, w, cos, sin, attn), cfg.num_layers, aux_layers,
            (h, k_pool, v_pool), unroll)

        hidden = rms_norm(h, self.final_norm[...], cfg.rms_norm_eps)
        head = embed if self.lm_head is None else self.lm_head[...]
        x = hidden if logits_index is None else hidden[jnp.arange(hidden.shape[0]), logits_index]
        if deterministic_kernels:
            logits = linear_invariant(x.reshape(-1, x.shape[-1]), head, transposed=True, out_dtype=jnp.float32)
            logits = logits.reshape(*x.shape[:-1], -1)
        else:
            logits = fp32_logits(x, head)
        return ForwardOut(logits=logits, hidden=hidden, aux_hidden=aux_hidden, k=k_pool, v=v_pool)


def abstract_model(cfg: ModelConfig) -> Llama:
    return abstract_module(Llama, cfg)


def random_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    return random_module(Llama, cfg, seed)
