"""The runtime around the round: identical outputs with overlap on/off, sync/dataflow waits,
padded/unpadded buckets while the batch grows and shrinks; nothing compiles after warm-up; stats."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.runtime.buckets import batch_buckets
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config

# (overlap, verify_done_wait, disable_padding)
MODES = [(True, "sync", False), (True, "dataflow", False), (False, "sync", False), (True, "dataflow", True)]


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.08)


@pytest.fixture(scope="module")
def workload():
    """More requests than rows (the batch grows as rows free up) with different lengths (it shrinks)."""
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9, 3, 7)]
    return prompts, [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (4, 15, 9, 12, 6)]


def spec_engine(target, head, overlap, wait, padding, batch=4):
    cfg = EngineConfig(max_batch_size=batch, max_context=96, overlap=overlap, verify_done_wait=wait,
                       disable_padding=padding, batch_buckets=None if padding else (1, 2, 4))
    return speculative(target, head, cfg, SpecConfig(3, 2, 5))


def test_identical_outputs_across_runtime_modes(target, head, workload):
    prompts, params = workload
    want = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=4, max_context=96)).generate(prompts, params)]
    steps = {}
    for overlap, wait, padding in MODES:
        engine = spec_engine(target, head, overlap, wait, padding)
        got = [o.token_ids for o in engine.generate(prompts, params)]
        assert got == want, (overlap, wait, padding)
        stats = engine.last_stats
        assert len(stats.buckets_used) >= 2, stats.buckets_used  # the batch crossed buckets
        assert stats.overlap == overlap and stats.verify_done_wait == wait
        assert stats.host_blocked_ms["p99"] >= stats.host_blocked_ms["p50"] >= 0
        # The host's time per step: the dispatch is part of the step's busy time; the totals add up.
        assert 0 < stats.host_dispatch_ms["mean"] <= stats.host_busy_ms["mean"]
        assert stats.host_prefill_dispatch_ms["p50"] > 0
        tot = engine.info()["host_totals"]
        assert tot["steps"] == stats.steps and tot["prefills"] >= 1
        assert tot["busy_s"] >= tot["dispatch_s"] > 0 and tot["blocked_s"] >= 0
        assert not engine.verify_done.pending
        steps[overlap, wait, padding] = stats.steps
    # Overlap dispatches the round after a request's last before it learns the request finished.
    assert steps[True, "sync", False] > steps[False, "sync", False]


def test_sampled_outputs_do_not_depend_on_runtime_mode(target, head, workload):
    prompts, params = workload
    params = [SamplingParams(max_new_tokens=p.max_new_tokens, ignore_eos=True, temperature=0.8, seed=i)
              for i, p in enumerate(params)]
    outs = {m: [o.token_ids for o in spec_engine(target, head, *m).generate(prompts, params)] for m in MODES[:3]}
    assert len({tuple(map(tuple, v)) for v in outs.values()}) == 1, outs


def test_nothing_compiles_after_warmup(target, head, workload):
    prompts, params = workload
    engine = spec_engine(target, head, True, "sync", False)
    plan = engine.warmup_plan(prefill_lengths=[max(map(len, prompts))], greedy=(True,))
    assert {(k.phase, k.batch) for k in plan} == {("prefill", b) for b in (1, 2, 4)} | {("round", b) for b in (1, 2, 4)}
    seconds = engine.warmup(prefill_lengths=[max(map(len, prompts))], greedy=(True,), progress=False)
    assert seconds > 0 and engine.num_compiled == len(plan)
    engine.generate(prompts, params)
    stats = engine.last_stats
    assert stats.compilations_after_warmup == 0 and stats.warmup_s == seconds
    assert len(stats.buckets_used) >= 2


def test_autoregressive_engine_overlap_off_and_warmup(target, workload):
    prompts, params = workload
    want = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=4, max_context=96)).generate(prompts, params)]
    engine = target_only(target, EngineConfig(max_batch_size=4, max_context=96, overlap=False, batch_buckets=(1, 2, 4)))
    engine.warmup(prefill_lengths=[max(map(len, prompts))], greedy=(True,), progress=False)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert engine.last_stats.compilations_after_warmup == 0
    assert engine.last_stats.verify_done_wait == "dataflow"  # the default, recorded though only rounds wait on it


def test_bucket_options():
    assert batch_buckets(6, EngineConfig(disable_padding=True)) == (1, 2, 3, 4, 5, 6)
    assert batch_buckets(48, EngineConfig())[-4:] == (32, 40, 44, 48)  # SGLang: ..32 step 2, 40..64 step 4
    assert batch_buckets(12, EngineConfig(batch_buckets=(8, 1, 16))) == (1, 8, 16)
    assert batch_buckets(16, EngineConfig(max_bucket=20)) == batch_buckets(16, EngineConfig())
    with pytest.raises(ValueError, match="max-bucket 8 < max running requests 16"):
        batch_buckets(16, EngineConfig(max_bucket=8))
    with pytest.raises(ValueError, match="largest batch bucket 8 < max running requests 16"):
        batch_buckets(16, EngineConfig(batch_buckets=(1, 8)))


def test_prefix_bound_covers_what_dispatch_asks_for(target, head):
    """The CLI warms up prefix buckets up to the decoder's prefix_bound: with overlap a round is
    dispatched while another is unread, so L may run (S+1) past the tokens received twice."""
    s1 = 4  # SpecConfig(3, 2, 5)
    dec = spec_engine(target, head, True, "sync", False).decoder
    assert dec.prefix_bound(16, 40, True) >= 16 + 40 - 1 + 2 * s1 and dec.prefix_bound(16, 40, False) >= 16 + 40 - 1 + s1
    assert dec.prefix_bound(90, 40, True) == dec.max_ctx


def test_prefill_buckets():
    from jeagle.runtime.buckets import pow2_buckets, prefill_batch_buckets, prefill_length_buckets

    assert prefill_batch_buckets(batch_buckets(48, EngineConfig()), EngineConfig()) == (1, 4, 16, 48)
    assert prefill_batch_buckets((1, 2, 4), EngineConfig(batch_buckets=(1, 2, 4))) == (1, 2, 4)  # as given
    assert pow2_buckets(64, 2048, factor=4) == (64, 256, 1024, 2048)
    # Prompt lengths: x4 to 1,024, then x2 (a long prompt pads to at most twice its length).
    assert prefill_length_buckets(64, 8192) == (64, 256, 1024, 2048, 4096, 8192)
    assert prefill_length_buckets(64, 3000) == (64, 256, 1024, 2048, 3000)
    assert prefill_length_buckets(16, 96) == (16, 64, 96)
    assert prefill_length_buckets(64, 64) == (64,)


def test_warm_start_loads_every_executable_from_the_store(target, head, workload, tmp_path, caplog, no_xla_cache):
    prompts, params = workload
    lengths = [max(map(len, prompts))]

    def engine():
        cfg = EngineConfig(max_batch_size=4, max_context=96, batch_buckets=(1, 2, 4), executable_cache_dir=str(tmp_path),
                           compile_workers=2)
        return speculative(target, head, cfg, SpecConfig(3, 2, 5))

    cold = engine()
    plan = cold.warmup_plan(prefill_lengths=lengths, greedy=(True,))
    cold.warmup(prefill_lengths=lengths, greedy=(True,), progress=False)
    assert cold.executables.store.saved == len(plan) and cold.executables.store.loaded == 0
    want = [o.token_ids for o in cold.generate(prompts, params)]

    warm = engine()
    warm.warmup(prefill_lengths=lengths, greedy=(True,), progress=False)
    assert warm.executables.store.loaded == len(plan) and warm.executables.store.saved == 0  # nothing traced, lowered or compiled
    assert [o.token_ids for o in warm.generate(prompts, params)] == want
    assert warm.last_stats.compilations_after_warmup == 0

    # A damaged entry is logged and recompiled; a different tier is a different key.
    victim = sorted(warm.executables.store.dir.glob("*.jexe"))[0]
    victim.write_bytes(b"not an executable")
    again = engine()
    again.warmup(prefill_lengths=lengths, greedy=(True,), progress=False)
    assert again.executables.store.loaded == len(plan) - 1 and again.executables.store.saved == 1
    assert "could not load the stored executable" in caplog.text
    other = speculative(target, head, EngineConfig(max_batch_size=4, max_context=96, batch_buckets=(1, 2, 4),
                                                  executable_cache_dir=str(tmp_path)), SpecConfig(2, 2, 3))
    exes = other.executables
    assert not any(exes.store.has(k, exes.build(k).args) for k in other.warmup_plan(prefill_lengths=lengths, greedy=(True,)))


def test_preload_for_a_warm_start_compiles_nothing(target, head, workload, tmp_path, no_xla_cache):
    """A second start without a warm-up (what `jeagle.generate` does): `preload_for` loads what the first
    start compiled and stored, and runs each once on padding rows; generate() then compiles and loads
    nothing, and the tokens are the first start's (priming leaves the requests' rows alone)."""
    prompts, params = workload

    def engine(with_head):
        cfg = EngineConfig(max_batch_size=4, max_context=96, batch_buckets=(1, 2, 4), executable_cache_dir=str(tmp_path))
        return speculative(target, head, cfg, SpecConfig(3, 2, 5)) if with_head else target_only(target, cfg)

    for with_head in (True, False):
        cold = engine(with_head)
        assert cold.preload_for(list(map(len, prompts)), 15, greedy=(True,)) == 0  # an empty store: nothing
        want = [o.token_ids for o in cold.generate(prompts, params)]
        stored = cold.executables.store.saved
        assert stored == cold.num_compiled > 1 and cold.last_stats.compilations == stored

        warm = engine(with_head)
        primed, prime = [], warm.decoder.prime
        warm.decoder.prime = lambda key: primed.append(key) or prime(key)
        assert warm.preload_for(list(map(len, prompts)), 15, greedy=(True,)) == stored == len(primed)
        compile_s = warm.compile_seconds
        assert [o.token_ids for o in warm.generate(prompts, params)] == want
        stats = warm.last_stats
        assert stats.compilations == 0 and warm.compile_seconds == compile_s and stats.compile_s == 0
        assert warm.executables.store.saved == 0 and stats.executables_from_store == stored
        assert stats.compilations_after_warmup is None  # a preload is not a warm-up
        assert warm.xla_compilations_after_warmup == 0  # JAX's count since the preload: nothing compiled either


def test_warmup_primes_each_executable_once_where_asked(target, head, workload):
    """On a GPU a warm-up runs every executable it compiled once on padding rows (the first run's cost
    leaves the first request's TTFT); the tokens are unchanged, nothing compiles afterwards, and a second
    warm-up primes nothing again. CPUs skip it (`prime_after_warmup`)."""
    import jax

    prompts, params = workload
    cfg = EngineConfig(max_batch_size=4, max_context=96, batch_buckets=(4,))  # one bucket: fewer compiles
    # Target-only in every mode a server warms up (its grammar steps take token masks too).
    all_modes = dict(greedy=(True,), logprobs=(False, True), penalties=(False, True), grammar=(False, True))
    for make, modes in ((lambda: target_only(target, cfg), all_modes),
                        (lambda: speculative(target, head, cfg, SpecConfig(3, 2, 5)), dict(greedy=(True,)))):
        plain = make()
        assert plain.prime_after_warmup == (jax.default_backend() == "gpu")
        want = [o.token_ids for o in plain.generate(prompts, params)]

        engine = make()
        engine.prime_after_warmup = True
        primed, prime = [], engine.decoder.prime
        engine.decoder.prime = lambda key: primed.append(key) or prime(key)
        plan = engine.warmup_plan(prefill_lengths=list(map(len, prompts)), **modes)
        engine.warmup(prefill_lengths=list(map(len, prompts)), progress=False, **modes)
        assert sorted(map(str, primed)) == sorted(map(str, dict.fromkeys(plan)))
        engine.warmup(prefill_lengths=list(map(len, prompts)), progress=False, **modes)
        assert len(primed) == len(dict.fromkeys(plan))
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        assert engine.last_stats.compilations_after_warmup == 0
        engine.check_kv()


def test_store_skips_saving_on_cpu_with_the_compilation_cache(target, head, workload, tmp_path, caplog):
    """The conftest turns JAX's compilation cache on; on XLA:CPU a cache-loaded executable serializes
    without its functions, so the store saves nothing (with one warning) and the engine still runs."""
    import jax

    if jax.default_backend() != "cpu" or not jax.config.jax_compilation_cache_dir:
        pytest.skip("the guard is for XLA:CPU with the compilation cache on (the conftest's default on CPU)")
    prompts, params = workload
    cfg = EngineConfig(max_batch_size=4, max_context=96, batch_buckets=(4,), executable_cache_dir=str(tmp_path))
    engine = speculative(target, head, cfg, SpecConfig(3, 2, 5))
    outs = engine.generate(prompts, params)
    assert all(o.token_ids for o in outs) and engine.executables.store.saved == 0 and engine.num_compiled > 1
    assert caplog.text.count("not saving on CPU while JAX's compilation cache is on") == 1


def test_cold_warmup_in_worker_processes(tmp_path, no_xla_cache):
    """Worker processes rebuild the device shapes from the step keys' configs (tiers included), compile
    the plan into the store, and the engine loads all of it: same executables (same store keys), same
    tokens as an engine that compiled itself."""
    import dataclasses

    from jeagle.models.eagle import random_draft
    from jeagle.models.llama import random_model
    from tests.spec_models import draft_config

    cfg = dataclasses.replace(target_config(), head_dim=16)
    target, head = random_model(cfg, seed=1), random_draft(dataclasses.replace(draft_config(cfg), head_dim=16), seed=2)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in speculative(target, head, EngineConfig(max_batch_size=2, max_context=96),
                                            SpecConfig(3, 2, 5)).generate(prompts, params)]
    # Adaptive with two tiers: the workers rebuild the tiers too (round keys carry the tier).
    from jeagle.speculative.adaptive import AdaptiveConfig

    engine = speculative(target, head, EngineConfig(max_batch_size=2, max_context=96, executable_cache_dir=str(tmp_path),
                                                   compile_processes=2, compile_workers=1), SpecConfig(3, 2, 5),
                        adaptive=AdaptiveConfig(candidate_tiers=((1, 1, 2), (3, 2, 5)), warmup_batches=100))
    plan = engine.warmup_plan(prefill_lengths=[4], greedy=(True,))
    assert {k.tier for k in plan if k.phase == "round"} == set(engine.decoder.tiers) and len(engine.decoder.tiers) == 2
    engine.warmup(prefill_lengths=[4], greedy=(True,), progress=False)
    assert engine.executables.store.loaded == len(plan) and engine.executables.store.saved == 0  # all compiled by the workers
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert engine.last_stats.compilations_after_warmup == 0


def test_request_take_ends_at_the_first_stop_token_or_max_new_like_a_token_by_token_walk():
    """`Request.take` cuts each delivery with slices and one set test; it must end a request exactly where
    walking the tokens one by one would: the first stop token (taken, and `stop` even when it is also the
    max_new-th token), else the max_new-th token (`length`); nothing is taken after either."""
    from jeagle.runtime.requests import Output, Request

    def walk(max_new, eos, chunks):
        ids, reason = [], None
        for chunk in chunks:
            for tok in chunk:
                if reason:
                    break
                ids.append(int(tok))
                reason = "stop" if tok in eos else "length" if len(ids) >= max_new else None
        return ids, reason

    rng = np.random.default_rng(0)
    for _ in range(2000):
        max_new, eos = int(rng.integers(1, 12)), frozenset(rng.integers(0, 6, int(rng.integers(0, 3))).tolist())
        chunks = [rng.integers(0, 8, int(rng.integers(0, 5))).astype(np.int32) for _ in range(6)]
        r = Request(index=0, prompt=[1], params=SamplingParams(max_new_tokens=max_new), eos=eos, max_new=max_new,
                    out=Output(prompt_ids=[1]))
        taken = [r.take(c if i % 2 else c.tolist(), 0.0) for i, c in enumerate(chunks)]  # arrays and lists
        assert (r.out.token_ids, r.out.finish_reason) == walk(max_new, eos, chunks)
        assert sum(taken, []) == r.out.token_ids and all(type(t) is int for t in r.out.token_ids)
        assert r.done == (r.out.finish_reason is not None)
