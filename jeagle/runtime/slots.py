"""The one place for KV slots and request rows on the host.

A request owns, from admission to finish, one request row and a block of slots laid out as

    | positions (prompt + new tokens [+ S + 1 speculative]) | tree (N) | draft scratch ((S-1)·K) |

(`SlotLayout`; the tree and scratch parts are the speculative decoder's). Slot 0 is the scratch slot
(`jeagle.runtime.kv_cache.SCRATCH_SLOT`) that padded tokens write into, and the last request row the scratch
row that padded batch rows use: neither is ever handed out. `SlotPool` hands out rows and slot
blocks and takes them back; running out raises `OutOfSlots`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from jeagle.runtime.kv_cache import SCRATCH_SLOT

log = logging.getLogger("jeagle.runtime")

# By default on a CPU the KV pools take at most this fraction of the host's available memory (a full
# context for every row of a 48-row server is ~18 GB of fp32 KV for SmolLM2); at least one request's.
HOST_KV_FRACTION = 0.4


class OutOfSlots(RuntimeError):
    """The KV pool has fewer free slots than a request needs."""


@dataclass(frozen=True)
class SlotLayout:
    """How one request's slots divide (see the module docstring)."""
    past_last: int = -1  # positions past prompt + max_new: -1 target-only (the last token's KV is never
    #                      written), S + 1 speculative (a round writes up to S + 1 past the last token)
    tree: int = 0  # N: the verify tree's slots
    scratch: int = 0  # the draft's beam slots

    @property
    def context_reserve(self) -> int:
        """Positions of the context a request must leave free (speculative: S + 1)."""
        return max(self.past_last, 0)

    def positions(self, prompt_len: int, max_new: int, max_ctx: int) -> int:
        return min(prompt_len + max_new + self.past_last, max_ctx)

    def slots_needed(self, prompt_len: int, max_new: int, max_ctx: int) -> int:
        return self.positions(prompt_len, max_new, max_ctx) + self.tree + self.scratch

    def split(self, slots: np.ndarray, prompt_len: int, max_new: int, max_ctx: int):
        """(positions, tree, scratch) parts of a request's slot block."""
        p = self.positions(prompt_len, max_new, max_ctx)
        return slots[:p], slots[p: p + self.tree], slots[p + self.tree: p + self.tree + self.scratch]


class SlotAllocator:
    """Free list over slot ids 1..num_slots-1 (slot 0 is scratch)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError("a KV pool needs at least 2 slots (slot 0 is scratch)")
        self.num_slots = num_slots
        # Popped from the end: hand out low ids first so small workloads stay in a compact range.
        self._free = list(range(num_slots - 1, SCRATCH_SLOT, -1))

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
        if any(s <= SCRATCH_SLOT or s >= self.num_slots for s in slots):
            raise ValueError("freeing an invalid slot id")
        self._free.extend(slots)

    def free_ids(self) -> np.ndarray:
        """The free slot ids (for ownership checks)."""
        return np.asarray(self._free, np.int64)


class SlotPool:
    """Request rows 0..max_reqs-1 (row max_reqs is the scratch row) and the slot allocator."""

    def __init__(self, num_slots: int, max_reqs: int):
        self.allocator = SlotAllocator(num_slots)
        self.max_reqs = max_reqs
        self.scratch_row = max_reqs
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self._is_free = set(self._free_rows)  # `give_row`'s check in O(1), not a scan of the free rows

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def free_slots(self) -> int:
        return self.allocator.free_count

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def free_row_ids(self) -> list[int]:
        return sorted(self._free_rows)

    def take_row(self) -> int:
        """A free request row (the caller checked `free_rows`)."""
        row = self._free_rows.pop()
        self._is_free.discard(row)
        return row

    def give_row(self, row: int) -> None:
        if row in self._is_free or not 0 <= row < self.max_reqs:
            raise ValueError(f"giving back request row {row}, which is free or not a row")
        self._free_rows.append(row)
        self._is_free.add(row)


def flat_slots(b: int, max_ctx: int, per_request: list) -> tuple[np.ndarray, np.ndarray]:
    """(count [b], flat slot list [b * max_ctx]) for `jeagle.runtime.kv_cache.assign_rows`: the requests' position
    slots back to back, padded with the scratch slot to a size fixed by the batch bucket, so a prefill
    executable depends on (batch, length) buckets only; padding rows own nothing."""
    count = np.zeros((b,), np.int32)
    count[: len(per_request)] = [len(s) for s in per_request]
    flat = np.full((b * max_ctx,), SCRATCH_SLOT, np.int32)
    flat[: count.sum()] = np.concatenate(per_request) if per_request else []
    return count, flat


def pool_size(config, model_cfg, layout: SlotLayout, max_ctx: int, weight_bytes: int, draft_cfg=None) -> int:
    """Slots in the pool (slot 0 included): `mem_fraction_static` of the device memory after the
    weights, else `max_total_tokens`, else enough for every row to hold a full context (plus a
    speculative request's tree and scratch slots) — on a CPU (JAX's default backend) at most what fits
    in HOST_KV_FRACTION of the host's available memory (the target's and the draft's pools), in full
    requests rounded down to a power of two (the pool's size is in every executable's shapes: a size
    that moved with the host's free memory would recompile at every start), never less than one:
    requests then wait for room."""
    if config.mem_fraction_static is not None:
        return slots_for_memory_fraction(model_cfg, config.mem_fraction_static, weight_bytes)
    per_request = max(max_ctx, layout.slots_needed(max_ctx, 1, max_ctx))
    if config.max_total_tokens:
        return config.max_total_tokens + 1
    full = config.max_batch_size * per_request
    import jax

    if jax.default_backend() == "cpu" and (avail := host_available_bytes()):
        from jeagle.runtime.kv_cache import kv_bytes_per_token

        per_slot = kv_bytes_per_token(model_cfg) + (kv_bytes_per_token(draft_cfg) if draft_cfg is not None else 0)
        fit = int(avail * HOST_KV_FRACTION) // (per_slot * per_request)  # full requests that fit
        if fit < config.max_batch_size:
            requests = 1 << (max(fit, 1).bit_length() - 1)
            slots = requests * per_request
            log.warning("KV pool: %d slots (%.1f GiB: %d full %d-position contexts) in place of %d (%.1f GiB, one "
                        "for each of the %d rows): %.0f%% of this host's available memory holds %d; requests wait "
                        "for room. --max-total-tokens sets it.", slots, slots * per_slot / 2**30, requests, max_ctx,
                        full, full * per_slot / 2**30, config.max_batch_size, 100 * HOST_KV_FRACTION, fit)
            return slots + 1
    return full + 1


def host_available_bytes() -> int | None:
    """The host's available memory (Linux's MemAvailable, else free pages), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def slots_for_memory_fraction(cfg, fraction: float, weight_bytes: int, device=None) -> int:
    """How many slots fit in `fraction` of the device memory after the weights (SGLang's
    `mem_fraction_static`). Raises on devices that report no memory limit (CPU)."""
    import jax

    from jeagle.runtime.kv_cache import kv_bytes_per_token

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
