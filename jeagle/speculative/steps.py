"""EAGLE decoding as pure step functions over one donated device state (`SpecState`).

    spec_prefill_step   the target over the prompts, the first token sampled, then the draft extended
                        over positions 0..L-1 with the pairs (token t+1, target feature t), leaving
                        the draft's top-K and feature for the first round
    round_step          one `spec_round` (draft → tree → verify → accept → commit → extend)
    draft_step, verify_step   the same round as two executables (a measurement mode)
    draft_step, verify_forward_step, accept_step   the round as three executables: the host computes
                        the tree's grammar masks while the device runs the verify's forward

Each returns (result, state); a result is `round.pack_result`'s [B, W + 2 (+ T)] array (T: the key's
nested tiers; the split round's draft step returns the tree), with a key's `logprobs` followed by the
W tokens' packed logprobs (`jeagle.sampling.logprobs`). The keys (frozen, hashable) hold everything static and are the
executables' keys (`jeagle.runtime.executables`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jeagle.runtime.kv_cache import KVCache, assign_rows, init_cache, init_pools
from jeagle.config import DraftConfig, ModelConfig
from jeagle.kernels.settings import KernelSettings
from jeagle.sampling.grammar import apply_token_mask, mask_words, masks_from_ids
from jeagle.sampling.grammar_walk import CANDIDATES
from jeagle.sampling.logprobs import pack, prompt_logprobs, token_logprobs, top_k_blocked
from jeagle.models.llama import ForwardOut
from jeagle.sampling.penalties import (PenaltyInputs, PenaltyRows, add_tokens, apply as apply_penalties,
                              gather as gather_penalties, init_penalty_rows, penalty_shapes, prefill_rows)
from jeagle.runtime.executables import DeviceShapes, StepBuild, compiler_options, param_step
from jeagle.runtime.steps import Sampling, input_layout, prefill_attn, prefill_unroll, sampling_shapes
from jeagle.sampling import sample
from jeagle.speculative.round import (MAX_STOP, RowLayout, SpecConfig, SpecRows, draft_topk, draft_tree, draft_vocab_ids, init_rows,
                               pack_result, pad_columns, spec_round, verify_commit, verify_forward)


@jax.tree_util.register_dataclass
@dataclass
class SpecState:
    cache: KVCache  # the target's pools and the slot table
    draft_k: jax.Array  # [L_draft, num_slots, kv_heads, head_dim]: the draft's pools, same slot ids
    draft_v: jax.Array
    rows: SpecRows
    penalties: PenaltyRows  # jeagle/sampling/penalties.py


def init_state(model: ModelConfig, draft: DraftConfig, layout: RowLayout, *, num_slots: int, max_reqs: int,
               max_ctx: int) -> SpecState:
    dk, dv = init_pools(draft, num_slots=num_slots)
    rows = init_rows(max_reqs + 1, layout, draft.hidden_size, jnp.dtype(draft.dtype))
    return SpecState(init_cache(model, num_slots=num_slots, max_reqs=max_reqs, max_ctx=max_ctx), dk, dv, rows,
                     init_penalty_rows(max_reqs + 1, model.vocab_size))


@jax.tree_util.register_dataclass
@dataclass
class SpecPrefillInputs:
    tokens: jax.Array  # [B, T]
    lengths: jax.Array  # [B]
    starts: jax.Array  # [B] the position of each row's first token (runtime/steps.py `prefill_attn`)
    row_ids: jax.Array  # [B]
    slot_count: jax.Array  # [B]
    slot_flat: jax.Array  # [B * max_ctx]
    tree_slots: jax.Array  # [B, N_max]
    scratch_slots: jax.Array  # [B, scratch_max]
    sampling: Sampling
    max_new: jax.Array  # [B]
    stop_ids: jax.Array  # [B, MAX_STOP], -1 padded
    penalties: PenaltyInputs
    token_mask: jax.Array  # [B, W] int32 bitmask of the tokens the first may be (jeagle/sampling/grammar.py; -1: any)


@dataclass(frozen=True)
class SpecStatic:
    """What every executable of one speculative decoder shares."""
    model: ModelConfig
    draft: DraftConfig
    layout: RowLayout  # row widths covering every tier
    max_reqs: int
    max_ctx: int
    num_slots: int
    unroll_prefill: bool | int
    unroll_round: bool | int
    kernels: KernelSettings
    simulate_accept: float = 0.0  # bench only: a forced accept length (round.verify_commit)
    unroll_small_prefill: bool | int = False  # prefills of b x t <= SMALL_PREFILL_TOKENS (runtime/steps.py)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.draft.aux_layer_ids) if self.draft.kind == "eagle3" else ()

    def shapes(self) -> DeviceShapes:
        """The device shapes these configs imply (no arrays allocated): for worker processes."""
        from jeagle.models.common import abstract_module
        from jeagle.models.eagle import EagleHead
        from jeagle.models.llama import abstract_model

        graphdef, params = nnx.split(abstract_model(self.model))
        dgraphdef, dparams = nnx.split(abstract_module(EagleHead, self.draft))
        state = jax.eval_shape(functools.partial(init_state, self.model, self.draft, self.layout,
                                                 num_slots=self.num_slots, max_reqs=self.max_reqs,
                                                 max_ctx=self.max_ctx))
        return DeviceShapes.of((graphdef, dgraphdef), (params, dparams), state)


def _abstract(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@dataclass(frozen=True)
class _SpecKey:
    static: SpecStatic

    @property
    def kernels(self) -> KernelSettings:
        return self.static.kernels

    def compiler_options(self) -> dict:
        return compiler_options(self.static.kernels, cublas_only=True)

    def _build(self, step, shapes: DeviceShapes, inputs) -> StepBuild:
        fn = functools.partial(step, self, *shapes.graphdefs)
        return param_step(fn, shapes, inputs)


@dataclass(frozen=True)
class SpecPrefillKey(_SpecKey):
    batch: int
    length: int
    logprobs: bool = False
    prompt_logprobs: bool = False  # also the prompt tokens' logprobs (`jeagle.sampling.logprobs.prompt_logprobs`)
    context: int = 0  # > 0: rows continue cached prefixes (runtime/steps.py `prefill_attn`)
    phase = "prefill"

    @property
    def label(self) -> str:
        return (f"spec_prefill-b{self.batch}-t{self.length}{f'-c{self.context}' if self.context else ''}"
                f"{'-lp' if self.logprobs else ''}{'-plp' if self.prompt_logprobs else ''}")

    def inputs(self) -> SpecPrefillInputs:
        """The executable's inputs as shapes (passed packed: runtime/steps.py `input_layout`)."""
        b, t, s = self.batch, self.length, self.static
        return SpecPrefillInputs(_abstract((b, t)), _abstract((b,)), _abstract((b,)), _abstract((b,)), _abstract((b,)),
                                 _abstract((b * s.max_ctx,)), _abstract((b, s.layout.num_draft_tokens)),
                                 _abstract((b, s.layout.scratch)), sampling_shapes(b), _abstract((b,)),
                                 _abstract((b, MAX_STOP)), penalty_shapes(b),
                                 _abstract((b, mask_words(s.model.vocab_size))))

    def build(self, shapes: DeviceShapes) -> StepBuild:
        layout = input_layout(self)
        fn = layout.wrap(functools.partial(spec_prefill_step, self, *shapes.graphdefs))
        return param_step(fn, shapes, layout.abstract)


@dataclass(frozen=True)
class RoundKey(_SpecKey):
    tier: SpecConfig
    batch: int
    kv_len: int
    greedy: bool
    # "round" (fused) | "verify" (the split round's second half) | the round in two halves, for
    # grammar masks computed on the host between them: "verify_forward" (the draft, then the target
    # over its tree; inputs row_ids, result (tree, `VerifyForward`)) and "accept" (inputs
    # (row_ids, tree, VerifyForward, token masks [B, N, W]))
    phase: str = "round"
    rounds: int = 1  # rounds per dispatch, run on the device (fused rounds only)
    # rounds > 1: the rounds written out one after another in the executable (every dispatch runs all
    # of them; a row's rounds after it finished emit nothing) instead of a `lax.while_loop` that stops
    # once every row finished (XLA's GPU runtime reads a while loop's predicate back to the host each
    # iteration and runs its body outside the command buffer).
    unrolled: bool = False
    logprobs: bool = False  # the emitted tokens' logprobs appended to the result
    penalties: bool = False  # the rows' penalties applied in the verify (jeagle/sampling/penalties.py)
    grammar: bool = False  # accept only: token masks among the inputs (jeagle/sampling/grammar.py)
    # accept only: the masks as token ids [B, N, CANDIDATES] (-1 padded; a node of -1s allows every token)
    # instead of bitmasks [B, N, W]: batches whose grammar rows the host walked (`grammar_walk.walk_nodes`)
    compact: bool = False
    # Fused rounds: (S', N') of tiers nested in this one (same K, S' <= S) whose would-be accept
    # lengths the result carries (`round.nested_accepts`; the adaptive throughput policy reads them).
    nested: tuple[tuple[int, int], ...] = ()
    # Fused rounds: the result's columns padded to this many with -1 (0: the tier's own), so every
    # tier of an adaptive decoder returns one shape (`round.pad_columns`).
    width: int = 0

    def __post_init__(self):
        if self.phase not in ("round", "verify", "verify_forward", "accept"):
            raise ValueError(f"unknown round phase {self.phase!r}")
        if self.nested and self.phase != "round":
            raise ValueError("nested tiers' accept lengths come from fused rounds only")
        s, _, n = self.tier.shape
        if any(not (1 <= s_j <= s and 2 <= n_j) for s_j, n_j in self.nested):
            raise ValueError(f"nested tiers {self.nested} must have 1 <= S' <= {s} and N' >= 2")
        if self.width and self.phase != "round":
            raise ValueError("padded results come from fused rounds only")
        if self.phase != "round" and self.rounds != 1:
            raise ValueError("a split round runs one round per dispatch")
        if self.unrolled and self.rounds == 1:
            raise ValueError("unrolled rounds need rounds > 1")
        if self.grammar != (self.phase == "accept"):
            raise ValueError("grammar masks come between the verify's forward and its accept (phase 'accept')")
        if self.compact and not self.grammar:
            raise ValueError("compact masks are a grammar accept's")

    @property
    def label(self) -> str:
        s, k, n = self.tier.shape
        r = f"-r{self.rounds}{'u' if self.unrolled else ''}" if self.rounds > 1 else ""
        lp = ("-lp" if self.logprobs else "") + ("-pen" if self.penalties else "") + ("-gram" if self.grammar else "")
        lp += "-ids" if self.compact else ""
        lp += "".join(f"-in{s_j}n{n_j}" for s_j, n_j in self.nested) + (f"-w{self.width}" if self.width else "")
        return f"{self.phase}-b{self.batch}-kv{self.kv_len}-{'greedy' if self.greedy else 'sampled'}-s{s}k{k}n{n}{r}{lp}"

    def build(self, shapes: DeviceShapes) -> StepBuild:
        rows = _abstract((self.batch,))
        if self.phase == "round":
            return self._build(round_step, shapes, rows)
        if self.phase == "verify_forward":
            return self._build(verify_forward_step, shapes, rows)
        if self.phase == "verify":
            tree = jax.eval_shape(functools.partial(draft_step, DraftKey(self.static, self.tier, self.batch,
                                                                         self.kv_len), *shapes.graphdefs),
                                  shapes.params, shapes.state, rows)[0]
            return self._build(verify_step, shapes, (rows, tree))
        tree, fwd = jax.eval_shape(functools.partial(verify_forward_step, self.forward_key(), *shapes.graphdefs),
                                   shapes.params, shapes.state, rows)[0]
        width = CANDIDATES if self.compact else mask_words(self.static.model.vocab_size)
        masks = _abstract((self.batch, self.tier.num_draft_tokens, width))
        return self._build(accept_step, shapes, (rows, tree, fwd, masks))

    def forward_key(self) -> "RoundKey":
        """The "verify_forward" key (draft and forward) an "accept" key follows (one executable for every
        sampling mode)."""
        return RoundKey(self.static, self.tier, self.batch, self.kv_len, True, phase="verify_forward")


@dataclass(frozen=True)
class DraftKey(_SpecKey):
    tier: SpecConfig
    batch: int
    kv_len: int
    phase = "draft"

    @property
    def label(self) -> str:
        s, k, n = self.tier.shape
        return f"draft-b{self.batch}-kv{self.kv_len}-s{s}k{k}n{n}"

    def build(self, shapes: DeviceShapes) -> StepBuild:
        return self._build(draft_step, shapes, _abstract((self.batch,)))


def spec_prefill_step(key: SpecPrefillKey, graphdef, draft_graphdef, params, state: SpecState,
                      inputs: SpecPrefillInputs):
    target = nnx.merge(graphdef, params[0])
    head = nnx.merge(draft_graphdef, params[1])
    static, cache, x = key.static, state.cache, inputs
    tokens, lengths, row_ids = x.tokens, x.lengths, x.row_ids
    b, t = tokens.shape
    req_to_token, table = assign_rows(cache.req_to_token, row_ids, x.slot_count, x.slot_flat)
    attn, pos = prefill_attn(table, x.starts, lengths, t, key.context)
    last = jnp.maximum(lengths - 1, 0)
    out = target(tokens, attn, cache.k, cache.v, logits_index=last, aux_layers=static.aux_layers,
                 unroll=prefill_unroll(static, b, t))
    s = x.sampling
    total = x.starts + lengths  # the sequence's length: the first new token's position
    generated = jnp.maximum(total - x.penalties.prompt_len, 0)  # > 0 for a request resumed after a retraction
    pen = prefill_rows(state.penalties, row_ids, x.penalties, tokens, lengths, pos)  # neutral ones change nothing
    logits = apply_penalties(out.logits, gather_penalties(pen, row_ids), generated)
    logits = apply_token_mask(logits, x.token_mask)
    first = sample(logits, s.seed, total, s.temperature, s.top_k, s.top_p, all_greedy=False)  # greedy rows: argmax
    pen = add_tokens(pen, row_ids, first[:, None])
    # Draft extend: (token t+1, feature t) at position t; the last pair takes the first new token.
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
    ext_tok = jnp.where(jnp.arange(t)[None, :] == last[:, None], first[:, None], nxt)
    feature = out.hidden if head.cfg.kind == "eagle1" else out.aux_hidden
    lm_head = target.embed[...] if target.lm_head is None else target.lm_head[...]
    dout = head(ext_tok, feature, attn, state.draft_k, state.draft_v, embed=target.embed[...],
                embed_split=target.vocab_split, lm_head=lm_head, logits_index=last)
    # The first round's root top-K, drafted under the rows' penalties (neutral ones change nothing).
    dpen = gather_penalties(pen, row_ids)
    dlogits = apply_penalties(dout.logits, dpen, generated + 1, vocab_ids=draft_vocab_ids(head))
    topk_p, topk_id = draft_topk(head, dlogits, static.layout.topk)
    finished = jnp.any(first[:, None] == x.stop_ids, -1) | (x.max_new <= 1)
    rows = state.rows
    new = SpecRows(root=first, seq_len=total, topk_p=topk_p, topk_id=topk_id,
                   feature=dout.hidden[jnp.arange(b), last].astype(rows.feature.dtype),
                   tree_slots=x.tree_slots, scratch_slots=x.scratch_slots, n_generated=jnp.ones_like(lengths),
                   max_new=x.max_new, stop_ids=x.stop_ids, finished=finished, temperature=s.temperature,
                   top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    emitted = jnp.full((b, 2), -1, jnp.int32).at[:, 0].set(first)
    res = pack_result(emitted, jnp.full((b,), -1, jnp.int32), finished)
    if key.logprobs:
        lp = token_logprobs(out.logits, first)[:, None]
        res = pack(res, jnp.concatenate([lp, jnp.zeros_like(lp)], 1))  # the second column emits nothing
    if key.prompt_logprobs:
        res = pack(res, prompt_logprobs(out.hidden, lm_head, tokens))
    return res, SpecState(KVCache(k=out.k, v=out.v, req_to_token=req_to_token), dout.k, dout.v,
                          rows.scatter(row_ids, new), pen)


def round_step(key: RoundKey, graphdef, draft_graphdef, params, state: SpecState, row_ids):
    """`key.rounds` rounds over the rows `row_ids`: the first always, the rest in a `lax.while_loop`
    that stops once every real row (not the scratch row that pads the batch) has finished, or with
    `key.unrolled` all of them, one after another (a finished row's rounds emit nothing, as in the
    loop when another row is still running: the same result). Result:
    [B, C] for one round, else [B, rounds, C] (C: `pack_result`'s columns, then any logprobs), where
    a round that did not run reads as one that emitted nothing (tokens, accepted and nested -1,
    finished 0)."""
    target, head = nnx.merge(graphdef, params[0]), nnx.merge(draft_graphdef, params[1])
    s = key.static

    def one(st: SpecState):
        res, cache, dk, dv, rows, pen = spec_round(
            target, head, key.tier, st.cache, st.draft_k, st.draft_v, st.rows, row_ids, kv_len=key.kv_len,
            greedy=key.greedy, aux_layers=s.aux_layers, unroll=s.unroll_round, simulate_accept=s.simulate_accept,
            logprobs=key.logprobs, penalties=st.penalties if key.penalties else None, nested=key.nested)
        return pad_columns(res, key.width), SpecState(cache, dk, dv, rows, pen if key.penalties else st.penalties)

    res, state = one(state)
    if key.rounds == 1:
        return res, state
    if key.unrolled:
        out = [res]
        for _ in range(key.rounds - 1):
            res, state = one(state)
            out.append(res)
        return jnp.stack(out, 1), state
    padding = row_ids == s.max_reqs  # the scratch row

    def live(carry):
        i, st, _ = carry
        return (i < key.rounds) & ~jnp.all(st.rows.finished[row_ids] | padding)

    def body(carry):
        i, st, out = carry
        res, st = one(st)
        return i + 1, st, out.at[:, i].set(res)

    # -1 everywhere but the finished column (S + 1 tokens, accepted, finished, then any nested tiers'
    # accept lengths and logprobs).
    empty = jnp.full(res.shape[:1] + (key.rounds,) + res.shape[1:], -1, res.dtype)
    empty = empty.at[..., key.tier.num_steps + 2].set(0)
    _, state, out = jax.lax.while_loop(live, body, (jnp.int32(1), state, empty.at[:, 0].set(res)))
    return out, state


def draft_step(key: DraftKey, graphdef, draft_graphdef, params, state: SpecState, row_ids):
    target, head = nnx.merge(graphdef, params[0]), nnx.merge(draft_graphdef, params[1])
    tree, dk, dv, _ = draft_tree(target, head, key.tier, state.cache, state.draft_k, state.draft_v, state.rows,
                                 row_ids, kv_len=key.kv_len)
    return tree, SpecState(state.cache, dk, dv, state.rows, state.penalties)


def verify_step(key: RoundKey, graphdef, draft_graphdef, params, state: SpecState, inputs, fwd=None, masks=None):
    target, head = nnx.merge(graphdef, params[0]), nnx.merge(draft_graphdef, params[1])
    row_ids, tree = inputs[:2]
    s = key.static
    tout = None
    if fwd is not None:  # the forward ran as its own executable: its KV is in the state's pools already
        tout = ForwardOut(fwd.logits, fwd.hidden, fwd.aux_hidden, state.cache.k, state.cache.v)
    res, cache, dk, dv, rows, pen = verify_commit(
        target, head, key.tier, state.cache, state.draft_k, state.draft_v, state.rows, row_ids, tree,
        kv_len=key.kv_len, greedy=key.greedy, aux_layers=s.aux_layers, unroll=s.unroll_round,
        simulate_accept=s.simulate_accept, logprobs=key.logprobs, penalties=state.penalties if key.penalties else None,
        token_masks=masks, tout=tout)
    return res, SpecState(cache, dk, dv, rows, pen if key.penalties else state.penalties)


@jax.tree_util.register_dataclass
@dataclass
class VerifyForward:
    """What the verify's forward hands its accept: the target's logits at the tree nodes and the
    draft's features (the final hidden for EAGLE-1, the aux layers' for EAGLE-3; the other None);
    and for the host, each node's best tokens (`jeagle.sampling.grammar_walk.walk_nodes`: greedy grammar rows)."""
    logits: jax.Array  # [B, N, V] fp32
    hidden: jax.Array | None
    aux_hidden: jax.Array | None
    top_ids: jax.Array  # [B, N, grammar_walk.CANDIDATES] int32, best first
    top_vals: jax.Array  # [B, N, grammar_walk.CANDIDATES] fp32: their logits


def verify_forward_step(key: RoundKey, graphdef, draft_graphdef, params, state: SpecState, row_ids):
    """A grammar round's first half: the draft and the target's forward over its tree, in one
    executable (the host needs the forward's best tokens anyway, `jeagle.sampling.grammar_walk.walk_nodes`; one
    call costs the host about what the two did: bench/HISTORY.md, 2026-11-27). Returns ((tree,
    VerifyForward), state)."""
    tree, state = draft_step(DraftKey(key.static, key.tier, key.batch, key.kv_len), graphdef, draft_graphdef,
                             params, state, row_ids)
    target, head = nnx.merge(graphdef, params[0]), nnx.merge(draft_graphdef, params[1])
    out = verify_forward(target, key.tier, state.cache, state.rows.gather(row_ids), row_ids, tree,
                         kv_len=key.kv_len, aux_layers=key.static.aux_layers, unroll=key.static.unroll_round)
    eagle1 = head.cfg.kind == "eagle1"
    vals, ids = top_k_blocked(out.logits, CANDIDATES)
    fwd = VerifyForward(out.logits, out.hidden if eagle1 else None, None if eagle1 else out.aux_hidden,
                        ids.astype(jnp.int32), vals)
    cache = KVCache(k=out.k, v=out.v, req_to_token=state.cache.req_to_token)
    return (tree, fwd), SpecState(cache, state.draft_k, state.draft_v, state.rows, state.penalties)


def accept_step(key: RoundKey, graphdef, draft_graphdef, params, state: SpecState, inputs):
    """The verify's second half after `verify_forward_step`: masks, accept, finish, draft extend, commit."""
    row_ids, tree, fwd, masks = inputs
    if key.compact:  # token ids per node → bitmasks (a few thousand words; the host sent C ids a node)
        masks = masks_from_ids(masks, mask_words(key.static.model.vocab_size))
    return verify_step(key, graphdef, draft_graphdef, params, state, (row_ids, tree), fwd, masks)
