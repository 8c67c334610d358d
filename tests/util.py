"""Test helpers: a one-shot forward of a ragged batch through the paged cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jeagle.runtime.kv_cache import init_cache
from jeagle.models.common import AttnInputs


def ragged_forward(model, prompts: list[list[int]], *, slot_order: np.ndarray | None = None, unroll=False,
                   aux_layers=()):
    """Logits [B, T, V] (fp32 numpy) of every position of each prompt, batched with padding.

    Slots are contiguous (1, 2, ...) or, with `slot_order`, a permutation of them: attention reads
    keys through the slot table, so the layout must not change the result.
    """
    cfg = model.cfg
    b, t = len(prompts), max(len(p) for p in prompts)
    tokens = np.zeros((b, t), np.int32)
    lengths = np.array([len(p) for p in prompts], np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    slots = np.arange(1, b * t + 1, dtype=np.int32)
    if slot_order is not None:
        slots = slots[slot_order]
    slots = slots.reshape(b, t)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    valid = pos < lengths[:, None]
    cache = init_cache(cfg, num_slots=b * t + 1, max_reqs=b, max_ctx=t)
    attn = AttnInputs(positions=jnp.asarray(pos), write_slots=jnp.asarray(np.where(valid, slots, 0)),
                      kv_slots=jnp.asarray(slots), kv_len=jnp.asarray(lengths))
    out = model(jnp.asarray(tokens), attn, cache.k, cache.v, unroll=unroll, aux_layers=aux_layers)
    return np.asarray(out.logits), out


def max_rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / np.abs(np.asarray(b)).max())


class DraftRunner:
    """Feeds chunks of (tokens, features) through a draft head over its own slot pool, positions
    continuing across calls — the paged-cache counterpart of a PyTorch past_key_values loop."""

    def __init__(self, head, target, max_len: int = 64):
        self.head, self.target, self.max_len = head, target, max_len
        cfg = head.cfg
        shape = (cfg.num_layers, max_len + 1, cfg.num_kv_heads, cfg.head_dim)
        # A shuffled slot order: the draft reads its keys through the table like the target.
        self.slots = np.random.default_rng(0).permutation(np.arange(1, max_len + 1)).astype(np.int32)
        self.k = jnp.zeros(shape, cfg.dtype)
        self.v = jnp.zeros(shape, cfg.dtype)
        self.pos = 0

    def step(self, feature: np.ndarray, tokens: np.ndarray):
        t = tokens.shape[1]
        pos = np.arange(self.pos, self.pos + t, dtype=np.int32)[None]
        attn = AttnInputs(positions=jnp.asarray(pos), write_slots=jnp.asarray(self.slots[pos]),
                          kv_slots=jnp.asarray(self.slots[None]), kv_len=jnp.asarray([self.pos + t], jnp.int32))
        lm_head = None
        if self.head.cfg.kind == "eagle1":
            lm_head = self.target.embed[...] if self.target.lm_head is None else self.target.lm_head[...]
        out = self.head(jnp.asarray(tokens, jnp.int32), jnp.asarray(feature), attn, self.k, self.v,
                        embed=self.target.embed[...], lm_head=lm_head)
        self.k, self.v, self.pos = out.k, out.v, self.pos + t
        return np.asarray(out.hidden), np.asarray(out.logits)


def last_logits(model, seq: list[int], width: int = 128) -> np.ndarray:
    """The logits [V] after `seq` (a teacher-forced forward), the batch padded to `width` positions by
    a second row so that every length shares one compiled forward (references that decode by hand
    call this once per token)."""
    if len(seq) > width:
        width = len(seq)
    logits, _ = ragged_forward(model, [list(seq), [4] * width])
    return logits[0, len(seq) - 1]


def kv_idle(engine) -> tuple[int, list[int]]:
    """(slots free or held only by the prefix cache, the free request rows), after checking that every
    slot is owned once and no cached prefix is still in use: what an idle engine must be back to."""
    engine.check_kv()
    cache = engine.kv.cache
    if cache is not None:
        assert cache.locked_slots == 0, "an idle engine's cached prefixes are still locked"
    return engine.pool.free_slots + (cache.cached_slots if cache is not None else 0), engine.pool.free_row_ids()
