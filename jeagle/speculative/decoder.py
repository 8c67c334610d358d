"""The speculative decoder: EAGLE rounds as the decode step, the tiers and the adaptive controller.

Slots. A request owns, from admission to finish, P = prompt + max_new + S + 1 position slots (capped
by the context), N tree slots and (S-1)·K draft scratch slots (`SlotLayout(past_last=S+1, tree=N,
scratch=(S-1)·K)`). Rounds chain on the device; the host reads each round's emitted tokens one round
late (their copy started at dispatch) and stops dispatching a request once a round reports it
finished.

Tiers. The decoder runs one (S, K, N) tier, or with `adaptive` several: each tier has its own round
executables (per batch bucket, prefix bucket and greedy/sampled mode, compiled at warm-up) held in
its `TierState`, the rows and slots are sized for the largest (S, K, N and scratch each at their
maximum), and after each processed round the `AdaptiveController` may make another tier active for
the next dispatch (`jeagle/speculative/adaptive.py`). Step functions and keys: speculative/steps.py.

Round times (the throughput policy): speculative/timing.py's `TierTiming` calibrates; in the steady state each
processed round also gives a sample: the time from the previous round's result to its own (or from
its dispatch, if later), skipped when a prefill ran in between or a dispatch loops several rounds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections import Counter, deque

import jax
import numpy as np
from flax import nnx

from jeagle.speculative.adaptive import AdaptiveConfig, AdaptiveConfigError, AdaptiveController, TierState
from jeagle.runtime.buckets import Buckets, pad
from jeagle.sampling import logprobs
from jeagle.sampling.penalties import penalty_inputs, wants_penalties
from jeagle.runtime.decoder import (Delivery, GrammarMasks, SlotTables, context_size, place_cache, prefill_batch,
                                    sampling_inputs, split_prompt_logprobs, wants_grammar, wants_logprobs,
                                    wants_prompt_logprobs, weight_bytes)
from jeagle.runtime.dispatch import Dispatching, resolve
from jeagle.runtime.executables import DeviceShapes, Executables, FlatParams
from jeagle.runtime.slots import SlotLayout, pool_size
from jeagle.runtime.stats import SpecStats
from jeagle.runtime.steps import Sampling, input_layout, layer_unroll
from jeagle.speculative.round import MAX_STOP, RoundResult, RowLayout, SpecConfig, packed_width
from jeagle.speculative.steps import DraftKey, RoundKey, SpecPrefillInputs, SpecPrefillKey, SpecState, SpecStatic, init_state
from jeagle.speculative.timing import TierTiming


class SpecDecoder(TierTiming, SlotTables, GrammarMasks, FlatParams, Dispatching):
    speculative = True
    swaps_slots = True  # a round's commit swaps tree slots into positions: read the tables back to know them

    def __init__(self, model, draft, config, spec: SpecConfig = SpecConfig(), *, adaptive: AdaptiveConfig | None = None,
                 fused_round: bool = True, simulate_accept: float = 0.0, mesh=None):
        """spec: the (initial) tier. adaptive: switch between the config's tiers after each round.
        fused_round: one executable per round (default); False runs the draft + tree and the verify +
        accept + commit + extend as two executables (for measuring the difference). simulate_accept:
        bench only, a forced mean accept length (the output is then not the target's)."""
        draft.cfg.check_target(model.cfg)
        self.config, self.model_cfg, self.draft_cfg, self.mesh = config, model.cfg, draft.cfg, mesh
        self.use_dispatch_thread(config.dispatch_thread)
        self.base_spec, self.adaptive_config = spec, adaptive
        self.tiers = ((spec,) if adaptive is None else
                      tuple(_tier(spec, t, adaptive) for t in adaptive.tiers(*spec.shape)))
        for t in self.tiers:
            t.check_simulated_accept(simulate_accept)
        self.tier_states = [TierState(t, t.num_steps) for t in self.tiers]
        self.controller = (AdaptiveController(adaptive, self.tier_states, spec.num_steps) if adaptive is not None
                           else None)
        self._state = self.controller.active if self.controller is not None else self.tier_states[0]
        self.row_layout = RowLayout.covering(self.tiers)
        self.fused_round = fused_round
        self.rounds_per_dispatch = config.rounds_per_dispatch
        if self.rounds_per_dispatch > 1 and not fused_round:
            raise ValueError("rounds_per_dispatch > 1 needs the fused round (fused_round=True)")
        rl = self.row_layout
        self.layout = SlotLayout(past_last=rl.num_steps + 1, tree=rl.num_draft_tokens, scratch=rl.scratch)
        self.context_reserve = self.layout.context_reserve

        self.draft_split = False  # the draft head split over the mesh (EngineConfig.tp_draft)
        if mesh is not None:
            from jeagle.parallel.sharding import shard_draft, shard_target, split_draft

            model = shard_target(model, mesh, config.tp_vocab)
            self.draft_split = split_draft(draft.cfg, config.tp, config.tp_draft, config.tp_vocab)
            if self.draft_split:
                draft = shard_draft(draft, mesh, config.tp_vocab)
        graphdef, params = nnx.split(model)
        draft_graphdef, draft_params = nnx.split(draft)
        if mesh is not None and not self.draft_split:
            from jeagle.parallel.sharding import replicate

            draft_params = replicate(draft_params, mesh)
        self.params = (params, draft_params)
        mc = self.model_cfg
        self.max_ctx, self.max_reqs = context_size(config, mc), config.max_batch_size
        self.num_slots = pool_size(config, mc, self.layout, self.max_ctx, weight_bytes(params), draft.cfg)
        # One executable makes the whole zeroed state (not one per array: each is a compile, or a cache hit).
        state = jax.jit(functools.partial(init_state, mc, draft.cfg, rl, num_slots=self.num_slots,
                                          max_reqs=self.max_reqs, max_ctx=self.max_ctx))()
        if mesh is not None:  # pools split like the target's; the rest replicated
            from jeagle.parallel.sharding import replicate, shard_pools

            dk, dv = shard_pools(state.draft_k, state.draft_v, mesh)
            state = SpecState(place_cache(state.cache, mesh), dk, dv, replicate(state.rows, mesh),
                              replicate(state.penalties, mesh))
        self.state = state
        self.scratch_row = self.max_reqs
        self.buckets = Buckets.for_engine(config, self.max_reqs, self.max_ctx, (mc.head_dim, draft.cfg.head_dim))
        self.static = SpecStatic(model=mc, draft=draft.cfg, layout=rl, max_reqs=self.max_reqs, max_ctx=self.max_ctx,
                                 num_slots=self.num_slots, unroll_prefill=layer_unroll("prefill", config, mc),
                                 unroll_round=layer_unroll("round", config, mc), kernels=config.kernels,
                                 simulate_accept=simulate_accept,
                                 unroll_small_prefill=layer_unroll("small_prefill", config, mc))
        self.executables = Executables(DeviceShapes.of((graphdef, draft_graphdef), self.params, state, mesh),
                                       store_dir=config.executable_cache_dir, compile_workers=config.compile_workers,
                                       compile_processes=config.compile_processes)
        self.rng = np.random.default_rng()  # the seeds of requests without one (shared under --nnodes)
        self._init_tables()
        # Request-rounds by tokens emitted (bonus included), counted since start: a stats window is the
        # difference of two counts, however long the engine runs; the last few for /server_info.
        self.accept_counts = np.zeros(self.row_layout.num_steps + 2, np.int64)
        self.recent_accepts: deque[int] = deque(maxlen=512)
        self.rounds_dispatched = 0
        self.tier_log: list[tuple[int, SpecConfig]] = []  # (round index, tier) at every change of tier
        # Dispatched, unread rounds: (tier index, bucket (b, kv, greedy), dispatch time, a prefill ran
        # since the previous round, the nested tiers' columns in its result); the time the previous
        # round's result was read.
        self._dispatches: deque = deque()
        self._prefill_since = False
        self.last_read: float | None = None  # when the last round's result was read (a round-time sample starts)
        self.last_bucket: tuple | None = None  # (b, kv, greedy) of the last round dispatched
        self.bucket_rounds: Counter = Counter()  # rounds dispatched per (b, kv, greedy)
        self._rows_on_device: tuple | None = None  # (row ids, their device array) of the last dispatch

    @property
    def spec(self) -> SpecConfig:
        """The active tier: the next round runs it."""
        return self._state.tier

    @property
    def timed(self) -> bool:
        """Whether the tiers' round times are measured (the adaptive throughput policy needs them)."""
        return self.controller is not None and self.adaptive_config.policy == "throughput"

    def reset_tier(self) -> None:
        """Adaptive: back to the initial tier with a fresh policy (nothing recompiles)."""
        if self.controller is not None:
            self.controller.reset()
            self._state = self.controller.active

    # ---- keys ------------------------------------------------------------------------------------------
    def prefill_key(self, b: int, t: int, logprobs: bool = False, prompt_logprobs: bool = False,
                    context: int = 0) -> SpecPrefillKey:
        return SpecPrefillKey(self.static, b, t, logprobs, prompt_logprobs, context)

    def round_key(self, tier: SpecConfig, b: int, kv: int, greedy: bool, logprobs: bool = False,
                  penalties: bool = False) -> RoundKey:
        width = 0 if len(self.tiers) == 1 else max(packed_width(t.num_steps, logprobs, len(self._nested(t)))
                                                      for t in self.tiers)
        return RoundKey(self.static, tier, b, kv, greedy, rounds=self.rounds_per_dispatch,
                        unrolled=self.config.unroll_rounds and self.rounds_per_dispatch > 1, logprobs=logprobs,
                        penalties=penalties, nested=self._nested(tier), width=width)

    def _nested(self, tier: SpecConfig) -> tuple[tuple[int, int], ...]:
        """(S', N') of the tiers whose would-be accept lengths `tier`'s rounds report (the throughput
        policy's nested tiers, `jeagle.speculative.adaptive_throughput.nested_tiers`)."""
        if not self.timed:
            return ()
        nest = self.controller.nests[self.tiers.index(tier)]
        return tuple((self.tiers[i].num_steps, self.tiers[i].num_draft_tokens) for i in nest)

    def warmup_keys(self, prefill, decode, greedy=(True, False), logprobs=(False,), penalties=(False,),
                    grammar=(False,)) -> list:
        """Prefill keys for the (b, t) pairs (every prefill applies penalties and masks), then every
        tier's fused rounds for the (b, kv) pairs in each mode of `greedy` and `penalties`; each in
        each mode of `logprobs`. With `grammar` True, the rounds grammar batches run too (the draft
        and the verify's forward, then its masked accept, greedy ones also with the masks as token
        ids). (The split round without grammar is a measurement mode: compiled on first use.)"""
        keys = [self.prefill_key(b, t, lp, context=c) for lp in logprobs for b, t, c in prefill]
        for lp, pen, tier, g, (b, kv) in itertools.product(logprobs, penalties, self.tiers, greedy, decode):
            if False in grammar:
                keys.append(self.round_key(tier, b, kv, g, lp, pen))
            if True in grammar:
                accept = dataclasses.replace(self.round_key(tier, b, kv, g, lp, pen), phase="accept", rounds=1,
                                             unrolled=False, grammar=True, nested=(), width=0)
                keys += [accept.forward_key(), accept]
                if g and not pen and self.config.grammar_token_ids:  # the host walked every row: masks as ids
                    keys.append(dataclasses.replace(accept, compact=True))
        return list(dict.fromkeys(keys))  # the forward keys repeat across modes

    def prefix_bound(self, prompt_len: int, max_new: int, overlap: bool) -> int:
        # Dispatch bounds L by tokens received + (S+1) per unread round: two dispatches' rounds with
        # overlap, one dispatch's without.
        unread = self.rounds_per_dispatch * (2 if overlap else 1)
        return min(prompt_len + max_new + (self.row_layout.num_steps + 1) * unread, self.max_ctx)

    # ---- dispatch ----------------------------------------------------------------------------------------
    def _device_rows(self, row_ids: np.ndarray):
        """`row_ids` on the device: the last dispatch's array when they are equal (a batch's rows stay
        the same round after round). A new input buffer every round cost 0.05-0.35 ms more host time
        in the call on the H100 (bench/probes/exec_call.py, removed after commit `b436043`; XLA updates its
        command buffers when an input's address changes)."""
        last = self._rows_on_device
        if last is not None and np.array_equal(last[0], row_ids):
            return last[1]
        if self.mesh is None:
            rows = jax.device_put(row_ids)
        else:
            from jeagle.parallel.sharding import replicate

            rows = replicate(row_ids, self.mesh)
        self._rows_on_device = (row_ids, rows)
        return rows

    def prefill(self, reqs, b: int, t: int, logprobs: bool | None = None, prompt_logprobs: bool = False,
                context: int = 0):
        """logprobs: the executable with logprobs or not (None: as the requests ask; then
        prompt_logprobs too). context > 0: requests may start past position 0 (cached prefixes)."""
        lay = self.layout
        tree, scratch, stops = [], [], []
        tokens, lengths, starts, count, flat = prefill_batch(reqs, b, t, self.max_ctx)
        for r in reqs:
            tree.append(r.extra[:lay.tree])
            scratch.append(r.extra[lay.tree:lay.tree + lay.scratch])
            eos = sorted(r.eos)
            if len(eos) > MAX_STOP:
                raise ValueError(f"request {r.index} has {len(eos)} stop tokens; at most {MAX_STOP} are supported")
            stops.append(eos + [-1] * (MAX_STOP - len(eos)))
            r.dispatched, r.processed = 1, 0
        self._prefill_since = True  # the next round's time sample would include this prefill
        inputs = SpecPrefillInputs(
            tokens=tokens, lengths=lengths, starts=starts,
            row_ids=pad([r.row for r in reqs], b, self.scratch_row, np.int32), slot_count=count, slot_flat=flat,
            tree_slots=pad(np.reshape(tree, (len(reqs), lay.tree)), b, 0, np.int32),  # reqs may be none (prime)
            scratch_slots=pad(np.reshape(scratch, (len(reqs), lay.scratch)), b, 0, np.int32),
            sampling=Sampling(*sampling_inputs(reqs, b, self.rng)),
            max_new=pad([r.max_new - len(r.out.token_ids) for r in reqs], b, 1, np.int32),  # a resumed one's rest
            stop_ids=pad(np.reshape(stops, (len(reqs), MAX_STOP)), b, -1, np.int32),
            penalties=penalty_inputs(reqs, b), token_mask=self.token_masks(reqs, b))
        lp = wants_logprobs(reqs) if logprobs is None else logprobs
        plp = wants_prompt_logprobs(reqs) if logprobs is None else prompt_logprobs
        key = self.prefill_key(b, t, lp, plp, context)
        return self.dispatch(self.executables.get(key), input_layout(key).pack(inputs))

    def prime(self, key) -> None:
        """Run `key`'s executable once on padding rows only (the scratch row, which every padded batch
        computes on anyway), so that the first dispatch a request waits on does not pay the
        executable's first run on the device (its kernels and constants loaded: ~0.2 s for a prefill
        loaded from the store on an H100). Leaves no stats and nothing pending."""
        if key.phase == "prefill":
            out = self.prefill([], key.batch, key.length, logprobs=key.logprobs, prompt_logprobs=key.prompt_logprobs,
                               context=key.context)
        elif key.phase == "round":
            out = self.dispatch(self.executables.get(key), pad([], key.batch, self.scratch_row, np.int32))
        else:
            return
        jax.block_until_ready((resolve(out), self.state))

    def walks(self, params) -> bool:
        """Whether a request's grammar rows are walked on the host (`grammar_walk.walk_nodes`): greedy ones
        without penalties, in batches without penalties (their matchers are copies of the grammar's
        template: `grammar.Matcher`)."""
        return params.greedy and not params.penalized

    def wants_step(self, r) -> bool:
        """Every unfinished request: a round that finishes it reports so."""
        return not r.done

    def prefix_needed(self, r) -> int:
        # L <= prompt + tokens received + (S+1) per unread round, this dispatch's included.
        unread = self.rounds_per_dispatch * (r.dispatched + 1 - r.processed)
        return len(r.prompt) + len(r.out.token_ids) + (self.row_layout.num_steps + 1) * unread

    def round_exe(self, state, b: int, kv: int, greedy: bool, logprobs: bool = False, penalties: bool = False):
        """Tier `state`'s round executable at this bucket and mode (looked up once, then kept in the state)."""
        exe = state.executables.get((b, kv, greedy, logprobs, penalties))
        if exe is None:
            exe = state.executables[b, kv, greedy, logprobs, penalties] = self.executables.get(
                self.round_key(state.tier, b, kv, greedy, logprobs, penalties))
        return exe

    def step(self, reqs, b: int, kv: int, drain=None):
        row_ids = self._device_rows(pad([r.row for r in reqs], b, self.scratch_row, np.int32))
        for r in reqs:
            r.dispatched += 1  # rounds in flight bound how far L can have moved
        greedy, lp, pen = all(r.params.greedy for r in reqs), wants_logprobs(reqs), wants_penalties(reqs)
        if self.timed and not all(self.controller.times.has(j, (b, kv, greedy)) for j in range(len(self.tiers))):
            self.calibrate(b, kv, greedy)
        if not self.tier_log or self.tier_log[-1][1] != self.spec:
            self.tier_log.append((self.rounds_dispatched, self.spec))
        self.rounds_dispatched += 1
        grammar = wants_grammar(reqs)
        fused = self.fused_round and not grammar
        index = self.controller.active_index if self.controller is not None else 0
        state = self.tier_states[index]
        tier = state.tier
        self.last_bucket = (b, kv, greedy)
        self.bucket_rounds[self.last_bucket] += 1
        nested = len(self.controller.nests[index]) if fused and self.timed else 0
        self._dispatches.append((index, self.last_bucket, time.perf_counter(), self._prefill_since, nested))
        self._prefill_since = False
        if fused:
            return self.dispatch(self.round_exe(state, b, kv, greedy, lp, pen), row_ids)
        verify = dataclasses.replace(self.round_key(tier, b, kv, greedy, lp, pen), phase="verify", rounds=1,
                                     unrolled=False, nested=(), width=0)
        if not grammar:
            tree = self._run_draft(self.executables.get(DraftKey(self.static, tier, b, kv)), row_ids)
            return self.dispatch(self.executables.get(verify), (row_ids, tree))
        # Grammar: one executable drafts and runs the verify's forward; the host reads the tree and the
        # forward's best tokens, computes the masks, and the accept applies them.
        accept = dataclasses.replace(verify, phase="accept", grammar=True)
        first = self.dispatch(self.executables.get(accept.forward_key()), row_ids,
                              lambda r: (r[0].tokens, r[0].parent, r[1].top_ids, r[1].top_vals))
        if drain is not None:  # the last round's tokens, read while this one's draft and forward run
            drain()
        tree, fwd = resolve(first)
        # Rows the host walks check the forward's best tokens (`walks`); the others get a mask per tree
        # node (those that finished in the round just read: none).
        walk = [r.matcher is not None and not r.done and self.walks(r.params) and not pen for r in reqs]
        masks, compact = self.tree_masks(reqs, b, tree, fwd, walk,
                                         compact_ok=greedy and not pen and self.config.grammar_token_ids)
        accept = dataclasses.replace(accept, compact=compact)
        return self.dispatch(self.executables.get(accept), (row_ids, tree, fwd, masks))

    def dropped(self) -> None:
        """The scheduler dropped every dispatched, unread result (after a failed step)."""
        self._dispatches.clear()
        self.last_read = None

    def _run_draft(self, exe, row_ids):
        tree, self.state = exe(self.param_leaves, self.state, row_ids)
        return tree

    def verify_handle(self, result):
        return result  # the next host step waits on this round's verify results (runtime/verify_done.py)

    def unpack(self, kind: str, reqs, host: np.ndarray) -> list[Delivery]:
        """Each request's tokens (every round of the dispatch, in order), whether the device finished
        it and, when it asked, the tokens' packed logprob blocks [n, LOGPROB_COLUMNS]; the rounds' accept
        lengths go to the stats and the adaptive controller."""
        now = time.perf_counter()
        ran, bucket, nested = 0, None, 0
        if kind == "step":
            ran, bucket, dispatched, after_prefill, nested = self._dispatches.popleft()
            if self.timed and self.last_read is not None and not after_prefill and self.rounds_per_dispatch == 1:
                self.controller.times.observed(ran, bucket, (now - max(self.last_read, dispatched)) * 1e3)
            self.last_read = now
        lp = wants_logprobs(reqs)
        host = host[: len(reqs)]
        if kind == "step":  # the tier's own columns (an adaptive decoder pads every tier's to one width)
            host = host[..., : packed_width(self.tiers[ran].num_steps, lp, nested)]
        prompt = [None] * len(reqs)
        if kind == "prefill":  # 2 tokens (the first and an empty one), accepted, finished, their logprobs
            host, prompt = split_prompt_logprobs(host, reqs, 4 + (2 * logprobs.LOGPROB_COLUMNS if lp else 0))
        rounds = ([RoundResult.unpack(host, lp, nested)] if host.ndim == 2
                  else [RoundResult.unpack(host[:, j], lp, nested) for j in range(host.shape[1])])
        if len(rounds) == 1:
            res = rounds[0]
            toks, blocks, finished, acc = res.tokens, res.logprobs, res.finished, res.accepted[:, None]
            nest = None if res.nested is None else res.nested[:, None]
        else:  # each row's tokens round after round
            toks = np.concatenate([res.tokens for res in rounds], 1)
            blocks = np.concatenate([res.logprobs for res in rounds], 1) if lp else None
            finished = np.logical_or.reduce([res.finished for res in rounds])
            acc = np.stack([res.accepted for res in rounds], 1)
            nest = None if rounds[0].nested is None else np.stack([res.nested for res in rounds], 1)
        # Every row's emitted tokens (and their logprob blocks: one copy, only the emitted ones) in one
        # array, row after row; a request's are a slice of it (no per-token object).
        valid = toks >= 0
        flat = toks[valid]
        flat_lp = blocks[valid] if lp else None
        ends = np.cumsum(valid.sum(1)).tolist()
        finished_l = finished.tolist()
        out, start, live = [], 0, []
        for i, r in enumerate(reqs):
            r.processed += 1
            end = ends[i]
            out.append(Delivery(flat[start:end], finished_l[i],
                                flat_lp[start:end] if r.params.logprobs is not None else None, prompt[i]))
            start = end
            live.append(not r.done)
        if kind != "step":
            return out
        # The rounds of the requests not done before this result, as arrays (request after request,
        # round after round; -1: no round): no Python per request for the stats and the controller.
        live = np.asarray(live, dtype=bool)
        acc = acc[live]
        ran_round = acc >= 0
        accepted = acc[ran_round]
        if accepted.size:
            self.accept_counts += np.bincount(accepted + 1, minlength=self.accept_counts.size)
            self.recent_accepts.extend((accepted + 1).tolist())
            if self.controller is not None:
                would = None if nest is None or not self.controller.observes() else nest[live][ran_round]
                self.controller.on_verify_complete(accepted, ran, bucket, would)
                self._state = self.controller.active  # a reference swap: the next dispatch runs this tier
        return out

    # ---- stats -------------------------------------------------------------------------------------------
    def stats_window(self):
        """Where a stats window starts."""
        return (self.accept_counts.copy(), self.rounds_dispatched, len(self.tier_log), self.spec,
                self.grammar_rows_walked, self.grammar_rows_masked, Counter(self.bucket_rounds))

    def stats(self, window) -> SpecStats:
        acc0, round0, log0, start_tier, walked0, masked0, buckets0 = window
        acc = self.accept_counts - acc0  # request-rounds of this window by tokens emitted
        rounds = int(acc.sum())
        history = {0: start_tier} | {i - round0: t for i, t in self.tier_log[log0:]}
        return SpecStats(rounds=rounds, round_dispatches=self.rounds_dispatched - round0,
                         accept_length=float(acc @ np.arange(acc.size)) / rounds if rounds else 1.0,
                         accept_length_histogram={str(k): int(acc[k]) for k in range(1, acc.size)},
                         adaptive=self.controller is not None, tiers=[list(t.shape) for t in self.tiers],
                         tier_history={str(i): list(t.shape) for i, t in sorted(history.items())},
                         tier_switches=len(history) - 1, rounds_per_dispatch=self.rounds_per_dispatch,
                         grammar_rows_walked=self.grammar_rows_walked - walked0,
                         grammar_rows_masked=self.grammar_rows_masked - masked0,
                         adaptive_state=self.adaptive_state(self.bucket_rounds - buckets0))

    def adaptive_state(self, bucket_rounds: Counter | None = None) -> dict | None:
        """The controller's report, with each tier's round time (ms) at the bucket that ran the most rounds
        (of `bucket_rounds`, a window's; default all): a batch that drains ends at batch 1, which says
        little of where its rounds went. `rounds_by_batch` counts them per batch bucket."""
        if self.controller is None:
            return None
        out = self.controller.report()
        bucket_rounds = self.bucket_rounds if bucket_rounds is None else bucket_rounds
        if self.timed and bucket_rounds:
            main = max(bucket_rounds, key=lambda k: (bucket_rounds[k], k == self.last_bucket))
            b, kv, greedy = main
            out["bucket"] = {"batch": b, "kv": kv, "greedy": greedy}
            by_batch = Counter()
            for (bb, _, _), n in bucket_rounds.items():
                by_batch[bb] += n
            out["rounds_by_batch"] = {str(bb): n for bb, n in sorted(by_batch.items())}
            out["round_ms"] = {str(list(t.shape)): _round(self.controller.times.estimate(j, main))
                               for j, t in enumerate(self.tiers)}
            seen = self.controller.times.report(len(self.tiers), main)
            host = seen.pop("host_besides_call")  # the steps' host time besides the call (one figure)
            for what, ms in seen.items():
                out[f"round_ms_{what}"] = {str(list(t.shape)): m for t, m in zip(self.tiers, ms)}
            out["host_ms_besides_call"] = host
        return out

    def info(self) -> dict:
        acc = self.recent_accepts
        return {"speculative_num_steps": self.spec.num_steps, "speculative_tier": list(self.spec.shape),
                "avg_spec_accept_length": sum(acc) / len(acc) if acc else None} | (
                    {"adaptive": self.adaptive_state()} if self.controller is not None else {}) | (
                    {"grammar_rows": self.grammar_rows()} if self.grammar_rows_walked + self.grammar_rows_masked else {})


def _round(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 4)


def _tier(base: SpecConfig, tier: tuple[int, int, int], adaptive: AdaptiveConfig) -> SpecConfig:
    s, k, n = tier
    try:
        return dataclasses.replace(base, num_steps=s, topk=k, num_draft_tokens=n)
    except ValueError as e:
        key = "candidate_tiers" if adaptive.candidate_tiers is not None else "candidate_steps"
        raise AdaptiveConfigError(f"adaptive config: {key} {list(tier)}: {e}") from e
