"""The speculative engine: the autoregressive engine's scheduling with EAGLE rounds as the decode step.

Prefill (one executable per batch × length bucket): the target over the prompts, the first token
sampled, then the draft extended over positions 0..L-1 with the pairs (token t+1, target feature t),
leaving the draft's top-K and feature for the first round. Each decode call is one `spec_round`.

A request owns, from admission to finish, P = prompt + max_new + S + 1 position slots (capped by the
context), N tree slots and (S-1)·K draft scratch slots. Rounds chain on the device; the host reads
each round's emitted tokens one round late (their copy started at dispatch) and stops dispatching a
request once a round reports it finished.

Tiers. The engine runs one (S, K, N) tier, or with `adaptive` several: each tier has its own round
executables (per batch bucket, prefix bucket and greedy/sampled mode, compiled at warm-up) held in
its `TierState`, the rows and slots are sized for the largest (S, K, N and scratch each at their
maximum), and after each processed round the `AdaptiveController` may make another tier active for
the next dispatch (`jeagle/adaptive.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jeagle.adaptive import AdaptiveConfig, AdaptiveConfigError, AdaptiveController, TierState
from jeagle.cache import init_pools
from jeagle.engine import Engine, EngineConfig, _Request, assign_rows, flat_slots, kv_buckets, pick_bucket
from jeagle.models.common import AttnInputs
from jeagle.models.eagle import EagleHead
from jeagle.models.llama import Llama
from jeagle.sampling import sample
from jeagle.spec.round import (MAX_STOP, RowLayout, SpecConfig, SpecRows, draft_topk, draft_tree, init_rows, spec_round,
                               verify_commit)


class SpecEngine(Engine):
    def __init__(self, model: Llama, draft: EagleHead, config: EngineConfig = EngineConfig(),
                 spec: SpecConfig = SpecConfig(), *, adaptive: AdaptiveConfig | None = None, fused_round: bool = True,
                 abstract: bool = False):
        """spec: the (initial) tier. adaptive: switch between the config's tiers after each round.
        fused_round: one executable per round (default); False runs the draft + tree and the verify +
        accept + commit + extend as two executables (for measuring the difference)."""
        draft.cfg.check_target(model.cfg)
        self.base_spec, self.adaptive = spec, adaptive
        if adaptive is None:
            self.tiers = (spec,)
        else:
            self.tiers = tuple(_tier(spec, t, adaptive)
                               for t in adaptive.tiers(spec.num_steps, spec.topk, spec.num_draft_tokens))
        self.tier_states = [TierState(t, t.num_steps) for t in self.tiers]
        self.controller = (AdaptiveController(adaptive, self.tier_states, spec.num_steps) if adaptive is not None
                           else None)
        self._state = self.controller.active if self.controller is not None else self.tier_states[0]
        self.layout = RowLayout.covering(self.tiers)
        self.fused_round = fused_round
        self._context_reserve = self.layout.num_steps + 1
        super().__init__(model, config, abstract=abstract)
        self.draft_split = False  # the draft head split over the mesh (EngineConfig.tp_draft)
        if self.mesh is not None:
            from jeagle.sharding import shard_draft, split_draft

            self.draft_split = split_draft(draft.cfg, config.tp, config.tp_draft, config.tp_vocab)
            if self.draft_split:
                draft = shard_draft(draft, self.mesh, config.tp_vocab)
        self.draft_graphdef, self.draft_params = nnx.split(draft)
        self.draft_cfg = draft.cfg
        self.kv_buckets = kv_buckets(self.max_ctx, config, (model.cfg.head_dim, draft.cfg.head_dim))
        self.dk, self.dv = self._alloc(lambda: init_pools(draft.cfg, num_slots=self.allocator.num_slots))
        self.srows = self._alloc(lambda: init_rows(self.max_reqs + 1, self.layout, draft.cfg.hidden_size,
                                                   jnp.dtype(draft.cfg.dtype)))
        if self.mesh is not None:  # pools split like the target's; the draft replicated unless split above
            if not self.draft_split:
                self.draft_params = self._replicated(self.draft_params)
            self.dk, self.dv = self._place_pools(self.dk, self.dv)
            self.srows = self._replicated(self.srows)
        self.aux_layers = tuple(draft.cfg.aux_layer_ids) if draft.cfg.kind == "eagle3" else ()
        self.accept_lengths: list[int] = []
        self.rounds_dispatched = 0
        self.tier_log: list[tuple[int, SpecConfig]] = []  # (round index, tier) at every change of tier

    def reset_tier(self) -> None:
        """Adaptive: back to the initial tier with a fresh EMA (nothing recompiles)."""
        if self.controller is not None:
            self.controller.reset()
            self._state = self.controller.active

    @property
    def spec(self) -> SpecConfig:
        """The active tier: the next round runs it."""
        return self._state.tier

    def _compiler_options(self, key: tuple) -> dict:
        """Speculative executables compile with XLA's Triton GEMM fusions off (cuBLAS for every matmul):
        on the H100 that halves their compile time (4-5 s instead of 8-10 s per round executable) and
        the rounds run as fast or faster (bench/RESULTS.md, "XLA options"). CPU: no options."""
        extra = super()._compiler_options(key)  # JEAGLE_XLA_OPTIONS
        if jax.default_backend() != "gpu" or os.environ.get("JEAGLE_TRITON_GEMM") == "1":  # =1: XLA's default
            return extra
        return {"xla_gpu_enable_triton_gemm": False} | extra

    def _static_description(self) -> str:
        return repr((super()._static_description(), self.tiers, self.draft_cfg, self.aux_layers, self.fused_round))

    # ---- slots -----------------------------------------------------------------------------
    # Sized for the largest tier, so any tier can run any round.
    def _positions(self, prompt_len: int, max_new: int) -> int:
        return min(prompt_len + max_new + self.layout.num_steps + 1, self.max_ctx)

    def _kv_pools(self) -> tuple:
        return (*super()._kv_pools(), self.dk, self.dv)

    def _prefix_bound(self, prompt_len: int, max_new: int) -> int:
        # Dispatch bounds L by tokens received + (S+1) per unread round: two with overlap, one without.
        return min(prompt_len + max_new + (self.layout.num_steps + 1) * (2 if self.cfg.overlap else 1), self.max_ctx)

    def _slots_needed(self, prompt_len: int, max_new: int) -> int:
        return self._positions(prompt_len, max_new) + self.layout.num_draft_tokens + self.layout.scratch

    # ---- compiled functions ----------------------------------------------------------------
    def _spec_prefill_impl(self, params, dparams, cache, dk, dv, srows: SpecRows, tokens, lengths, row_ids, slots,
                           tree_slots, scratch_slots, samp):
        target = nnx.merge(self.graphdef, params)
        head = nnx.merge(self.draft_graphdef, dparams)
        b, t = tokens.shape
        req_to_token, table = assign_rows(cache.req_to_token, row_ids, *slots)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = pos < lengths[:, None]
        attn = AttnInputs(positions=pos, write_slots=jnp.where(valid, table[:, :t], 0), kv_slots=table[:, :t],
                          kv_len=lengths)
        last = jnp.maximum(lengths - 1, 0)
        out = target(tokens, attn, cache.k, cache.v, logits_index=last, aux_layers=self.aux_layers,
                     unroll=self._unroll("prefill"))
        temperature, top_k, top_p, seed, max_new, stop_ids = samp
        first = sample(out.logits, seed, lengths, temperature, top_k, top_p, all_greedy=False)  # greedy rows: argmax
        # Draft extend: (token t+1, feature t) at position t; the last pair takes the first new token.
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
        ext_tok = jnp.where(pos == last[:, None], first[:, None], nxt)
        feature = out.hidden if head.cfg.kind == "eagle1" else out.aux_hidden
        lm_head = target.embed[...] if target.lm_head is None else target.lm_head[...]
        dout = head(ext_tok, feature, attn, dk, dv, embed=target.embed[...], embed_split=target.vocab_split,
                    lm_head=lm_head, logits_index=last)
        topk_p, topk_id = draft_topk(head, dout.logits, self.layout.topk)
        finished = jnp.any(first[:, None] == stop_ids, -1) | (max_new <= 1)
        new = SpecRows(root=first, seq_len=lengths, topk_p=topk_p, topk_id=topk_id,
                       feature=dout.hidden[jnp.arange(b), last].astype(srows.feature.dtype),
                       tree_slots=tree_slots, scratch_slots=scratch_slots, n_generated=jnp.ones_like(lengths),
                       max_new=max_new, stop_ids=stop_ids, finished=finished, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed)
        srows = srows.scatter(row_ids, new)
        emitted = jnp.full((b, 2), -1, jnp.int32).at[:, 0].set(first)
        res = jnp.concatenate([emitted, jnp.full((b, 1), -1, jnp.int32), finished[:, None].astype(jnp.int32)], 1)
        cache = type(cache)(k=out.k, v=out.v, req_to_token=req_to_token)
        return res, cache, dout.k, dout.v, srows

    def _round_impl(self, params, dparams, cache, dk, dv, srows, row_ids, *, tier, kv_len, greedy):
        target = nnx.merge(self.graphdef, params)
        head = nnx.merge(self.draft_graphdef, dparams)
        return spec_round(target, head, tier, cache, dk, dv, srows, row_ids, kv_len=kv_len, greedy=greedy,
                          aux_layers=self.aux_layers, unroll=self._unroll("round"))

    def _draft_impl(self, params, dparams, cache, dk, dv, srows, row_ids, *, tier, kv_len):
        target = nnx.merge(self.graphdef, params)
        head = nnx.merge(self.draft_graphdef, dparams)
        return draft_tree(target, head, tier, cache, dk, dv, srows, row_ids, kv_len=kv_len)

    def _verify_impl(self, params, dparams, cache, dk, dv, srows, row_ids, tree, *, tier, kv_len, greedy):
        target = nnx.merge(self.graphdef, params)
        head = nnx.merge(self.draft_graphdef, dparams)
        return verify_commit(target, head, tier, cache, dk, dv, srows, row_ids, tree, kv_len=kv_len,
                             greedy=greedy, aux_layers=self.aux_layers, unroll=self._unroll("round"))

    def _run(self, exe, args):
        res, self.cache, self.dk, self.dv, self.srows = exe(*args)
        res.copy_to_host_async()
        return res

    # ---- executables -------------------------------------------------------------------------
    def _prefill_exe(self, b, t, args):
        return self._executable(("spec_prefill", b, t), self._spec_prefill_impl, args, donate=(2, 3, 4, 5))

    def _decode_exe(self, b, kv, greedy, args, tier: SpecConfig | None = None):
        """The fused round of `tier` (default: the active one), from the tier's state when it holds it
        (the split round is a measurement mode: compiled on first use, not warmed up)."""
        state = self._state if tier is None else self.tier_states[self.tiers.index(tier)]
        exe = state.executables.get((b, kv, greedy))
        if exe is None:
            t = state.tier
            fn = functools.partial(self._round_impl, tier=t, kv_len=kv, greedy=greedy)
            exe = self._executable(("round", b, kv, greedy, _tier_key(t)), fn, args, donate=(2, 3, 4, 5))
            if exe is not None:
                state.executables[(b, kv, greedy)] = exe
        return exe

    # ---- dispatch --------------------------------------------------------------------------
    def _prefill_inputs(self, reqs, b, t):
        s = self.layout
        tokens = np.zeros((b, t), np.int32)
        lengths = np.zeros((b,), np.int32)
        row_ids = np.full((b,), self.scratch_row, np.int32)
        positions = []
        tree_slots = np.zeros((b, s.num_draft_tokens), np.int32)
        scratch_slots = np.zeros((b, s.scratch), np.int32)
        temperature, top_k = np.zeros((b,), np.float32), np.zeros((b,), np.int32)
        top_p, seed = np.ones((b,), np.float32), np.zeros((b,), np.uint32)
        max_new, stop_ids = np.ones((b,), np.int32), np.full((b, MAX_STOP), -1, np.int32)
        for i, r in enumerate(reqs):
            n = len(r.prompt)
            npos = self._positions(n, r.max_new)
            tokens[i, :n], lengths[i], row_ids[i] = r.prompt, n, r.row
            positions.append(r.slots[:npos])
            tree_slots[i] = r.slots[npos : npos + s.num_draft_tokens]
            scratch_slots[i] = r.slots[npos + s.num_draft_tokens :]
            temperature[i], top_k[i], top_p[i] = r.params.temperature, r.params.top_k, r.params.top_p
            seed[i] = r.params.seed if r.params.seed is not None else self._rng.integers(0, 2**32)
            max_new[i] = r.max_new
            stops = sorted(r.eos)
            if len(stops) > MAX_STOP:
                raise ValueError(f"request {r.index} has {len(stops)} stop tokens; at most {MAX_STOP} are supported")
            stop_ids[i, : len(stops)] = stops
            r.length, r.dispatched = n, 1
        slots = flat_slots(b, self.max_ctx, positions)
        return (self.params, self.draft_params, self.cache, self.dk, self.dv, self.srows, tokens, lengths, row_ids,
                slots, tree_slots, scratch_slots, (temperature, top_k, top_p, seed, max_new, stop_ids))

    def _dispatch_prefill(self, reqs: list[_Request]):
        b = pick_bucket(self.prefill_batch_buckets, len(reqs))
        t = pick_bucket(self.prefill_buckets, max(len(r.prompt) for r in reqs))
        args = self._prefill_inputs(reqs, b, t)
        return self._run(self._prefill_exe(b, t, args), args)

    def _decode_inputs(self, reqs, b):
        row_ids = np.full((b,), self.scratch_row, np.int32)
        for i, r in enumerate(reqs):
            row_ids[i] = r.row
            r.dispatched += 1  # rounds in flight bound how far L can have moved
        return (self.params, self.draft_params, self.cache, self.dk, self.dv, self.srows, row_ids)

    def _dispatch_decode(self, reqs: list[_Request]):
        s = self.layout
        b = pick_bucket(self.batch_buckets, len(reqs))
        args = self._decode_inputs(reqs, b)
        # L <= prompt + tokens received + (S+1) per unread call; the prefix bucket must cover it.
        longest = max(len(r.prompt) + len(r.out.token_ids) + (s.num_steps + 1) * (r.dispatched - r.processed)
                      for r in reqs)
        kv = pick_bucket(self.kv_buckets, min(longest, self.max_ctx))
        greedy = all(r.params.greedy for r in reqs)
        tier = self.spec
        if not self.tier_log or self.tier_log[-1][1] != tier:
            self.tier_log.append((self.rounds_dispatched, tier))
        self.rounds_dispatched += 1
        if self.fused_round:
            return self._run(self._decode_exe(b, kv, greedy, args), args)
        key = _tier_key(tier)
        draft_exe = self._executable(("draft", b, kv, key), functools.partial(self._draft_impl, tier=tier, kv_len=kv),
                                     args, donate=(3, 4))
        tree, self.dk, self.dv = draft_exe(*args)
        args = (self.params, self.draft_params, self.cache, self.dk, self.dv, self.srows, args[-1], tree)
        fn = functools.partial(self._verify_impl, tier=tier, kv_len=kv, greedy=greedy)
        return self._run(self._executable(("verify", b, kv, greedy, key), fn, args, donate=(2, 3, 4, 5)), args)

    # ---- warm-up: every tier's rounds --------------------------------------------------------------
    def warmup_plan(self, batch_sizes=None, prefill_lengths=None, kv_lengths=None, greedy=(True, False)):
        """The base plan with the decode entries once per tier: ("decode", b, kv, greedy, tier)."""
        plan = super().warmup_plan(batch_sizes, prefill_lengths, kv_lengths, greedy)
        return ([p for p in plan if p[0] != "decode"]
                + [(*p[:4], t) for t in self.tiers for p in plan if p[0] == "decode"])

    def _wants_step(self, r: _Request) -> bool:
        return not r.done

    def _record_verify_done(self, res) -> None:
        self.verify_done.record(res)

    def _process(self, kind, batch, host) -> None:
        # A row: the emitted tokens (S+1 of the round's tier, -1 padded), the accepted drafts, finished.
        accepted = []
        for i, r in enumerate(batch):
            r.processed += 1
            if r.done:
                continue
            row = host[i]
            if kind == "step" and row[-2] >= 0:
                accepted.append(int(row[-2]))
                self.accept_lengths.append(int(row[-2]) + 1)
            toks = row[:-2]
            self._accept_tokens(r, toks[toks >= 0])
            if row[-1] and not r.done:
                raise AssertionError(f"request {r.index}: the device finished it, the host did not")
        if kind == "step" and self.controller is not None and accepted:
            self.controller.on_verify_complete(accepted)
            self._state = self.controller.active  # a reference swap: the next dispatch runs this tier

    def generate(self, prompts, params=None, on_tokens=None):
        from jeagle.sampling import SamplingParams

        self.accept_lengths = []
        round0, log0 = self.rounds_dispatched, len(self.tier_log)
        start_tier = self.spec
        outs = super().generate(prompts, SamplingParams() if params is None else params, on_tokens)
        acc = self.accept_lengths
        stats = self.last_stats
        stats["rounds"] = len(acc)  # request-rounds (a batch of B rounds B of them)
        stats["round_dispatches"] = self.rounds_dispatched - round0
        stats["accept_length"] = float(np.mean(acc)) if acc else 1.0  # tokens per request-round, bonus included
        stats["accept_length_histogram"] = {str(k): acc.count(k) for k in range(1, self.layout.num_steps + 2)}
        stats["adaptive"] = self.controller is not None
        stats["tiers"] = [list(_tier_key(t)) for t in self.tiers]
        # Round dispatch index (within this call) -> the tier that ran from that round on.
        history = {0: start_tier} | {i - round0: t for i, t in self.tier_log[log0:]}
        stats["tier_history"] = {str(i): list(_tier_key(t)) for i, t in sorted(history.items())}
        stats["tier_switches"] = len(history) - 1
        return outs


def _tier(base: SpecConfig, tier: tuple[int, int, int], adaptive: AdaptiveConfig) -> SpecConfig:
    s, k, n = tier
    try:
        return dataclasses.replace(base, num_steps=s, topk=k, num_draft_tokens=n)
    except ValueError as e:
        key = "candidate_tiers" if adaptive.candidate_tiers is not None else "candidate_steps"
        raise AdaptiveConfigError(f"adaptive config: {key} {list(tier)}: {e}") from e


def _tier_key(t: SpecConfig) -> tuple[int, int, int]:
    return (t.num_steps, t.topk, t.num_draft_tokens)
