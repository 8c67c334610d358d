"""The interface between the scheduler and a decoder, and what the two decoders share.

The scheduler (`scheduler.Engine`) owns requests, rows, slots, buckets and timing; a decoder owns the
device state, the step functions and their executables. The scheduler calls:

    layout                      SlotLayout: how a request's slots divide (positions | tree | scratch)
    buckets                     the bucket tables (runtime/buckets.py)
    executables                 the decoder's Executables (compile time, store, warm-up)
    prefill(reqs, b, t)         dispatch a prefill of `reqs` padded to batch b, length t: device result
    wants_step(r)               whether r goes into the next step
    prefix_needed(r)            the longest prefix r's next step can attend over (picks the kv bucket)
    step(reqs, b, kv)           dispatch one decode step / round: device result
    unpack(kind, reqs, host)    each request's (new tokens, finished on the device) from a host result
    verify_handle(result)       what the verify_done wait waits on after a step (None: nothing)
    warmup_keys(plan, greedy)   the step keys of a warm-up plan
    prime(key)                  run key's executable once on padding rows only (a warm start's preload)
    prefix_bound(n, max_new, overlap)   the longest prefix a request can reach (warm-up planning)
    calibrate_keys(keys, compile)   after a warm-up of `keys`: time what the decoder times (adaptive tiers)
    dropped()                   the scheduler dropped every dispatched, unread result (abort_all)
    stats_window() / stats(...) the decoder's part of the stats

`TargetDecoder` (runtime/target.py) decodes with the target alone; `SpecDecoder`
(jeagle/spec/decoder.py) runs EAGLE rounds and owns the tiers and the adaptive controller.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np

from jeagle.runtime.buckets import pad


class Decoder(Protocol):
    speculative: bool
    context_reserve: int

    def prefill(self, reqs, b: int, t: int): ...

    def wants_step(self, r) -> bool: ...

    def prefix_needed(self, r) -> int: ...

    def step(self, reqs, b: int, kv: int): ...

    def unpack(self, kind: str, reqs, host: np.ndarray) -> list[tuple[np.ndarray, bool]]: ...

    def prime(self, key) -> None: ...

    def calibrate_keys(self, keys, compile: bool = True) -> None: ...

    def dropped(self) -> None: ...


def context_size(config, model_cfg) -> int:
    """The context window: --max-context, else the model's, capped at 8192."""
    return config.max_context or min(model_cfg.max_position_embeddings, 8192)


def weight_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def place_cache(cache, mesh):
    """A KVCache on `mesh`: pools split by KV heads, the slot table replicated."""
    from jeagle.cache import KVCache
    from jeagle.sharding import replicate, shard_pools

    k, v = shard_pools(cache.k, cache.v, mesh)
    return KVCache(k=k, v=v, req_to_token=replicate(cache.req_to_token, mesh))


def sampling_inputs(reqs, b: int, rng: np.random.Generator):
    """(temperature, top_k, top_p, seed) [b] of `reqs`, padded to b (a request without a seed gets a
    random one)."""
    seeds = [r.params.seed if r.params.seed is not None else rng.integers(0, 2**32) for r in reqs]
    return (pad([r.params.temperature for r in reqs], b, 0.0, np.float32),
            pad([r.params.top_k for r in reqs], b, 0, np.int32),
            pad([r.params.top_p for r in reqs], b, 1.0, np.float32),
            pad(seeds, b, 0, np.uint32))
