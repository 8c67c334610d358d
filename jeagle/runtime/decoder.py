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
    unpack(kind, reqs, host)    each request's `Delivery` (new tokens, finished on the device, their
                                TokenLogprobs, a prefill's prompt logprobs) from a host result; a batch
                                where any request asks for logprobs (`wants_logprobs`, `wants_prompt_logprobs`)
                                runs the executables that compute them
    verify_handle(result)       what the verify_done wait waits on after a step (None: nothing)
    warmup_keys(plan, greedy, logprobs, penalties)   the step keys of a warm-up plan
    prime(key)                  run key's executable once on padding rows only (a warm start's preload)
    prefix_bound(n, max_new, overlap)   the longest prefix a request can reach (warm-up planning)
    calibrate_keys(keys, compile)   after a warm-up of `keys`: time what the decoder times (adaptive tiers)
    dropped()                   the scheduler dropped every dispatched, unread result (abort_all)
    stats_window() / stats(...) the decoder's part of the stats

`TargetDecoder` (runtime/target.py) decodes with the target alone; `SpecDecoder`
(jeagle/spec/decoder.py) runs EAGLE rounds and owns the tiers and the adaptive controller.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import numpy as np

from jeagle.runtime.buckets import pad


class Delivery(NamedTuple):
    """What one dispatch's result holds for one request."""
    tokens: np.ndarray  # new token ids
    finished: bool  # the device finished the request (speculative rounds)
    logprobs: list | None = None  # one TokenLogprob per token, when the request asked for logprobs
    prompt_logprobs: list | None = None  # a prefill's: one per prompt token after the first, when asked


class Decoder(Protocol):
    speculative: bool
    context_reserve: int

    def prefill(self, reqs, b: int, t: int): ...

    def wants_step(self, r) -> bool: ...

    def prefix_needed(self, r) -> int: ...

    def step(self, reqs, b: int, kv: int): ...

    def unpack(self, kind: str, reqs, host: np.ndarray) -> list["Delivery"]: ...

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


def wants_logprobs(reqs) -> bool:
    """Whether a batch runs the logprob executables: any of its requests asks for logprobs. (The
    host decides it again from the same batch when it unpacks the result.)"""
    return any(r.params.logprobs is not None for r in reqs)


def wants_prompt_logprobs(reqs) -> bool:
    """Whether a prefill also computes the prompt tokens' logprobs (completions' `echo`)."""
    return any(r.params.prompt_logprobs for r in reqs)


def split_prompt_logprobs(host: np.ndarray, reqs, base: int) -> tuple[np.ndarray, list]:
    """A prefill's host result → (its first `base` columns, each request's prompt logprobs: None, or
    [None, TokenLogprob per prompt token after the first] when it asked for them)."""
    from jeagle import logprobs

    if not wants_prompt_logprobs(reqs):
        return host, [None] * len(reqs)
    rest = host[:, base:]
    blocks = rest.reshape(rest.shape[0], -1, logprobs.LOGPROB_COLUMNS)
    out = [[None] + logprobs.unpack(blocks[i, 1:len(r.prompt)]) if r.params.prompt_logprobs else None
           for i, r in enumerate(reqs)]
    return host[:, :base], out


def wants_grammar(reqs) -> bool:
    """Whether a batch decodes under grammar masks (synchronously: jeagle/grammar.py)."""
    return any(r.matcher is not None for r in reqs)


def token_masks(reqs, b: int, vocab: int) -> np.ndarray:
    """Each request's next-token mask [b, W] (its grammar's, else every token allowed), padded to b."""
    from jeagle.grammar import allow_all

    out = allow_all(b, vocab)
    for i, r in enumerate(reqs):
        if r.matcher is not None:
            out[i] = r.matcher.mask()
    return out
