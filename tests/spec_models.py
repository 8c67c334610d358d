"""Tiny targets and heads for speculative tests, including an oracle and an adversarial head.

The "bigram" target has every layer's attention and MLP output projections zeroed and embedding
rows of RMS 1, so its logits are lm_head(embed(token)) up to RMSNorm's epsilon: the next token is a
function of the current one. An EAGLE-1 head with fc = [±I | 0] and zeroed layers then outputs
hidden = ±embed(token), i.e. logits = ±lm_head(embed(token)): the oracle (+) proposes exactly the
target's argmax at every depth, the adversary (−) proposes the target's least likely tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jeagle.config import DraftConfig, ModelConfig
from jeagle.models.eagle import random_draft
from jeagle.models.llama import random_model


def target_config(vocab=96, hidden=32, eos=(3,)):
    return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", max_position_embeddings=512,
                       eos_token_ids=eos)


def draft_config(target: ModelConfig, kind="eagle1", draft_vocab=None):
    eagle3 = kind == "eagle3"
    return DraftConfig(kind=kind, hidden_size=target.hidden_size, intermediate_size=64, num_layers=1, num_heads=4,
                       num_kv_heads=2, head_dim=8, vocab_size=target.vocab_size, dtype="float32",
                       draft_vocab_size=(draft_vocab or target.vocab_size // 2) if eagle3 else 0,
                       target_hidden_size=target.hidden_size if eagle3 else 0,
                       aux_layer_ids=(0, 1, 1) if eagle3 else ())


def bigram_target(cfg: ModelConfig, seed=0, scale=300.0):
    model = random_model(cfg, seed)
    e = np.asarray(model.embed[...])
    model.embed[...] = jnp.asarray(e / np.sqrt((e * e).mean(-1, keepdims=True)))
    model.wo[...] = jnp.zeros_like(model.wo[...])
    model.w_down[...] = jnp.zeros_like(model.w_down[...])
    model.lm_head[...] = model.lm_head[...] * scale  # sharper next-token distributions
    return model


def signed_identity_head(target, sign: float, noise: float = 0.0, seed=0):
    """EAGLE-1 head proposing sign·target logits (+ noise on fc for partial acceptance)."""
    cfg = draft_config(target.cfg)
    head = random_draft(cfg, seed)
    h = cfg.hidden_size
    fc = np.zeros((2 * h, h), np.float32)
    fc[:h] = sign * np.eye(h)
    if noise:
        fc += noise * np.random.default_rng(seed).standard_normal(fc.shape).astype(np.float32)
    head.fc_w[...] = jnp.asarray(fc)
    head.fc_b = None
    head.wo[...] = jnp.zeros_like(head.wo[...])
    head.w_down[...] = jnp.zeros_like(head.w_down[...])
    return head
