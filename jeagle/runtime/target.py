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
from jeagle.runtime.decoder import context_size, place_cache, sampling_inputs, weight_bytes
from jeagle.runtime.executables import DeviceShapes, Executables
from jeagle.runtime.slots import SlotLayout, flat_slots, pool_size
from jeagle.runtime.steps import (DecodeInputs, DecodeKey, PrefillInputs, PrefillKey, Sampling, TargetState,
                                  TargetStatic, init_state, layer_unroll)


class TargetDecoder:
    speculative = False

    def __init__(self, model, config, *, mesh=None):
        self.config, self.model_cfg, self.mesh = config, model.cfg, mesh
        if mesh is not None:
            from jeagle.sharding import shard_target

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
            from jeagle.sharding import replicate

            state = TargetState(place_cache(state.cache, mesh), replicate(state.rows, mesh))
        self.state = state
        self.scratch_row = self.max_reqs
        self.buckets = Buckets.for_engine(config, self.max_reqs, self.max_ctx, (mc.head_dim,))
        self.static = TargetStatic(model=mc, max_reqs=self.max_reqs, max_ctx=self.max_ctx, num_slots=self.num_slots,
                                   unroll_prefill=layer_unroll("prefill", config, mc),
                                   unroll_step=layer_unroll("step", config, mc), kernels=config.kernels)
        self.executables = Executables(DeviceShapes.of((self.graphdef,), self.params, state, mesh),
                                       store_dir=config.executable_cache_dir, compile_workers=config.compile_workers,
                                       compile_processes=config.compile_processes)
        self._rng = np.random.default_rng()
        self._fast: dict[tuple, object] = {}  # (b, kv, greedy) -> decode executable, without hashing a whole key

    # ---- keys -----------------------------------------------------------------------------------
    def prefill_key(self, b: int, t: int) -> PrefillKey:
        return PrefillKey(self.static, b, t)

    def decode_key(self, b: int, kv: int, greedy: bool) -> DecodeKey:
        return DecodeKey(self.static, b, kv, self.config.decode_steps, greedy)

    def warmup_keys(self, prefill, decode, greedy=(True, False)) -> list:
        """Prefill keys for the (b, t) pairs (greedy and sampled rows share them), decode keys for the
        (b, kv) pairs in each mode of `greedy`."""
        return ([self.prefill_key(b, t) for b, t in prefill]
                + [self.decode_key(b, kv, g) for g in greedy for b, kv in decode])

    def prefix_bound(self, prompt_len: int, max_new: int, overlap: bool) -> int:
        """The longest prefix a decode call for such a request can attend over."""
        return min(prompt_len + max_new + self.config.decode_steps, self.max_ctx)

    # ---- dispatch --------------------------------------------------------------------------------
    def _run(self, exe, inputs):
        out, self.state = exe(self.params, self.state, inputs)
        out.copy_to_host_async()  # the host reads it a step later; this copy is then done
        return out

    def prefill(self, reqs, b: int, t: int):
        tokens = np.zeros((b, t), np.int32)
        for i, r in enumerate(reqs):
            tokens[i, : len(r.prompt)] = r.prompt
            r.length, r.dispatched = len(r.prompt), 1
        count, flat = flat_slots(b, self.max_ctx, [r.slots for r in reqs])
        inputs = PrefillInputs(tokens=tokens, lengths=pad([len(r.prompt) for r in reqs], b, 0, np.int32),
                               row_ids=pad([r.row for r in reqs], b, self.scratch_row, np.int32),
                               slot_count=count, slot_flat=flat,
                               sampling=Sampling(*sampling_inputs(reqs, b, self._rng)))
        return self._run(self.executables.get(self.prefill_key(b, t)), inputs)[:, None]

    def prime(self, key) -> None:
        """Run `key`'s executable once on padding rows only (the scratch row, which every padded batch
        computes on anyway), so that the first dispatch a request waits on does not pay the
        executable's first run on the device. Leaves nothing pending."""
        if key.phase == "prefill":
            out = self.prefill([], key.batch, key.length)
        elif key.phase == "decode":
            out = self._run(self.executables.get(key), DecodeInputs(
                row_ids=pad([], key.batch, self.scratch_row, np.int32), positions=pad([], key.batch, 0, np.int32)))
        else:
            return
        jax.block_until_ready((out, self.state))

    def calibrate_keys(self, keys, compile: bool = True) -> None:
        """Nothing to time: one decode step, no tiers."""

    def dropped(self) -> None:
        """Nothing kept per dispatch."""

    def wants_step(self, r) -> bool:
        """Until its last token is dispatched."""
        return not r.done and r.dispatched < r.max_new

    def prefix_needed(self, r) -> int:
        return r.length + self.config.decode_steps

    def step(self, reqs, b: int, kv: int):
        steps = self.config.decode_steps
        inputs = DecodeInputs(row_ids=pad([r.row for r in reqs], b, self.scratch_row, np.int32),
                              positions=pad([r.length for r in reqs], b, 0, np.int32))
        for r in reqs:
            r.length += steps
            r.dispatched += steps
        greedy = all(r.params.greedy for r in reqs)
        exe = self._fast.get((b, kv, greedy))
        if exe is None:
            exe = self._fast[b, kv, greedy] = self.executables.get(self.decode_key(b, kv, greedy))
        return self._run(exe, inputs)

    def verify_handle(self, result):
        return None  # target-only steps have no verify to wait on

    def unpack(self, kind: str, reqs, host: np.ndarray) -> list[tuple[np.ndarray, bool]]:
        return [(tokens, False) for tokens in host[: len(reqs)]]  # the host alone decides when a request ends

    # ---- stats -----------------------------------------------------------------------------------
    def stats_window(self):
        return None

    def stats(self, window):
        return None

    def info(self) -> dict:
        return {}
