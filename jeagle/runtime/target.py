"""The target-only decoder: batched ragged prefill, then `decode_steps` tokens per decode dispatch.

A request's slots are its positions only (prompt + max_new - 1: the last token's KV is never
written); its slot-table row is written by its prefill, so a decode step needs nothing from the host
but the rows and positions. Step functions and keys: runtime/steps.py.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from jeagle.runtime.buckets import Buckets, pad
from jeagle.sampling import logprobs
from jeagle.sampling.penalties import penalty_inputs, wants_penalties
from jeagle.runtime.decoder import (Delivery, GrammarMasks, SlotTables, context_size, place_cache, prefill_batch,
                                    sampling_inputs, split_prompt_logprobs, wants_grammar, wants_logprobs,
                                    wants_prompt_logprobs, weight_bytes)
from jeagle.runtime.dispatch import Dispatching, resolve
from jeagle.runtime.executables import DeviceShapes, Executables, FlatParams
from jeagle.runtime.slots import SlotLayout, pool_size
from jeagle.runtime.steps import (DecodeInputs, DecodeKey, PrefillInputs, PrefillKey, Sampling, TargetState,
                                  TargetStatic, init_state, input_layout, layer_unroll)


class TargetDecoder(SlotTables, GrammarMasks, FlatParams, Dispatching):
    speculative = False
    swaps_slots = False  # the host's slot tables are the device's (nothing swaps positions' slots)

    def __init__(self, model, config, *, mesh=None):
        self.config, self.model_cfg, self.mesh = config, model.cfg, mesh
        self.use_dispatch_thread(config.dispatch_thread)
        if mesh is not None:
            from jeagle.parallel.sharding import shard_target

            model = shard_target(model, mesh, config.tp_vocab)
        self.graphdef, self.params = nnx.split(model)
        mc = self.model_cfg
        self.max_ctx, self.max_reqs = context_size(config, mc), config.max_batch_size
        self.layout = SlotLayout(past_last=-1)
        self.context_reserve = self.layout.context_reserve
        self.num_slots = pool_size(config, mc, self.layout, self.max_ctx, weight_bytes(self.params))
        # One executable makes the whole zeroed state (not one per array: each is a compile, or a cache hit).
        state = jax.jit(functools.partial(init_state, mc, num_slots=self.num_slots, max_reqs=self.max_reqs,
                                          max_ctx=self.max_ctx))()
        if mesh is not None:
            from jeagle.parallel.sharding import replicate

            state = TargetState(place_cache(state.cache, mesh), replicate(state.rows, mesh),
                                replicate(state.penalties, mesh))
        self.state = state
        self.scratch_row = self.max_reqs
        self.buckets = Buckets.for_engine(config, self.max_reqs, self.max_ctx, (mc.head_dim,))
        self.static = TargetStatic(model=mc, max_reqs=self.max_reqs, max_ctx=self.max_ctx, num_slots=self.num_slots,
                                   unroll_prefill=layer_unroll("prefill", config, mc),
                                   unroll_step=layer_unroll("step", config, mc), kernels=config.kernels,
                                   unroll_small_prefill=layer_unroll("small_prefill", config, mc))
        self.executables = Executables(DeviceShapes.of((self.graphdef,), self.params, state, mesh),
                                       store_dir=config.executable_cache_dir, compile_workers=config.compile_workers,
                                       compile_processes=config.compile_processes)
        self.rng = np.random.default_rng()  # the seeds of requests without one (shared under --nnodes)
        self._fast: dict[tuple, object] = {}  # (b, kv, greedy) -> decode executable, without hashing a whole key
        self._init_tables()

    # ---- keys -----------------------------------------------------------------------------------
    def prefill_key(self, b: int, t: int, logprobs: bool = False, prompt_logprobs: bool = False,
                    context: int = 0) -> PrefillKey:
        return PrefillKey(self.static, b, t, logprobs, prompt_logprobs, context)

    def decode_key(self, b: int, kv: int, greedy: bool, logprobs: bool = False, penalties: bool = False,
                   grammar: bool = False) -> DecodeKey:
        steps = 1 if grammar else self.config.decode_steps  # the host computes each next token's mask
        return DecodeKey(self.static, b, kv, steps, greedy, logprobs, penalties, grammar)

    def warmup_keys(self, prefill, decode, greedy=(True, False), logprobs=(False,), penalties=(False,),
                    grammar=(False,)) -> list:
        """Prefill keys for the (b, t) pairs (greedy and sampled rows share them; every prefill applies
        penalties and masks), decode keys for the (b, kv) pairs in each mode of `greedy`, `penalties`
        and `grammar`; each in each mode of `logprobs`."""
        return ([self.prefill_key(b, t, lp, context=c) for lp in logprobs for b, t, c in prefill]
                + [self.decode_key(b, kv, g, lp, pen, gr) for lp in logprobs for pen in penalties for gr in grammar
                   for g in greedy for b, kv in decode])

    def prefix_bound(self, prompt_len: int, max_new: int, overlap: bool) -> int:
        """The longest prefix a decode call for such a request can attend over."""
        return min(prompt_len + max_new + self.config.decode_steps, self.max_ctx)

    # ---- dispatch --------------------------------------------------------------------------------
    def prefill(self, reqs, b: int, t: int, logprobs: bool | None = None, prompt_logprobs: bool = False,
                context: int = 0):
        """logprobs: the executable with logprobs or not (None: as the requests ask; then
        prompt_logprobs too). context > 0: requests may start past position 0 (cached prefixes)."""
        tokens, lengths, starts, count, flat = prefill_batch(reqs, b, t, self.max_ctx)
        for r in reqs:
            r.dispatched = len(r.out.token_ids) + 1
        lp = wants_logprobs(reqs) if logprobs is None else logprobs
        plp = wants_prompt_logprobs(reqs) if logprobs is None else prompt_logprobs
        inputs = PrefillInputs(tokens=tokens, lengths=lengths, starts=starts,
                               row_ids=pad([r.row for r in reqs], b, self.scratch_row, np.int32),
                               slot_count=count, slot_flat=flat,
                               sampling=Sampling(*sampling_inputs(reqs, b, self.rng)),
                               penalties=penalty_inputs(reqs, b),
                               token_mask=self.token_masks(reqs, b))
        key = self.prefill_key(b, t, lp, plp, context)
        return self.dispatch(self.executables.get(key), input_layout(key).pack(inputs))

    def prime(self, key) -> None:
        """Run `key`'s executable once on padding rows only (the scratch row, which every padded batch
        computes on anyway), so that the first dispatch a request waits on does not pay the
        executable's first run on the device. Leaves nothing pending."""
        if key.phase == "prefill":
            out = self.prefill([], key.batch, key.length, logprobs=key.logprobs, prompt_logprobs=key.prompt_logprobs,
                               context=key.context)
        elif key.phase == "decode":
            inputs = DecodeInputs(row_ids=pad([], key.batch, self.scratch_row, np.int32),
                                  positions=pad([], key.batch, 0, np.int32))
            if key.grammar:  # a grammar step also takes each row's token mask (every token allowed)
                inputs = (inputs, self.token_masks([], key.batch))
            out = self.dispatch(self.executables.get(key), inputs)
        else:
            return
        jax.block_until_ready((resolve(out), self.state))

    def calibrate_keys(self, keys, compile: bool = True) -> None:
        """Nothing to time: one decode step, no tiers."""

    def host_step(self, seconds: float) -> None:
        """Nothing weighs it: no tiers."""

    def dropped(self) -> None:
        """Nothing kept per dispatch."""

    def walks(self, params) -> bool:
        """Never: every grammar step takes the batch's next-token masks at once (`grammar.next_masks`)."""
        return False

    def wants_step(self, r) -> bool:
        """Until its last token is dispatched."""
        return not r.done and r.dispatched < r.max_new

    def prefix_needed(self, r) -> int:
        return r.length + self.config.decode_steps

    def step(self, reqs, b: int, kv: int, drain=None):  # grammar steps: the scheduler drained first
        grammar = wants_grammar(reqs)
        steps = 1 if grammar else self.config.decode_steps
        inputs = DecodeInputs(row_ids=pad([r.row for r in reqs], b, self.scratch_row, np.int32),
                              positions=pad([r.length for r in reqs], b, 0, np.int32))
        if grammar:  # the masks after each request's tokens so far (the scheduler read them all)
            inputs = (inputs, self.token_masks(reqs, b))
        for r in reqs:
            r.length += steps
            r.dispatched += steps
        mode = (all(r.params.greedy for r in reqs), wants_logprobs(reqs), wants_penalties(reqs), grammar)
        exe = self._fast.get((b, kv, *mode))
        if exe is None:
            exe = self._fast[(b, kv, *mode)] = self.executables.get(self.decode_key(b, kv, *mode))
        return self.dispatch(exe, inputs)

    def verify_handle(self, result):
        return None  # target-only steps have no verify to wait on

    def unpack(self, kind: str, reqs, host: np.ndarray) -> list[Delivery]:
        """The host alone decides when a request ends (finished is always False)."""
        host = host[: len(reqs)]
        if not wants_logprobs(reqs):
            return [Delivery(tokens, False) for tokens in host]
        width = 1 if kind == "prefill" or wants_grammar(reqs) else self.config.decode_steps
        prompt = [None] * len(reqs)
        if kind == "prefill":
            host, prompt = split_prompt_logprobs(host, reqs, width * (1 + logprobs.LOGPROB_COLUMNS))
        tokens, blocks = logprobs.split(host, width)
        return [Delivery(t, False, blk if r.params.logprobs is not None else None, p)  # blk: a view [W, C]
                for r, t, blk, p in zip(reqs, tokens, blocks, prompt)]

    # ---- stats -----------------------------------------------------------------------------------
    def stats_window(self):
        return None

    def stats(self, window):
        return None

    def info(self) -> dict:
        return {}
