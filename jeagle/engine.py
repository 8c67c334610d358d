"""The autoregressive engine: batched ragged prefill, then pipelined decode, with continuous batching.

Device state (donated through every call, never copied):
    KVCache   slot pools + req_to_token            (cache.py)
    RowState  per request row: newest token, sampling parameters
The host keeps only bookkeeping: which request owns which row and slots, how many tokens each has
been dispatched for, and the tokens that have come back.

A request gets a row and all the slots it can ever use (prompt + max_new_tokens - 1) when it is
admitted; its req_to_token row is written by its prefill, so a decode step needs nothing from the
host but the rows and positions. Requests wait in the queue while the pool lacks room.

Pipelining: the host dispatches decode call c+1 (its input tokens live on the device) before it
reads the tokens of call c, whose device→host copy was started right after dispatch. A request that
finishes inside call c has already been dispatched into call c+1: that extra work is discarded.

Every (phase, batch bucket, length bucket) executable is compiled ahead of time on first need or by
`warmup()` (`jit(...).lower(...).compile()`, in parallel threads) and then called directly; with an
`executable_cache_dir` compiled executables are stored and a later start loads them
(`runtime.ExecutableStore`). Compile time is counted separately from serving time.
"""

from __future__ import annotations

import bisect
import functools
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jeagle.cache import KVCache, OutOfSlots, SlotAllocator, init_cache, slots_for_memory_fraction
from jeagle.config import ModelConfig
from jeagle.kernels.assign_req_to_token_pool import assign_req_to_token_pool
from jeagle.kernels.paged_attention import kernel_serves
from jeagle.models.common import AttnInputs
from jeagle.models.llama import Llama
from jeagle.runtime import VerifyDone, latency_stats, verify_done_mode
from jeagle.sampling import SamplingParams, sample


class PromptTooLong(ValueError):
    """A prompt that does not fit the context window."""


def pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo·factor, lo·factor², ... below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(out)


def prefill_batch_buckets(buckets: tuple[int, ...], config: "EngineConfig") -> tuple[int, ...]:
    """Batch buckets of the prefill executables. A prefill is one call per admitted group, not a step
    repeated every few milliseconds, so padding costs little there and compiling a prefill for each
    of SGLang's ~20 decode buckets (times every length bucket) would dominate start-up: the default
    keeps the decode buckets nearest 1, 4, 16, 64, ... and the largest. `--buckets` and
    `--disable-padding` apply to prefill as given."""
    if config.batch_buckets or config.disable_padding:
        return buckets
    keep = {buckets[-1]}
    target = 1
    while target < buckets[-1]:
        keep.add(pick_bucket(buckets, target))
        target *= 4
    return tuple(sorted(keep))


def default_batch_buckets(max_batch: int) -> tuple[int, ...]:
    """SGLang's capture list (1..8, 10..32 step 2, 40..64 step 4, 72..256 step 8, then step 16)."""
    sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
    sizes += list(range(272, max(max_batch, 256) + 16, 16))
    out = [s for s in sizes if s < max_batch] + [max_batch]
    return tuple(sorted(set(out)))


UNROLL_ALL_BYTES = 32 << 20  # one layer's weights per device above which the decode step unrolls every layer


def layer_weight_bytes(cfg) -> int:
    """Bytes of one decoder layer's matmul weights (q|k|v, o, gate|up, down) in the model's dtype."""
    h = cfg.hidden_size
    n = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return n * jnp.dtype(cfg.dtype).itemsize


def batch_buckets(max_reqs: int, config: "EngineConfig") -> tuple[int, ...]:
    """The batch buckets: --buckets as given, exact sizes with --disable-padding, else SGLang's list
    capped by --max-bucket; the largest always covers max_batch_size."""
    if config.disable_padding:
        return tuple(range(1, max_reqs + 1))
    if config.batch_buckets:
        out = tuple(sorted(set(config.batch_buckets)))
        if out[0] < 1:
            raise ValueError(f"batch buckets must be >= 1, got {out}")
        if out[-1] < max_reqs:
            raise ValueError(f"largest batch bucket {out[-1]} < max running requests {max_reqs}")
        return out
    out = default_batch_buckets(max_reqs)
    if config.max_bucket is not None:
        if config.max_bucket < 1:
            raise ValueError(f"--max-bucket must be >= 1, got {config.max_bucket}")
        out = tuple(b for b in out if b <= config.max_bucket)
        if not out or out[-1] < max_reqs:
            raise ValueError(f"--max-bucket {config.max_bucket} < max running requests {max_reqs}: a full batch "
                             "would have no bucket")
    return out


def kv_buckets(max_ctx: int, config: "EngineConfig", head_dims) -> tuple[int, ...]:
    """Prefix-length buckets of the decode/round executables. With the paged-attention kernel serving
    every attention of the step (`kernels/paged_attention.py` reads each request's own length) one
    bucket, the whole context, serves all lengths; the pure-jnp reference gathers a static prefix, so
    it gets powers of two from `min_kv_bucket`."""
    if all(kernel_serves(d) for d in head_dims):
        return (max_ctx,)
    return pow2_buckets(min(config.min_kv_bucket, max_ctx), max_ctx)


def flat_slots(b: int, max_ctx: int, per_request: list) -> tuple[np.ndarray, np.ndarray]:
    """(count [b], flat slot list [b * max_ctx]) for `assign_rows`: the requests' slots back to back,
    padded with the scratch slot to a size fixed by the batch bucket, so a prefill executable depends
    on (batch, length) buckets only; padding rows own nothing."""
    count = np.zeros((b,), np.int32)
    count[: len(per_request)] = [len(s) for s in per_request]
    flat = np.zeros((b * max_ctx,), np.int32)
    flat[: count.sum()] = np.concatenate(per_request) if per_request else []
    return count, flat


def assign_rows(req_to_token, row_ids, count, flat):
    """Give rows `row_ids` their slots: clear the rows (past a request's last slot a row holds the
    scratch slot 0, which decode relies on), then write positions [0, count) from the flat list
    through the `assign_req_to_token_pool` kernel. Returns (req_to_token, the rows [B, max_ctx])."""
    req_to_token = assign_req_to_token_pool(req_to_token.at[row_ids].set(0), row_ids, jnp.zeros_like(count), count,
                                            flat)
    return req_to_token, req_to_token[row_ids]


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 16  # rows = max running requests
    max_context: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_total_tokens: int | None = None  # KV slots; default max_batch_size * (max_context + tree slots) (CPU) ...
    mem_fraction_static: float | None = None  # ... or this fraction of GPU memory
    max_prefill_tokens: int = 8192  # padded tokens per prefill call (a longer single prompt still runs)
    decode_steps: int = 1  # tokens per decode dispatch (lax.fori_loop inside one executable)
    # Layer loop: False (a loop), True (unrolled), k >= 2 (k layers per iteration); None: for the
    # decode and round executables 3 (halves the host's dispatch time per step for +10-30% compile
    # time, bench/RESULTS.md "dispatch"); the decode step unrolled when a layer's weights pass
    # UNROLL_ALL_BYTES (a loop slices each layer's weights by a traced index, and XLA copies the slice
    # before a Triton GEMM: 2.5x the step time of a Llama-8B shape, bench/RESULTS.md "session 6"; the
    # round's GEMMs went to cuBLAS without copies there, and unrolling it measured no faster); a loop
    # for prefill.
    unroll_layers: bool | int | None = None
    batch_buckets: tuple[int, ...] | None = None  # default: SGLang's list capped at max_batch_size
    max_bucket: int | None = None  # cap the default list (the largest bucket is then max_batch_size)
    disable_padding: bool = False  # one executable per exact batch size
    overlap: bool = True  # dispatch step r+1 before the host processes step r
    verify_done_wait: str | None = None  # "sync" | "dataflow"; None: JEAGLE_VERIFY_DONE_STREAM_WAIT, else sync
    min_kv_bucket: int = 128
    executable_cache_dir: str | None = None  # ExecutableStore root (runtime.py); None: no store
    compile_workers: int | None = None  # warm-up load/compile threads; None: min(16, CPUs)
    compile_processes: int | None = None  # warm-up worker processes (need the store); None: auto (8 on a GPU), 0: none
    min_prefill_bucket: int = 64
    tp: int = 1  # tensor parallelism: devices the target is split over (jeagle/sharding.py)
    tp_vocab: str = "shard"  # lm_head / embedding rows split over the devices, or "replicate"
    tp_draft: str = "auto"  # the draft head split like a target layer when it divides; "replicate" | "shard"


@jax.tree_util.register_dataclass
@dataclass
class RowState:
    last_token: jax.Array  # [R] int32  newest token of each row, its KV not yet written
    temperature: jax.Array  # [R] f32
    top_k: jax.Array  # [R] int32
    top_p: jax.Array  # [R] f32
    seed: jax.Array  # [R] uint32


@dataclass
class Output:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    time_to_first_token_s: float | None = None


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    eos: frozenset[int]
    max_new: int
    row: int = -1
    slots: np.ndarray | None = None
    length: int = 0  # positions whose KV is written or dispatched to be written
    dispatched: int = 0  # new tokens (speculative: calls) that dispatched work will produce
    processed: int = 0  # dispatched calls whose results the host has read
    out: Output | None = None
    done: bool = False
    on_tokens: Callable[[int, list[int]], None] | None = None  # streaming callback (index, new ids)
    t_submit: float = 0.0  # perf_counter at submit
    compile_mark: float = 0.0  # the engine's compile_seconds at submit (compiling is not serving latency)


class Engine:
    def __init__(self, model: Llama, config: EngineConfig = EngineConfig(), *, abstract: bool = False):
        """abstract: device state as shapes only (jax.ShapeDtypeStruct), for an engine that only compiles
        (warm-up worker processes; `model` may then be `abstract_model(cfg)`)."""
        self.abstract = abstract
        self.model_cfg: ModelConfig = model.cfg
        self.cfg = config
        self.mesh = None
        from jeagle.sharding import TP_DRAFT, TP_VOCAB

        if config.tp_vocab not in TP_VOCAB or config.tp_draft not in TP_DRAFT:
            raise ValueError(f"tp_vocab must be one of {TP_VOCAB} and tp_draft one of {TP_DRAFT}; got "
                             f"{config.tp_vocab!r}, {config.tp_draft!r}")
        if config.tp > 1:
            from jeagle.sharding import make_mesh, shard_target

            if abstract:
                raise ValueError("tensor parallelism does not run in warm-up worker processes")
            self.mesh = make_mesh(config.tp)
            model = shard_target(model, self.mesh, config.tp_vocab)
        self.graphdef, self.params = nnx.split(model)
        mc = self.model_cfg
        self.max_ctx = config.max_context or min(mc.max_position_embeddings, 8192)
        self.max_reqs = config.max_batch_size
        if config.mem_fraction_static is not None:
            weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))
            num_slots = slots_for_memory_fraction(mc, config.mem_fraction_static, weight_bytes)
        else:
            # Default: every row can hold a full context (plus a speculative engine's tree slots).
            per_request = max(self.max_ctx, self._slots_needed(self.max_ctx, 1))
            num_slots = (config.max_total_tokens or self.max_reqs * per_request) + 1
        self.allocator = SlotAllocator(num_slots)
        self.cache = self._alloc(lambda: init_cache(mc, num_slots=num_slots, max_reqs=self.max_reqs,
                                                    max_ctx=self.max_ctx))
        r = self.max_reqs + 1
        self.rows = self._alloc(lambda: RowState(
            last_token=jnp.zeros((r,), jnp.int32), temperature=jnp.zeros((r,), jnp.float32),
            top_k=jnp.zeros((r,), jnp.int32), top_p=jnp.ones((r,), jnp.float32), seed=jnp.zeros((r,), jnp.uint32)))
        if self.mesh is not None:
            k, v = self._place_pools(self.cache.k, self.cache.v)
            self.cache = KVCache(k=k, v=v, req_to_token=self._replicated(self.cache.req_to_token))
            self.rows = self._replicated(self.rows)
        self.scratch_row = self.max_reqs
        self.batch_buckets = batch_buckets(self.max_reqs, config)
        self.kv_buckets = kv_buckets(self.max_ctx, config, (mc.head_dim,))
        self.prefill_buckets = pow2_buckets(min(config.min_prefill_bucket, self.max_ctx), self.max_ctx, factor=4)
        self.prefill_batch_buckets = prefill_batch_buckets(self.batch_buckets, config)
        self._free_rows = list(range(self.max_reqs - 1, -1, -1))
        # The scheduler's queues (step()): waiting to be admitted, admitted, dispatched but unread.
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._pending: deque = deque()  # (kind, requests, device result) in dispatch order
        self._next_index = 0
        self._executables: dict[tuple, Callable] = {}
        self.compile_seconds = 0.0
        self._rng = np.random.default_rng()
        self.verify_done = VerifyDone(verify_done_mode(config.verify_done_wait))
        self.warmup_seconds: float | None = None  # set by warmup()
        self._store_obj = None
        self._deferred: list | None = None  # warm-up collects lowerings here to compile them in parallel
        self.reset_stats()

    def _unroll(self, phase: str) -> bool | int:
        """The layer-loop unroll of the "prefill", "step" (target-only decode) or "round" executables."""
        if self.cfg.unroll_layers is None:
            if phase == "prefill":
                return False
            # Per device: a loop's slice copies are of each device's shard of the layer.
            per_device = layer_weight_bytes(self.model_cfg) // self.cfg.tp
            return True if phase == "step" and per_device >= UNROLL_ALL_BYTES else 3
        return self.cfg.unroll_layers

    # ---- tensor parallelism: placement of the device state on the mesh ------------------------------
    def _kv_pools(self) -> tuple:
        """The device KV pools an executable returns (split by KV heads under a mesh)."""
        return (self.cache.k, self.cache.v)

    def _place_pools(self, k, v):
        from jeagle.sharding import shard_pools

        return shard_pools(k, v, self.mesh)

    def _replicated(self, tree):
        from jeagle.sharding import replicate

        return replicate(tree, self.mesh)

    def _out_shardings(self, fn, args):
        """Output shardings that keep the device state where it lives: pools split, everything else
        replicated (an executable's outputs are the next one's inputs)."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        from jeagle.sharding import pool_sharding

        pools = {tuple(x.shape) for x in self._kv_pools()}  # told apart from other outputs by exact shape

        def one(x):
            if tuple(x.shape) in pools:
                return pool_sharding(self.mesh, x.shape)
            return NamedSharding(self.mesh, P())

        return jax.tree.map(one, jax.eval_shape(fn, *args))

    def _alloc(self, make):
        """Device state from `make()`, or only its shapes for an abstract engine."""
        return jax.eval_shape(make) if self.abstract else make()

    # ---- compiled step functions -------------------------------------------------------------
    def _prefill_impl(self, params, cache: KVCache, rows: RowState, tokens, lengths, row_ids, slots, samp):
        """tokens [B,T]; lengths [B]; row_ids [B]; slots = (num_slots [B], flat slot list); samp: per-row params."""
        model = nnx.merge(self.graphdef, params)
        b, t = tokens.shape
        req_to_token, table = assign_rows(cache.req_to_token, row_ids, *slots)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = pos < lengths[:, None]
        attn = AttnInputs(positions=pos, write_slots=jnp.where(valid, table[:, :t], 0),
                          kv_slots=table[:, :t], kv_len=lengths)
        out = model(tokens, attn, cache.k, cache.v, logits_index=jnp.maximum(lengths - 1, 0),
                    unroll=self._unroll("prefill"))
        temperature, top_k, top_p, seed = samp
        # One executable for greedy and sampled rows: the sampler's sort runs once per prefill, not per step.
        tok = sample(out.logits, seed, lengths, temperature, top_k, top_p, all_greedy=False)
        rows = RowState(last_token=rows.last_token.at[row_ids].set(tok),
                        temperature=rows.temperature.at[row_ids].set(temperature),
                        top_k=rows.top_k.at[row_ids].set(top_k), top_p=rows.top_p.at[row_ids].set(top_p),
                        seed=rows.seed.at[row_ids].set(seed))
        return tok, KVCache(k=out.k, v=out.v, req_to_token=req_to_token), rows

    def _decode_impl(self, params, cache: KVCache, rows: RowState, row_ids, positions, *, steps, kv_len, greedy):
        """row_ids [B]; positions [B] of each row's newest token. Returns tokens [B, steps]."""
        model = nnx.merge(self.graphdef, params)
        b = row_ids.shape[0]
        table = cache.req_to_token[row_ids]  # [B, max_ctx]
        kv_slots = table[:, :kv_len]
        temperature, top_k, top_p, seed = (rows.temperature[row_ids], rows.top_k[row_ids],
                                           rows.top_p[row_ids], rows.seed[row_ids])

        def step(s, carry):
            tok, k, v, toks = carry
            pos = positions + s
            # Past a request's last allocated position the table holds the scratch slot 0.
            write = jnp.take_along_axis(table, jnp.minimum(pos, self.max_ctx - 1)[:, None], 1)
            attn = AttnInputs(positions=pos[:, None], write_slots=write, kv_slots=kv_slots, kv_len=pos,
                              extra_slots=write, extra_mask=jnp.ones((b, 1, 1), bool))
            out = model(tok[:, None], attn, k, v, logits_index=jnp.zeros((b,), jnp.int32),
                        unroll=self._unroll("step"))
            nxt = sample(out.logits, seed, pos + 1, temperature, top_k, top_p, all_greedy=greedy)
            return nxt, out.k, out.v, toks.at[:, s].set(nxt)

        carry = (rows.last_token[row_ids], cache.k, cache.v, jnp.zeros((b, steps), jnp.int32))
        if steps == 1:
            tok, k, v, toks = step(0, carry)
        else:
            tok, k, v, toks = jax.lax.fori_loop(0, steps, step, carry)
        rows = RowState(last_token=rows.last_token.at[row_ids].set(tok), temperature=rows.temperature,
                        top_k=rows.top_k, top_p=rows.top_p, seed=rows.seed)
        return toks, KVCache(k=k, v=v, req_to_token=cache.req_to_token), rows

    def _static_description(self) -> str:
        """What, besides argument shapes, decides the compiled code (part of the store's fingerprint)."""
        import dataclasses

        # (tp placements too: the store is off under a mesh, and at tp 1 they change nothing)
        runtime_only = dict(overlap=True, verify_done_wait=None, executable_cache_dir=None, compile_workers=None,
                            compile_processes=None, tp_vocab="shard", tp_draft="auto")
        options = sorted(self._compiler_options(("decode",)).items()) + sorted(self._compiler_options(("prefill",)).items())
        return repr((type(self).__name__, self.model_cfg, dataclasses.replace(self.cfg, **runtime_only), options))

    @property
    def _store(self):
        if self._store_obj is None and self.cfg.executable_cache_dir and self.mesh is None:
            from jeagle.runtime import ExecutableStore, code_fingerprint

            self._store_obj = ExecutableStore(self.cfg.executable_cache_dir, code_fingerprint(self._static_description()))
        return self._store_obj

    def _compile_processes(self, todo: int) -> int:
        """Worker processes for a cold warm-up of `todo` executables (0: threads only). They need the
        store to hand executables back; auto (None) uses them on a GPU for 8 or more, where the
        serial trace + lower on one thread would otherwise dominate."""
        import os

        n = self.cfg.compile_processes
        if n is None:
            n = min(8, os.cpu_count() or 1) if jax.default_backend() == "gpu" and todo >= 8 else 0
        return min(n, todo) if self._store is not None and todo else 0

    def _compiler_options(self, key: tuple) -> dict:
        """XLA options for one executable (per-jit, so nothing leaks into other JAX code): none of our
        own here, plus any from JEAGLE_XLA_OPTIONS."""
        from jeagle.runtime import extra_compiler_options

        return extra_compiler_options()

    def _lower(self, key: tuple, fn, args, donate):
        with warnings.catch_warnings():
            # CPU backends cannot donate; the GPU path does.
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            if self.mesh is None:
                return jax.jit(fn, donate_argnums=donate).lower(*args)
            with jax.set_mesh(self.mesh):  # the context mesh: over_kv_heads' shard_map reads it
                return jax.jit(fn, donate_argnums=donate, out_shardings=self._out_shardings(fn, args)).lower(*args)

    def _executable(self, key: tuple, fn, args, donate=(1, 2)) -> Callable | None:
        """The compiled executable for `key`: from memory, else from the executable store, else compiled
        ahead of time from `args` (and stored). During a warm-up the request is queued instead (the
        warm-up loads and compiles the queue in parallel) and None returned."""
        exe = self._executables.get(key)
        if exe is None:
            if self._deferred is not None:
                self._deferred.append((key, fn, args, donate))
                return None
            t0 = time.perf_counter()
            store = self._store
            exe = store.load(key, args) if store is not None else None
            if exe is None:
                exe = self._lower(key, fn, args, donate).compile(self._compiler_options(key))
                if store is not None:
                    store.save(key, args, exe)
            self.compile_seconds += time.perf_counter() - t0
            self._executables[key] = exe
        return exe

    @property
    def num_compiled(self) -> int:
        return len(self._executables)

    # ---- executables (one per phase x bucket; the same keys for dispatch and warm-up) -------------
    def _prefill_exe(self, b: int, t: int, args):
        return self._executable(("prefill", b, t), self._prefill_impl, args)

    def _decode_exe(self, b: int, kv: int, greedy: bool, args, tier=None):
        assert tier is None, "the autoregressive engine has no speculative tiers"
        steps = self.cfg.decode_steps
        fn = functools.partial(self._decode_impl, steps=steps, kv_len=kv, greedy=greedy)
        return self._executable(("decode", b, steps, kv, greedy), fn, args)

    # ---- dispatch ----------------------------------------------------------------------------
    def _prefill_inputs(self, reqs: list[_Request], b: int, t: int):
        tokens = np.zeros((b, t), np.int32)
        lengths = np.zeros((b,), np.int32)
        row_ids = np.full((b,), self.scratch_row, np.int32)
        temperature = np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        top_p = np.ones((b,), np.float32)
        seed = np.zeros((b,), np.uint32)
        for i, r in enumerate(reqs):
            n = len(r.prompt)
            tokens[i, :n] = r.prompt
            lengths[i] = n
            row_ids[i] = r.row
            temperature[i], top_k[i], top_p[i] = r.params.temperature, r.params.top_k, r.params.top_p
            seed[i] = r.params.seed if r.params.seed is not None else self._rng.integers(0, 2**32)
            r.length = n
            r.dispatched = 1
        slots = flat_slots(b, self.max_ctx, [r.slots for r in reqs])
        return (self.params, self.cache, self.rows, tokens, lengths, row_ids, slots, (temperature, top_k, top_p, seed))

    def _dispatch_prefill(self, reqs: list[_Request]):
        b = pick_bucket(self.prefill_batch_buckets, len(reqs))
        t = pick_bucket(self.prefill_buckets, max(len(r.prompt) for r in reqs))
        args = self._prefill_inputs(reqs, b, t)
        tok, self.cache, self.rows = self._prefill_exe(b, t, args)(*args)
        tok.copy_to_host_async()
        return tok[:, None]

    def _decode_inputs(self, reqs: list[_Request], b: int):
        steps = self.cfg.decode_steps
        row_ids = np.full((b,), self.scratch_row, np.int32)
        positions = np.zeros((b,), np.int32)
        for i, r in enumerate(reqs):
            row_ids[i] = r.row
            positions[i] = r.length
            r.length += steps
            r.dispatched += steps
        return (self.params, self.cache, self.rows, row_ids, positions)

    def _dispatch_decode(self, reqs: list[_Request]):
        b = pick_bucket(self.batch_buckets, len(reqs))
        longest = max(r.length for r in reqs) + self.cfg.decode_steps
        args = self._decode_inputs(reqs, b)
        kv = pick_bucket(self.kv_buckets, min(longest, self.max_ctx))
        toks, self.cache, self.rows = self._decode_exe(b, kv, all(r.params.greedy for r in reqs), args)(*args)
        toks.copy_to_host_async()
        return toks

    # ---- ahead-of-time warm-up ---------------------------------------------------------------
    def warmup_plan(self, batch_sizes=None, prefill_lengths=None, kv_lengths=None, greedy=(True, False)):
        """Every executable generate() can dispatch, restricted to the given sizes: prefill
        ("prefill", b, t, None) over the prefill buckets with b x t <= max_prefill_tokens (any t for
        b = 1, which holds a lone long prompt; greedy and sampled rows share them), then decode / round
        ("decode", b, kv, greedy) for each mode in `greedy` (speculative engines: once per tier,
        ("decode", b, kv, greedy, tier))."""
        def buckets(table, sizes):
            return sorted(set(table if sizes is None else (pick_bucket(table, n) for n in sizes)))

        plan = [("prefill", b, t, None) for b in buckets(self.prefill_batch_buckets, batch_sizes)
                for t in buckets(self.prefill_buckets, prefill_lengths)
                if b == self.prefill_batch_buckets[0] or b * t <= self.cfg.max_prefill_tokens]
        for g in greedy:
            plan += [("decode", b, kv, g) for b in buckets(self.batch_buckets, batch_sizes)
                     for kv in buckets(self.kv_buckets, kv_lengths)]
        return plan

    def warmup(self, batch_sizes=None, prefill_lengths=None, kv_lengths=None, greedy=(True, False),
               progress: bool = True) -> float:
        """Compile ahead of time every executable of `warmup_plan(...)` (default: all of them), with a
        progress bar; afterwards generate() compiles nothing for those shapes (its stats count any
        compilation as `compilations_after_warmup`). Returns the seconds taken (also `warmup_seconds`)."""
        import os
        from concurrent.futures import ThreadPoolExecutor, as_completed

        from tqdm import tqdm

        from jeagle.warmup_workers import compile_in_processes, request

        plan = self.warmup_plan(batch_sizes, prefill_lengths, kv_lengths, greedy)
        workers = self.cfg.compile_workers or min(16, os.cpu_count() or 1)
        t0 = time.perf_counter()
        bar = tqdm(total=len(plan), desc="warm-up", unit="exe", disable=not progress, file=sys.stderr)
        compile0 = self.compile_seconds
        self._deferred = []
        try:
            items = []
            for item in plan:  # queue what is not in memory yet
                queued = len(self._deferred)
                request(self, item)
                items += [item] * (len(self._deferred) - queued)
            jobs, self._deferred = self._deferred, None
            bar.update(len(plan) - len(jobs))
            store = self._store
            todo = [(item, store._path(job[0], job[2]).name) for item, job in zip(items, jobs)
                    if store is not None and not store.has(job[0], job[2])]
            processes = self._compile_processes(len(todo))
            if processes > 1:
                bar.set_postfix_str(f"compiling {len(todo)} in {processes} processes")
                compile_in_processes(self, todo, processes)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                # Stored executables load on the pool; the rest are traced and lowered on this thread
                # (Python holds the GIL) and compiled on the pool (XLA releases it) meanwhile.
                loads = pool.map(lambda job: store.load(job[0], job[2]) if store is not None else None, jobs)
                futures = {}
                for job, exe in zip(jobs, list(loads)):
                    if exe is not None:
                        self._executables[job[0]] = exe
                        bar.update(1)
                    else:
                        lowered = self._lower(*job)
                        futures[pool.submit(lowered.compile, self._compiler_options(job[0]))] = job
                for fut in as_completed(futures):
                    key, _, args, _ = futures[fut]
                    self._executables[key] = exe = fut.result()
                    if store is not None:
                        store.save(key, args, exe)
                    bar.update(1)
                    bar.set_postfix_str(" ".join(str(k) for k in key))
        finally:
            self._deferred = None
            bar.close()
        self.warmup_seconds = time.perf_counter() - t0
        self.compile_seconds = compile0 + self.warmup_seconds  # all of it start-up, none of it serving
        return self.warmup_seconds

    # ---- request lifecycle -------------------------------------------------------------------
    def _make_request(self, index: int, prompt: list[int], params: SamplingParams) -> _Request:
        n = len(prompt)
        if n == 0:
            raise ValueError(f"prompt {index} is empty")
        if n >= self.max_ctx:
            raise PromptTooLong(f"prompt {index} has {n} tokens; the context holds {self.max_ctx} "
                                "(prompt + at least one new token must fit; raise --max-context if the model allows)")
        bad = [t for t in prompt if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside the vocabulary: {bad[:5]}")
        max_new = min(params.max_new_tokens, self.max_ctx - n - self._context_reserve)
        if max_new < 1:
            raise PromptTooLong(f"prompt {index} has {n} tokens; with {self._context_reserve} positions reserved for "
                                f"speculation the context of {self.max_ctx} leaves no room for new tokens")
        need = self._slots_needed(n, max_new)
        if need > self.allocator.num_slots - 1:
            raise OutOfSlots(f"request {index} needs {need} KV slots, the pool has {self.allocator.num_slots - 1}; "
                             "raise --max-total-tokens (or --mem-fraction-static) or lower --max-new-tokens")
        eos = frozenset(() if params.ignore_eos else self.model_cfg.eos_token_ids) | frozenset(params.stop_token_ids)
        return _Request(index=index, prompt=list(prompt), params=params, eos=eos, max_new=max_new,
                        out=Output(prompt_ids=list(prompt)))

    # Speculative engines reserve positions past the last token (tree depth) and extra slots.
    _context_reserve = 0

    def _slots_needed(self, prompt_len: int, max_new: int) -> int:
        return prompt_len + max_new - 1

    def _prefix_bound(self, prompt_len: int, max_new: int) -> int:
        """The longest prefix a decode call for such a request can attend over (what picks its kv bucket)."""
        return min(prompt_len + max_new + self.cfg.decode_steps, self.max_ctx)

    def _admit(self, r: _Request) -> bool:
        need = self._slots_needed(len(r.prompt), r.max_new)
        if not self._free_rows or self.allocator.free_count < need:
            return False
        r.row = self._free_rows.pop()
        r.slots = self.allocator.alloc(need)
        return True

    def _release(self, r: _Request) -> None:
        self.allocator.free(r.slots)
        self._free_rows.append(r.row)
        r.slots = None

    def _accept_tokens(self, r: _Request, toks: np.ndarray) -> None:
        new = []
        for tok in toks:
            if r.done:
                break
            tok = int(tok)
            r.out.token_ids.append(tok)
            new.append(tok)
            if r.out.time_to_first_token_s is None:
                # Compilation (first use of a shape) is not part of serving latency.
                r.out.time_to_first_token_s = time.perf_counter() - r.t_submit - (self.compile_seconds - r.compile_mark)
            if tok in r.eos:
                r.done, r.out.finish_reason = True, "stop"
            elif len(r.out.token_ids) >= r.max_new:
                r.done, r.out.finish_reason = True, "length"
        if new and r.on_tokens is not None:
            r.on_tokens(r.index, new)
        if r.done:
            self._release(r)

    def _wants_step(self, r: _Request) -> bool:
        """Whether r goes into the next decode call (autoregressive: until its last token is dispatched)."""
        return not r.done and r.dispatched < r.max_new

    def _record_verify_done(self, res) -> None:
        """Speculative engines hand each round's verify results to the verify_done wait."""

    def _process(self, kind: str, batch: list[_Request], host: np.ndarray) -> None:
        for i, r in enumerate(batch):
            if not r.done:
                self._accept_tokens(r, host[i])

    # ---- public: step-wise (a server's loop) ----------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams = SamplingParams(),
               on_tokens: Callable[[int, list[int]], None] | None = None, index: int | None = None) -> _Request:
        """Queue one request (checked now: a bad one raises and queues nothing). `step()` admits it
        when a row and its slots are free; its `out` fills as tokens arrive, `done` says when it
        finished; `on_tokens(index, ids)` streams."""
        if index is None:
            index = self._next_index
        self._next_index = max(self._next_index, index + 1)
        r = self._make_request(index, prompt, params)
        r.on_tokens, r.t_submit, r.compile_mark = on_tokens, time.perf_counter(), self.compile_seconds
        self._waiting.append(r)
        return r

    def abort(self, r: _Request) -> None:
        """Stop a request now: it leaves the queue or the batch, its row and slots are free at once
        (rounds already in flight still write them, but anything that reuses them is dispatched
        after), tokens still in flight for it are dropped. finish_reason "abort"."""
        if r.done:
            return
        r.done, r.out.finish_reason = True, "abort"
        if r in self._waiting:
            self._waiting.remove(r)
        elif r.slots is not None:
            self._release(r)
        self._running = [x for x in self._running if x is not r]

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def step(self) -> None:
        """One scheduler step: the verify_done wait, admission and prefill of what fits, one decode
        step or round over the live batch (dispatched before the previous one is processed, with
        overlap), and processing of the results that are due."""
        waiting, running, pending, acct = self._waiting, self._running, self._pending, self._acct
        # The next host step starts with the wait on the last round's verify results (sync: hard).
        blocked = self.verify_done.wait()
        # Admit what fits, in arrival order, and prefill it in groups of bounded padded size.
        group: list[_Request] = []
        group_longest = 0
        while waiting and len(running) + len(group) < self.max_reqs:
            nxt = waiting[0]
            longest = max(group_longest, len(nxt.prompt))
            padded = (pick_bucket(self.prefill_batch_buckets, len(group) + 1)
                      * pick_bucket(self.prefill_buckets, longest))
            if group and padded > self.cfg.max_prefill_tokens:
                pending.append(("prefill", group, self._dispatch_prefill(group)))
                running += group
                group, group_longest = [], 0
                continue
            if not self._admit(nxt):
                break
            group.append(waiting.popleft())
            group_longest = longest
        if group:
            pending.append(("prefill", group, self._dispatch_prefill(group)))
            running += group
        if waiting and not running and not pending:
            r = waiting.popleft()
            r.done, r.out.finish_reason = True, "abort"
            raise OutOfSlots(f"cannot admit request {r.index} although nothing is running (it was dropped)")

        live = [r for r in running if self._wants_step(r)]
        if live:
            acct["buckets_used"].add(pick_bucket(self.batch_buckets, len(live)))
            res = self._dispatch_decode(live)
            pending.append(("step", live, res))
            self._record_verify_done(res)
        # Overlap: keep this step in flight while the host processes the previous one; without
        # overlap (or with nothing more to dispatch) process everything now.
        keep = 1 if live and self.cfg.overlap else 0
        while len(pending) > keep:
            kind, batch, toks = pending.popleft()
            t1 = time.perf_counter()
            host = np.asarray(toks)  # its copy started at dispatch: this waits only if it is not done
            blocked += time.perf_counter() - t1
            self._process(kind, batch, host)
        if live:
            acct["blocked_per_step"].append(blocked)
        self._running = [r for r in running if not r.done]
        if not self.has_work:
            self.verify_done.wait()  # nothing may stay pending once idle

    def reset_stats(self) -> None:
        """Start a new accounting window for `stats()`."""
        self._acct = {"t0": time.perf_counter(), "compile0": self.compile_seconds, "compiled0": self.num_compiled,
                      "blocked_per_step": [], "buckets_used": set()}

    def stats(self, reqs: list[_Request]) -> dict:
        """Stats of the window since `reset_stats()` for the requests `reqs`."""
        acct = self._acct
        wall = time.perf_counter() - acct["t0"] - (self.compile_seconds - acct["compile0"])
        compiled = self.num_compiled - acct["compiled0"]
        return {
            "prompt_tokens": sum(len(r.prompt) for r in reqs),
            "new_tokens": sum(len(r.out.token_ids) for r in reqs),
            "wall_s": wall,
            "compile_s": self.compile_seconds - acct["compile0"],
            "compilations": compiled,
            "compilations_after_warmup": compiled if self.warmup_seconds is not None else None,
            "warmup_s": self.warmup_seconds,
            "steps": len(acct["blocked_per_step"]),
            "host_blocked_ms": latency_stats(acct["blocked_per_step"]),
            "buckets_used": sorted(acct["buckets_used"]),
            "overlap": self.cfg.overlap,
            "verify_done_wait": self.verify_done.mode,
            "executables_from_store": self._store.loaded if self._store is not None else None,  # engine lifetime
        }

    # ---- public: all at once -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Output]:
        """Run every prompt to completion; outputs in prompt order. `on_tokens(index, ids)` streams
        (index: the prompt's position). Built on submit() / step(); the stats land in `last_stats`."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        if self.has_work:
            raise RuntimeError("generate() on an engine with requests in flight; finish them with step() first")
        # Check every prompt before queueing any: a bad one fails the call and loses nothing.
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self._make_request(i, p, sp)
        self.reset_stats()
        reqs = [self.submit(p, sp, on_tokens, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
        try:
            while self.has_work:
                self.step()
        except BaseException:
            for r in reqs:  # leave the engine idle and its slots free
                self.abort(r)
            self._pending.clear()
            self.verify_done.wait()
            raise
        self.last_stats = self.stats(reqs)
        return [r.out for r in reqs]
