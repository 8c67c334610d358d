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
                                packed logprob blocks, a prefill's prompt logprobs) from a host result; a batch
                                where any request asks for logprobs (`wants_logprobs`, `wants_prompt_logprobs`)
                                runs the executables that compute them
    verify_handle(result)       what the verify_done wait waits on after a step (None: nothing)
    threaded / state            whether the executables' calls run on a dispatch thread (runtime/dispatch.py:
                                a step's result is then a `Dispatched`); the device state, once the call in
                                flight has returned it
    warmup_keys(plan, greedy, logprobs, penalties)   the step keys of a warm-up plan
    prime(key)                  run key's executable once on padding rows only (a warm start's preload)
    prefix_bound(n, max_new, overlap)   the longest prefix a request can reach (warm-up planning)
    calibrate_keys(keys, compile)   after a warm-up of `keys`: time what the decoder times (adaptive tiers)
    dropped()                   the scheduler dropped every dispatched, unread result (abort_all)
    stats_window() / stats(...) the decoder's part of the stats

`TargetDecoder` (runtime/target.py) decodes with the target alone; `SpecDecoder`
(jeagle/speculative/decoder.py) runs EAGLE rounds and owns the tiers and the adaptive controller.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

import jax

import numpy as np

from jeagle.runtime.buckets import pad


class Delivery(NamedTuple):
    """What one dispatch's result holds for one request."""
    tokens: np.ndarray  # new token ids
    finished: bool  # the device finished the request (speculative rounds)
    logprobs: np.ndarray | None = None  # packed blocks [n, LOGPROB_COLUMNS], one per token, when the request asked
    prompt_logprobs: list | None = None  # a prefill's: one per prompt token after the first, when asked


class Decoder(Protocol):
    speculative: bool
    threaded: bool  # runtime/dispatch.py
    context_reserve: int
    grammar_mask_s: float  # `GrammarMasks`

    def prefill(self, reqs, b: int, t: int): ...

    def wants_step(self, r) -> bool: ...

    def prefix_needed(self, r) -> int: ...

    def step(self, reqs, b: int, kv: int, drain=None):
        """Dispatch one decode step / round over `reqs`. drain(): reads every result in flight (a
        grammar round calls it once its forward is dispatched: its masks need those tokens)."""

    def unpack(self, kind: str, reqs, host: np.ndarray) -> list["Delivery"]: ...

    def prime(self, key) -> None: ...

    def calibrate_keys(self, keys, compile: bool = True) -> None: ...

    def host_step(self, seconds: float) -> None:
        """The last step's host time besides its dispatch, not waiting on the device (the scheduler's)."""

    def dropped(self) -> None: ...

    def settle(self) -> None: ...


def context_size(config, model_cfg) -> int:
    """The context window: --max-context, else the model's, capped at 8192."""
    return config.max_context or min(model_cfg.max_position_embeddings, 8192)


def weight_bytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def place_cache(cache, mesh):
    """A KVCache on `mesh`: pools split by KV heads, the slot table replicated."""
    from jeagle.runtime.kv_cache import KVCache
    from jeagle.parallel.sharding import replicate, shard_pools

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
    return any(r.wants_prompt_logprobs for r in reqs)


def split_prompt_logprobs(host: np.ndarray, reqs, base: int) -> tuple[np.ndarray, list]:
    """A prefill's host result → (its first `base` columns, each request's prompt logprobs: None, or
    [None, TokenLogprob per prompt token after the first] when it asked for them)."""
    from jeagle.sampling import logprobs

    if not wants_prompt_logprobs(reqs):
        return host, [None] * len(reqs)
    rest = host[:, base:]
    blocks = rest.reshape(rest.shape[0], -1, logprobs.LOGPROB_COLUMNS)
    out = [[None] + logprobs.unpack(blocks[i, 1:len(r.prompt)]) if r.wants_prompt_logprobs else None
           for i, r in enumerate(reqs)]
    return host[:, :base], out


def wants_grammar(reqs) -> bool:
    """Whether a batch decodes under grammar masks (synchronously: jeagle/sampling/grammar.py)."""
    return any(r.matcher is not None for r in reqs)


class GrammarMasks:
    """Grammar masks for a decoder's batches (jeagle/sampling/grammar.py), computed on llguidance's threads;
    `grammar_mask_s` sums the host time they took (the stats' `grammar_mask_ms`)."""

    grammar_mask_s = 0.0
    grammar_rows_walked = 0  # speculative rows whose masks came from `walk_nodes` ...
    grammar_rows_masked = 0  # ... and from a mask per tree node
    grammar_compact_rounds = 0  # grammar rounds whose masks went to the device as token ids (all rows walked)

    def grammar_rows(self) -> dict:
        """Speculative grammar rows so far: walked, masked, the rounds whose masks went as token ids,
        and why the walk left rows undecided (in this process: `jeagle.sampling.grammar_walk.UNDECIDED`)."""
        from jeagle.sampling.grammar_walk import UNDECIDED

        return {"walked": self.grammar_rows_walked, "masked": self.grammar_rows_masked,
                "compact_rounds": self.grammar_compact_rounds, "undecided": dict(UNDECIDED)}

    def token_masks(self, reqs, b: int) -> np.ndarray:
        """Each request's next-token mask [b, W] (its grammar's, else every token allowed), padded to b."""
        from jeagle.sampling.grammar import next_masks

        t0 = time.perf_counter()
        out = next_masks([r.matcher for r in reqs], b, self.model_cfg.vocab_size)
        if wants_grammar(reqs):
            self.grammar_mask_s += time.perf_counter() - t0
        return out

    def tree_masks(self, reqs, b: int, tree, fwd=None, walk=None, compact_ok: bool = False):
        """Each draft-tree node's grammar mask, from the tree read back to the host: rows with `walk`
        True from the verify forward's best tokens `fwd` (`jeagle.sampling.grammar_walk.walk_nodes`, greedy
        rows; those it cannot decide, and the other rows, with `jeagle.sampling.grammar.tree_masks`). Returns
        (masks, compact): bitmasks [b, N, W], or with `compact_ok` where every grammar row was walked
        to token lists, their ids [b, N, CANDIDATES] (-1 padded; a node of -1s allows every token) —
        C ids a node to fill and copy to the device instead of W words."""
        from jeagle.sampling.grammar import mask_words, tree_masks
        from jeagle.sampling.grammar_walk import CANDIDATES, compact, walk_nodes, write_nodes

        tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parent)  # their copies started with the call
        walk, walked = walk or [False] * len(reqs), 0
        t0 = time.perf_counter()
        full = [r.matcher if not (w or r.done) else None for r, w in zip(reqs, walk)]
        nodes = [None] * b
        if any(walk):
            ids, vals = np.asarray(fwd.top_ids), np.asarray(fwd.top_vals)  # waits for the forward
            t0 = time.perf_counter()
            words = mask_words(self.model_cfg.vocab_size)
            for i, (r, w) in enumerate(zip(reqs, walk)):
                if w:
                    nodes[i] = walk_nodes(r.matcher, tokens[i], parents[i], ids[i], vals[i], words)
                    if nodes[i] is None:
                        full[i] = r.matcher  # undecided: every node's mask
            walked = sum(n is not None for n in nodes)
            self.grammar_rows_walked += walked
        self.grammar_rows_masked += sum(m is not None for m in full)
        if compact_ok and walked and not any(m is not None for m in full) and all(compact(n) for n in nodes if n):
            out = np.full((b, tokens.shape[1], CANDIDATES), -1, np.int32)
            for i, n in enumerate(nodes):
                for node, allowed in (n or {}).items():
                    out[i, node, :len(allowed)] = allowed
            self.grammar_mask_s += time.perf_counter() - t0
            self.grammar_compact_rounds += 1
            return out, True
        out = tree_masks(full + [None] * (b - len(reqs)), tokens, parents, self.model_cfg.vocab_size)
        for i, n in enumerate(nodes):
            if n is not None:
                write_nodes(n, out[i])
        self.grammar_mask_s += time.perf_counter() - t0
        return out, False


def prefill_batch(reqs, b: int, t: int, max_ctx: int):
    """A prefill's token inputs: (tokens [b, t] — each request's sequence from its cached prefix on —,
    lengths [b], starts [b], slot count [b], flat slot list): see `runtime/steps.py` `prefill_attn` and
    `runtime/slots.py` `flat_slots`. Sets each request's `length` (its positions once prefilled)."""
    from jeagle.runtime.slots import flat_slots

    tokens = np.zeros((b, t), np.int32)
    for i, r in enumerate(reqs):
        seq = r.seq
        tokens[i, : len(seq) - r.start] = seq[r.start:]
        r.length = len(seq)
    count, flat = flat_slots(b, max_ctx, [r.table for r in reqs])
    return (tokens, pad([r.length - r.start for r in reqs], b, 0, np.int32), pad([r.start for r in reqs], b, 0, np.int32),
            count, flat)


class SlotTables:
    """The host's two ways into a decoder's slot table (`state.cache.req_to_token`), shared by both
    decoders: `assign_slots` writes positions allocated after the prefill (slots on demand,
    runtime/kv.py), `read_tables` reads rows back (a speculative round swaps slots on the device).

    A read sends nothing to the device and, on a GPU, allocates nothing there: it copies the whole table
    into output buffers the decoder keeps (donated, reused once the host has the values; a new pair only
    while more reads overlap than the pool holds; a CPU does not donate them), and the host picks the
    rows. Each pooled pair keeps the host copy of its last read until its next (one table: (max_reqs + 1)
    x max_ctx int32, ~8 MB at 256 x 8,192), as many as reads ever overlapped. A read that
    allocated its outputs (and sent its row ids) left new buffers live beside the round dispatched next,
    whose buffers then landed at other addresses, so that XLA re-recorded its command buffers inside the
    call: +1.7-1.9 ms of host time in that round's call at batch 16 and 48; with the outputs donated,
    +0.7-0.8 ms (H200, bench/probes/round_events.py, HISTORY, 2026-11-28). A slot-table update, whose
    outputs alias the donated state, cost next to nothing there."""

    EXTEND_ROWS_SLOTS = 128  # flat slots per row of one assign call (larger requests take several calls)

    def _init_tables(self):
        import dataclasses

        import jax

        from jeagle.kernels.assign_req_to_token_pool import (assign_req_to_token_pool,
                                                             assign_req_to_token_pool_reference)
        from jeagle.kernels.settings import use

        # Under tensor parallelism the table is replicated over the mesh: the jnp form partitions
        # without a custom call (the kernel runs inside the prefill executables only).
        kernel = assign_req_to_token_pool if getattr(self, "mesh", None) is None else assign_req_to_token_pool_reference

        def assign(state, rows, starts, ends, flat):
            cache = state.cache
            r2t = kernel(cache.req_to_token, rows, starts, ends, flat)
            return dataclasses.replace(state, cache=dataclasses.replace(cache, req_to_token=r2t))

        def read(req_to_token, seq_len, tables, lengths):  # tables, lengths: the buffers the outputs reuse
            return req_to_token + 0, (seq_len + 0 if seq_len is not None else lengths * 0)

        # Compiled here, once, for their one shape each: nothing compiles for them while serving.
        n, per = self.max_reqs, self.EXTEND_ROWS_SLOTS
        i32 = jax.ShapeDtypeStruct((n,), np.int32)
        with use(self.config.kernels):  # the engine's kernel backend, as every step's trace has it
            self._assign_fn = jax.jit(assign, donate_argnums=0).lower(
                self.state, i32, i32, i32, jax.ShapeDtypeStruct((n * per,), np.int32)).compile()
            table = self.state.cache.req_to_token
            sharding = table.sharding  # the read's outputs: placed as the table is (replicated on a mesh)
            if isinstance(sharding, jax.sharding.NamedSharding):
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            # Made on the device (a CPU's device_put of a NumPy array may share the host's memory, and such a
            # buffer is not donated).
            self._read_buffers = jax.jit(
                lambda: (jax.numpy.zeros(table.shape, np.int32), jax.numpy.zeros(table.shape[:1], np.int32)),
                out_shardings=(sharding, sharding)).lower().compile()
            self._read_bufs = [self._read_buffers()]  # free (tables, lengths) pairs; more while reads overlap
            self._read_fn = jax.jit(read, donate_argnums=(2, 3), keep_unused=True).lower(
                *self._table_and_lengths(), *self._read_bufs[0]).compile()

    def _table_and_lengths(self):  # what a read reads: the slot table, and the rows' lengths where kept
        state = self.state  # (a property where a dispatch thread runs the calls: it joins the call in flight)
        return state.cache.req_to_token, getattr(state.rows, "seq_len", None)

    def assign_slots(self, entries) -> None:
        """Write slot-table entries [(row, first position, slots)] (in as few fixed-shape calls as fit)."""
        n, per = self.max_reqs, self.EXTEND_ROWS_SLOTS
        pieces = [(row, start + i, s[i:i + per]) for row, start, s in entries for i in range(0, len(s), per)]
        for c in range(0, len(pieces), n):
            part = pieces[c:c + n]
            rows = pad([p[0] for p in part], n, self.scratch_row, np.int32)
            starts = pad([p[1] for p in part], n, 0, np.int32)
            ends = pad([p[1] + len(p[2]) for p in part], n, 0, np.int32)
            flat = np.zeros((n * per,), np.int32)
            if part:
                cat = np.concatenate([p[2] for p in part])
                flat[: len(cat)] = cat
            self.state = self._assign_fn(self.state, rows, starts, ends, flat)

    def read_tables(self, rows):
        """Dispatch a read of slot-table rows `rows` and their committed lengths (speculative: the rows'
        seq_len; target-only: 0, the host knows); returns a handle for `tables_of`. The device copies the
        whole table (as many rows as a read of padded row ids returned before), so that a read sends
        nothing to the device: its row ids had been a new device buffer beside the next round."""
        bufs = self._read_bufs.pop() if self._read_bufs else self._read_buffers()
        tables, lengths = self._read_fn(*self._table_and_lengths(), *bufs)
        tables.copy_to_host_async()
        lengths.copy_to_host_async()
        return list(rows), tables, lengths

    @staticmethod
    def tables_ready(handle) -> bool:
        """Whether a `read_tables` handle's copies are done (`tables_of` would not wait)."""
        _, tables, lengths = handle
        return tables.is_ready() and lengths.is_ready()

    def tables_of(self, handle) -> tuple[np.ndarray, np.ndarray]:
        """A read's rows and lengths on the host (waits for the copies); its buffers serve the next read."""
        rows, tables, lengths = handle
        out = np.asarray(tables)[rows], np.asarray(lengths)[rows]  # (copies: the next read reuses the buffers)
        self._read_bufs.append((tables, lengths))
        return out
