"""Paged KV cache in SGLang's layout (page size 1): slot pools, `req_to_token`, a free-slot allocator.

Device side (a pytree, donated through every step):
    k, v           [L, num_slots, kv_heads, head_dim]  one slot pool per layer, stacked so a layer
                   loop indexes it; slot 0 is a scratch slot that padded tokens write into and that
                   is never read unmasked.
    req_to_token   [max_reqs + 1, max_ctx] int32  slot of each position of each request row; the last
                   row is the scratch row that padded batch rows use.

Host side: `SlotAllocator`, a free list of slot ids. Slots are handed out per request as positions
are reached and returned when the request finishes; running out raises `OutOfSlots`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jeagle.config import ModelConfig

SCRATCH_SLOT = 0


class OutOfSlots(RuntimeError):
    """The KV pool has fewer free slots than a request needs."""


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


def slots_for_memory_fraction(cfg: ModelConfig, fraction: float, weight_bytes: int, device=None) -> int:
    """How many slots fit in `fraction` of the device memory after the weights (SGLang's
    `mem_fraction_static`). Raises on devices that report no memory limit (CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError(f"{device.platform} device reports no memory limit: pass --max-total-tokens")
    budget = int(limit * fraction) - weight_bytes - stats.get("bytes_in_use", 0)
    slots = budget // kv_bytes_per_token(cfg)
    if slots < 2:
        raise OutOfSlots(f"--mem-fraction-static {fraction} leaves no room for KV slots "
                         f"(limit {limit / 2**30:.1f} GiB, weights {weight_bytes / 2**30:.2f} GiB)")
    return int(slots)


class SlotAllocator:
    """Free list over slot ids 1..num_slots-1 (slot 0 is scratch)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError("a KV pool needs at least 2 slots (slot 0 is scratch)")
        self.num_slots = num_slots
        # Popped from the end: hand out low ids first so small workloads stay in a compact range.
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise OutOfSlots(f"KV cache out of slots: need {n}, {len(self._free)} free of "
                             f"{self.num_slots - 1}; raise --max-total-tokens (or --mem-fraction-static) "
                             "or lower --batch-size / --max-new-tokens")
        out = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return np.asarray(out[::-1], dtype=np.int32)

    def free(self, slots) -> None:
        slots = [int(s) for s in np.asarray(slots).reshape(-1)]
        if any(s <= 0 or s >= self.num_slots for s in slots):
            raise ValueError("freeing an invalid slot id")
        self._free.extend(slots)
