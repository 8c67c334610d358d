"""The paged KV cache on the device, in SGLang's layout (page size 1): slot pools and `req_to_token`.

Device side (a pytree, donated through every step):
    k, v           [L, num_slots, kv_heads, head_dim]  one slot pool per layer, stacked so a layer
                   loop indexes it; slot 0 is a scratch slot that padded tokens write into and that
                   is never read unmasked.
    req_to_token   [max_reqs + 1, max_ctx] int32  slot of each position of each request row; the last
                   row is the scratch row that padded batch rows use.

The host side (which request owns which row and slots) is `jeagle.runtime.slots`: a request gets
its row and all its slots at admission and gives them back when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jeagle.config import ModelConfig
from jeagle.kernels.assign_req_to_token_pool import assign_req_to_token_pool

SCRATCH_SLOT = 0


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array  # [L, num_slots, kv_heads, head_dim]
    v: jax.Array  # [L, num_slots, kv_heads, head_dim]
    req_to_token: jax.Array  # [max_reqs + 1, max_ctx] int32

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def scratch_row(self) -> int:
        return self.req_to_token.shape[0] - 1

    @property
    def max_ctx(self) -> int:
        return self.req_to_token.shape[1]


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    return 2 * cfg.num_layers * cfg.kv_size * jnp.dtype(cfg.dtype).itemsize


def init_pools(cfg, *, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """Zeroed K and V pools [L, num_slots, kv_heads, head_dim] for a target or a draft config: a
    draft head has its own pools indexed by the same slot ids as the target's."""
    shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim)
    return jax.jit(lambda: (jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)))()


def init_cache(cfg: ModelConfig, *, num_slots: int, max_reqs: int, max_ctx: int) -> KVCache:
    """Zeroed pools of `num_slots` slots (slot 0 included) for `max_reqs` request rows."""
    k, v = init_pools(cfg, num_slots=num_slots)
    return KVCache(k=k, v=v, req_to_token=jnp.zeros((max_reqs + 1, max_ctx), jnp.int32))


def assign_rows(req_to_token, row_ids, count, flat):
    """Give rows `row_ids` their slots: clear the rows (past a request's last slot a row holds the
    scratch slot, which decode relies on), then write positions [0, count) from the flat list
    (`jeagle.runtime.slots.flat_slots`) through the `assign_req_to_token_pool` kernel. Returns
    (req_to_token, the rows [B, max_ctx])."""
    req_to_token = assign_req_to_token_pool(req_to_token.at[row_ids].set(SCRATCH_SLOT), row_ids,
                                            jnp.zeros_like(count), count, flat)
    return req_to_token, req_to_token[row_ids]
