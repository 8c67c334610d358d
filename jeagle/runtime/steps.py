"""Target-only decoding as pure step functions: prefill and decode over one donated device state.

    prefill_step(key, graphdef, params, state, inputs) -> (tokens [B, 1], state)
    decode_step(key, graphdef, params, state, inputs)  -> (tokens [B, steps], state)

A key with `logprobs` appends each token's packed log-probabilities to its row
(`jeagle.sampling.logprobs.pack`: [B, W + W·LOGPROB_COLUMNS] for W tokens).

The key (`PrefillKey`, `DecodeKey`: frozen, hashable) holds everything static — the model config,
state sizes, buckets, layer unrolling, kernel settings — and is the executable's key
(`jeagle.runtime.executables`): nothing is read from anywhere else while tracing.

Device state (`TargetState`, donated through every call, never copied):
    cache   KVCache: slot pools + req_to_token (jeagle/runtime/kv_cache.py)
    rows    RowState: per request row, the newest token (its KV not yet written) and sampling params
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jeagle.runtime.kv_cache import SCRATCH_SLOT, KVCache, assign_rows, init_cache
from jeagle.config import ModelConfig
from jeagle.kernels.settings import KernelSettings
from jeagle.sampling.grammar import apply_token_mask, mask_words
from jeagle.sampling.logprobs import LOGPROB_COLUMNS, pack, prompt_logprobs, token_logprobs
from jeagle.sampling.penalties import (PenaltyInputs, PenaltyRows, add_tokens, apply as apply_penalties,
                              gather as gather_penalties, init_penalty_rows, penalty_shapes, prefill_rows)
from jeagle.models.common import AttnInputs
from jeagle.runtime.executables import DeviceShapes, StepBuild, compiler_options, param_step
from jeagle.runtime.packing import Layout
from jeagle.sampling import sample

UNROLL_ALL_BYTES = 32 << 20  # one layer's weights per device above which the decode step unrolls every layer


def layer_weight_bytes(cfg) -> int:
    """Bytes of one decoder layer's matmul weights (q|k|v, o, gate|up, down) in the model's dtype."""
    h = cfg.hidden_size
    n = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return n * jnp.dtype(cfg.dtype).itemsize


# Prefills of at most this many padded tokens (b x t) run 3 layers per loop iteration, as decode steps
# and rounds do (`layer_unroll("small_prefill")`): the prefill after a prefix-cache hit, a lone short
# prompt. The host walks a layer loop's iterations launching their kernels, and for a small prefill
# that launching is its time: a 64-token prefill after a 1,238-token cached prefix took 4.0 ms of host
# dispatch with the plain loop, 2.6 ms with 3 layers per iteration, 2.1 ms unrolled, for a warm-up
# compile of 6.2 / 6.4 / 19.7 s (H200, bench/HISTORY.md, 2026-11-26). On a GPU only.
SMALL_PREFILL_TOKENS = 256


def layer_unroll(phase: str, config, model_cfg) -> bool | int:
    """The layer-loop unroll of the "prefill", "small_prefill" (`SMALL_PREFILL_TOKENS`), "step"
    (target-only decode) or "round" executables (EngineConfig.unroll_layers and step_unroll_layers;
    None: see there)."""
    if phase in ("step", "round") and config.step_unroll_layers is not None:
        return config.step_unroll_layers
    if config.unroll_layers is not None:
        return config.unroll_layers
    if phase == "prefill":
        return False
    if phase == "small_prefill":  # a CPU launches no kernels: the plain loop compiles faster, runs as fast
        return 3 if jax.default_backend() == "gpu" else False
    # Per device: a loop's slice copies are of each device's shard of the layer.
    per_device = layer_weight_bytes(model_cfg) // config.tp
    return True if phase == "step" and per_device >= UNROLL_ALL_BYTES else 3


@jax.tree_util.register_dataclass
@dataclass
class RowState:
    last_token: jax.Array  # [R] int32  newest token of each row, its KV not yet written
    temperature: jax.Array  # [R] f32
    top_k: jax.Array  # [R] int32
    top_p: jax.Array  # [R] f32
    seed: jax.Array  # [R] uint32


@jax.tree_util.register_dataclass
@dataclass
class TargetState:
    cache: KVCache
    rows: RowState
    penalties: PenaltyRows  # jeagle/sampling/penalties.py


def init_state(cfg: ModelConfig, *, num_slots: int, max_reqs: int, max_ctx: int) -> TargetState:
    r = max_reqs + 1  # the last row is the scratch row
    rows = RowState(last_token=jnp.zeros((r,), jnp.int32), temperature=jnp.zeros((r,), jnp.float32),
                    top_k=jnp.zeros((r,), jnp.int32), top_p=jnp.ones((r,), jnp.float32),
                    seed=jnp.zeros((r,), jnp.uint32))
    return TargetState(init_cache(cfg, num_slots=num_slots, max_reqs=max_reqs, max_ctx=max_ctx), rows,
                       init_penalty_rows(r, cfg.vocab_size))


@jax.tree_util.register_dataclass
@dataclass
class Sampling:
    """Per-row sampling parameters of a prefill [B]."""
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array


@jax.tree_util.register_dataclass
@dataclass
class PrefillInputs:
    tokens: jax.Array  # [B, T] prompts, 0 padded
    lengths: jax.Array  # [B] tokens to prefill (0: a padding row)
    starts: jax.Array  # [B] the position of each row's first token (a cached prefix's length; 0 without a key context)
    row_ids: jax.Array  # [B] request rows (padding: the scratch row)
    slot_count: jax.Array  # [B] position slots of each request
    slot_flat: jax.Array  # [B * max_ctx] their slots back to back (runtime.slots.flat_slots)
    sampling: Sampling
    penalties: PenaltyInputs
    token_mask: jax.Array  # [B, W] int32 bitmask of the tokens the first may be (jeagle/sampling/grammar.py; -1: any)


@jax.tree_util.register_dataclass
@dataclass
class DecodeInputs:
    row_ids: jax.Array  # [B]
    positions: jax.Array  # [B] position of each row's newest token


@dataclass(frozen=True)
class TargetStatic:
    """What every executable of one target-only decoder shares."""
    model: ModelConfig
    max_reqs: int
    max_ctx: int
    num_slots: int
    unroll_prefill: bool | int
    unroll_step: bool | int
    kernels: KernelSettings
    unroll_small_prefill: bool | int = False  # prefills of b x t <= SMALL_PREFILL_TOKENS (`prefill_unroll`)

    def shapes(self) -> DeviceShapes:
        """The device shapes these configs imply (no arrays allocated): for worker processes."""
        from jeagle.models.llama import abstract_model

        graphdef, params = nnx.split(abstract_model(self.model))
        state = jax.eval_shape(functools.partial(init_state, self.model, num_slots=self.num_slots,
                                                 max_reqs=self.max_reqs, max_ctx=self.max_ctx))
        return DeviceShapes.of((graphdef,), params, state)


@functools.lru_cache(maxsize=None)
def input_layout(key) -> Layout:
    """How a step key's host inputs (`key.inputs()`) are packed into its one input vector."""
    return Layout.of(key.inputs())


def _abstract(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def sampling_shapes(b: int) -> Sampling:
    return Sampling(_abstract((b,), jnp.float32), _abstract((b,), jnp.int32), _abstract((b,), jnp.float32),
                    _abstract((b,), jnp.uint32))


class _TargetKey:
    """What the target-only step keys share: their kernel settings and XLA options come from `static`."""

    @property
    def kernels(self) -> KernelSettings:
        return self.static.kernels

    def compiler_options(self) -> dict:
        # The prefill compiles like the speculative prefill (cuBLAS matmuls): the first token of a
        # request is then the same computation with and without a draft, so the two agree on it even
        # in bf16 (a Triton GEMM fusion here rounded differently and parted them at near ties).
        return compiler_options(self.static.kernels, cublas_only=self.phase == "prefill")


def prefill_attn(table, starts, lengths, t: int, context: int) -> tuple[AttnInputs, jax.Array]:
    """(AttnInputs, positions [B, t]) of a prefill of `lengths` tokens per row (padded to t) from
    position `starts`. context 0: every row starts at 0 and attends over its own t tokens (the plain
    prefill); else rows continue a cached prefix and attend over positions [0, context) of their
    slot-table rows, causally (`context` >= every start + length: a prefill-length bucket)."""
    b = lengths.shape[0]
    j = jnp.arange(t, dtype=jnp.int32)
    if not context:
        pos = jnp.broadcast_to(j, (b, t))
        valid = pos < lengths[:, None]
        return AttnInputs(positions=pos, write_slots=jnp.where(valid, table[:, :t], SCRATCH_SLOT),
                          kv_slots=table[:, :t], kv_len=lengths), pos
    pos = starts[:, None] + j[None, :]
    valid = j[None, :] < lengths[:, None]
    write = jnp.take_along_axis(table, jnp.minimum(pos, table.shape[1] - 1), 1)
    return AttnInputs(positions=pos, write_slots=jnp.where(valid, write, SCRATCH_SLOT), kv_slots=table[:, :context],
                      kv_len=starts + lengths), pos


@dataclass(frozen=True)
class PrefillKey(_TargetKey):
    static: TargetStatic
    batch: int
    length: int
    logprobs: bool = False
    prompt_logprobs: bool = False  # also the prompt tokens' logprobs (`jeagle.sampling.logprobs.prompt_logprobs`)
    context: int = 0  # > 0: rows continue cached prefixes, attending over this many positions (`prefill_attn`)
    phase = "prefill"

    @property
    def label(self) -> str:
        return (f"prefill-b{self.batch}-t{self.length}{f'-c{self.context}' if self.context else ''}"
                f"{'-lp' if self.logprobs else ''}{'-plp' if self.prompt_logprobs else ''}")

    def inputs(self) -> PrefillInputs:
        """The executable's inputs as shapes (passed packed: `layout`)."""
        b, t, ctx = self.batch, self.length, self.static.max_ctx
        return PrefillInputs(_abstract((b, t), jnp.int32), _abstract((b,), jnp.int32), _abstract((b,), jnp.int32),
                             _abstract((b,), jnp.int32),
                             _abstract((b,), jnp.int32), _abstract((b * ctx,), jnp.int32), sampling_shapes(b),
                             penalty_shapes(b), _abstract((b, mask_words(self.static.model.vocab_size)), jnp.int32))

    def build(self, shapes: DeviceShapes) -> StepBuild:
        layout = input_layout(self)
        fn = layout.wrap(functools.partial(prefill_step, self, shapes.graphdefs[0]))
        return param_step(fn, shapes, layout.abstract)


@dataclass(frozen=True)
class DecodeKey(_TargetKey):
    static: TargetStatic
    batch: int
    kv_len: int
    steps: int
    greedy: bool
    logprobs: bool = False
    penalties: bool = False  # apply the rows' penalties and count the tokens (jeagle/sampling/penalties.py)
    grammar: bool = False  # inputs (DecodeInputs, token masks [B, W]) (jeagle/sampling/grammar.py); one step
    phase = "decode"

    def __post_init__(self):
        if self.grammar and self.steps != 1:
            raise ValueError("a grammar decode step decodes one token (the host computes each next mask)")

    @property
    def label(self) -> str:
        return (f"decode-b{self.batch}-s{self.steps}-kv{self.kv_len}-{'greedy' if self.greedy else 'sampled'}"
                f"{'-lp' if self.logprobs else ''}{'-pen' if self.penalties else ''}{'-gram' if self.grammar else ''}")

    def build(self, shapes: DeviceShapes) -> StepBuild:
        b = self.batch
        fn = functools.partial(decode_step, self, shapes.graphdefs[0])
        inputs = DecodeInputs(_abstract((b,), jnp.int32), _abstract((b,), jnp.int32))
        if self.grammar:
            inputs = (inputs, _abstract((b, mask_words(self.static.model.vocab_size)), jnp.int32))
        return param_step(fn, shapes, inputs)


def prefill_unroll(static, b: int, t: int) -> bool | int:
    """The layer unroll of a (b, t) prefill executable of a decoder with statics `static`."""
    return static.unroll_small_prefill if b * t <= SMALL_PREFILL_TOKENS else static.unroll_prefill


def prefill_step(key: PrefillKey, graphdef, params, state: TargetState, inputs: PrefillInputs):
    """The prompts' KV written, each row's first token sampled. Returns (tokens [B, 1] (with
    `key.logprobs` their packed logprobs appended, then with `key.prompt_logprobs` the prompts'),
    state)."""
    model = nnx.merge(graphdef, params)
    tokens, lengths, row_ids, s = inputs.tokens, inputs.lengths, inputs.row_ids, inputs.sampling
    b, t = tokens.shape
    cache = state.cache
    req_to_token, table = assign_rows(cache.req_to_token, row_ids, inputs.slot_count, inputs.slot_flat)
    attn, pos = prefill_attn(table, inputs.starts, lengths, t, key.context)
    out = model(tokens, attn, cache.k, cache.v, logits_index=jnp.maximum(lengths - 1, 0),
                unroll=prefill_unroll(key.static, b, t))
    total = inputs.starts + lengths  # the sequence's length: the sampled token's position
    # The rows' penalties written and applied (neutral ones leave the logits as they are).
    pen = prefill_rows(state.penalties, row_ids, inputs.penalties, tokens, lengths, pos)
    logits = apply_penalties(out.logits, gather_penalties(pen, row_ids),
                             jnp.maximum(total - inputs.penalties.prompt_len, 0))
    logits = apply_token_mask(logits, inputs.token_mask)
    # One executable for greedy and sampled rows: the sampler's sort runs once per prefill, not per step.
    tok = sample(logits, s.seed, total, s.temperature, s.top_k, s.top_p, all_greedy=False)
    pen = add_tokens(pen, row_ids, tok[:, None])
    r = state.rows
    rows = RowState(last_token=r.last_token.at[row_ids].set(tok), temperature=r.temperature.at[row_ids].set(s.temperature),
                    top_k=r.top_k.at[row_ids].set(s.top_k), top_p=r.top_p.at[row_ids].set(s.top_p),
                    seed=r.seed.at[row_ids].set(s.seed))
    res = tok[:, None]
    if key.logprobs:
        res = pack(res, token_logprobs(out.logits, tok)[:, None])
    if key.prompt_logprobs:
        res = pack(res, prompt_logprobs(out.hidden, model.embed[...] if model.lm_head is None else model.lm_head[...],
                                        tokens))
    return res, TargetState(KVCache(k=out.k, v=out.v, req_to_token=req_to_token), rows, pen)


def decode_step(key: DecodeKey, graphdef, params, state: TargetState, inputs: DecodeInputs):
    """`key.steps` tokens for each row. Returns (tokens [B, steps] (with `key.logprobs` their packed
    logprobs appended), state)."""
    model = nnx.merge(graphdef, params)
    mask = None
    if key.grammar:
        inputs, mask = inputs
    row_ids, positions = inputs.row_ids, inputs.positions
    cache, r = state.cache, state.rows
    b, max_ctx = row_ids.shape[0], key.static.max_ctx
    table = cache.req_to_token[row_ids]  # [B, max_ctx]
    kv_slots = table[:, :key.kv_len]
    temperature, top_k, top_p, seed = r.temperature[row_ids], r.top_k[row_ids], r.top_p[row_ids], r.seed[row_ids]

    pen = gather_penalties(state.penalties, row_ids) if key.penalties else None

    def step(s, carry):
        tok, k, v, toks, lps, counts = carry
        pos = positions + s
        # Past a request's last allocated position the table holds the scratch slot.
        write = jnp.take_along_axis(table, jnp.minimum(pos, max_ctx - 1)[:, None], 1)
        attn = AttnInputs(positions=pos[:, None], write_slots=write, kv_slots=kv_slots, kv_len=pos,
                          extra_slots=write, extra_mask=jnp.ones((b, 1, 1), bool))
        out = model(tok[:, None], attn, k, v, logits_index=jnp.zeros((b,), jnp.int32), unroll=key.static.unroll_step)
        logits = out.logits
        if key.penalties:  # the fed token at `pos` is the request's (pos - prompt_len + 1)-th
            logits = apply_penalties(logits, dataclasses.replace(pen, counts=counts), pos - pen.prompt_len + 1)
        if mask is not None:
            logits = apply_token_mask(logits, mask)
        nxt = sample(logits, seed, pos + 1, temperature, top_k, top_p, all_greedy=key.greedy)
        if key.penalties:
            counts = counts.at[jnp.arange(b), nxt].add(1)
        if key.logprobs:
            lps = lps.at[:, s].set(token_logprobs(out.logits, nxt))
        return nxt, out.k, out.v, toks.at[:, s].set(nxt), lps, counts

    lps = jnp.zeros((b, key.steps, LOGPROB_COLUMNS if key.logprobs else 0), jnp.int32)
    counts = pen.counts if key.penalties else jnp.zeros((b, 0), jnp.int32)
    carry = (r.last_token[row_ids], cache.k, cache.v, jnp.zeros((b, key.steps), jnp.int32), lps, counts)
    if key.steps == 1:
        tok, k, v, toks, lps, counts = step(0, carry)
    else:
        tok, k, v, toks, lps, counts = jax.lax.fori_loop(0, key.steps, step, carry)
    penalties = state.penalties
    if key.penalties:
        penalties = dataclasses.replace(penalties, counts=penalties.counts.at[row_ids].set(counts))
    if key.logprobs:
        toks = pack(toks, lps)
    rows = RowState(last_token=r.last_token.at[row_ids].set(tok), temperature=r.temperature, top_k=r.top_k,
                    top_p=r.top_p, seed=r.seed)
    return toks, TargetState(KVCache(k=k, v=v, req_to_token=cache.req_to_token), rows, penalties)
