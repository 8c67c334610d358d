"""Adaptive speculative decoding: the EMA and throughput policies on synthetic
acceptance sequences, round times, config validation, and tier switches in the middle of a generation
staying lossless with nothing compiled."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flax import nnx

from jeagle.speculative.adaptive import AdaptiveConfig, AdaptiveConfigError, AdaptiveController, AdaptivePolicy, TierState
from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config


def policy(initial=3, steps=(1, 3, 7), **kw):
    return AdaptivePolicy(AdaptiveConfig(candidate_steps=steps, policy="ema", **kw), steps, initial)


# ---- the policy ------------------------------------------------------------------------------------
def test_initial_steps_snap_to_the_nearest_candidate_and_the_ema_starts_at_steps_minus_one():
    for initial, want in [(1, 1), (2, 1), (3, 3), (4, 3), (5, 3), (6, 7), (7, 7), (12, 7)]:  # 2 and 5: ties → smaller
        p = policy(initial)
        assert p.current == want, initial
        assert p.ema == want - 1


def test_warmup_batches_only_feed_the_ema():
    p = policy(3, ema_alpha=0.5, warmup_batches=4, update_interval=1)
    for i in range(4):
        assert not p.update([7, 7])  # far above every up threshold, still in warm-up
        assert p.current == 3
    assert p.ema == pytest.approx(2 * 0.5**4 + 7 * (1 - 0.5**4))
    assert p.update([7]) and p.current == 7  # the first verify after warm-up decides


def test_decisions_only_every_update_interval_after_warmup():
    p = policy(3, ema_alpha=1.0, warmup_batches=2, update_interval=3)
    decided = []
    for i in range(1, 12):
        before = p.current
        target = 0 if before > 1 else 6  # always asks to move (down from 3 or 7, up from 1)
        p.update([target])
        decided.append(p.current != before)
    # batches 5 (3 → 1), 8 (1 → 7), 11 (7 → 1) = warm-up 2 + k·3 switch; no other batch does.
    assert [i for i, d in enumerate(decided, 1) if d] == [5, 8, 11]


@pytest.mark.parametrize("ema,want", [(0.25, 1), (0.3125, 3), (2.5, 3), (2.5078125, 7)])
def test_hysteresis_boundaries_exactly(ema, want):
    """At steps 3 of [1, 3, 7]: down to 1 iff ema <= 1 - 0.5 - 0.25 = 0.25; up to 7 iff ema > 3 - 0.5 + 0 = 2.5."""
    p = policy(3, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    p.update([ema])
    assert p.ema == ema and p.current == want


def test_hysteresis_values_move_the_boundaries():
    p = policy(3, ema_alpha=1.0, warmup_batches=0, update_interval=1, down_hysteresis=0.5, up_hysteresis=1.0)
    p.update([1.0])  # <= 1 - 0.5 + 0.5: down
    assert p.current == 1
    p = policy(3, ema_alpha=1.0, warmup_batches=0, update_interval=1, down_hysteresis=0.5, up_hysteresis=1.0)
    p.update([3.0])  # not > 3 - 0.5 + 1.0: stays
    assert p.current == 3
    p.update([3.5 + 2**-7])
    assert p.current == 7


def test_multi_tier_moves_up_and_down_in_one_decision():
    steps = (1, 2, 4, 6, 8)
    p = policy(1, steps=steps, ema_alpha=1.0, warmup_batches=0, update_interval=1)
    p.update([5.0])  # > 0.5, > 1.5, > 3.5, not > 5.5
    assert p.current == 6
    p.update([0.5])  # <= 3.25, <= 1.25, not <= 0.25
    assert p.current == 2
    p.update([0.0])
    assert p.current == 1
    p.update([8.0])
    assert p.current == 8  # top: no further up


def test_ema_follows_batch_means():
    p = policy(7, ema_alpha=0.2, warmup_batches=100)
    p.update([1, 2, 3])  # batch mean 2
    assert p.ema == pytest.approx(0.8 * 6 + 0.2 * 2)
    assert not p.update([])  # an empty verify changes nothing
    assert p.ema == pytest.approx(0.8 * 6 + 0.2 * 2) and p.batches == 1


def test_controller_swaps_the_state_reference():
    states = [TierState((s, 1, s + 1), s, {"exe": object()}) for s in (1, 3, 7)]
    c = AdaptiveController(AdaptiveConfig(ema_alpha=1.0, warmup_batches=0, update_interval=1, policy="ema"), states, 3)
    assert c.active is states[1]
    assert c.on_verify_complete([3, 3]) and c.active is states[2]
    assert not c.on_verify_complete([3])
    assert c.on_verify_complete([0]) and c.active is states[0]
    assert c.switches == 2 and c.verifies == 3


# ---- config ------------------------------------------------------------------------------------------
def test_config_defaults_and_json(tmp_path):
    cfg = AdaptiveConfig()  # SGLang's policy and defaults
    assert (cfg.policy, cfg.candidate_steps, cfg.ema_alpha, cfg.warmup_batches, cfg.update_interval,
            cfg.down_hysteresis, cfg.up_hysteresis) == ("ema", (1, 3, 7), 0.2, 10, 5, -0.25, 0.0)
    tp = AdaptiveConfig(policy="throughput")
    assert (tp.warmup_batches, tp.update_interval, tp.accept_window, tp.switch_margin, tp.min_dwell) == (
        8, 4, 32, 0.03, 0)
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"candidate_steps": [7, 2], "ema_alpha": 0.5, "policy": "ema"}))
    cfg = AdaptiveConfig.from_json(f)
    assert cfg.candidate_steps == (2, 7) and cfg.ema_alpha == 0.5 and cfg.update_interval == 5  # omitted: default
    f.write_text(json.dumps({"candidate_tiers": [[3, 1, 4], [5, 4, 8]]}))
    assert AdaptiveConfig.from_json(f).candidate_tiers == ((3, 1, 4), (5, 4, 8))


@pytest.mark.parametrize("doc,key", [
    ({"ema_alpa": 0.2}, "ema_alpa"),
    ({"ema_alpha": 0}, "ema_alpha"), ({"ema_alpha": 1.5}, "ema_alpha"), ({"ema_alpha": "0.2"}, "ema_alpha"),
    ({"warmup_batches": -1}, "warmup_batches"), ({"warmup_batches": 2.5}, "warmup_batches"),
    ({"warmup_batches": True}, "warmup_batches"),
    ({"update_interval": 0}, "update_interval"),
    ({"candidate_steps": []}, "candidate_steps"), ({"candidate_steps": [0, 3]}, "candidate_steps"),
    ({"candidate_steps": [3, 3]}, "candidate_steps"), ({"candidate_steps": 3}, "candidate_steps"),
    ({"candidate_tiers": [[3, 1]]}, "candidate_tiers"), ({"candidate_tiers": [[5, 4, 8], [3, 1, 4]]}, "candidate_tiers"),
    ({"down_hysteresis": float("nan")}, "down_hysteresis"), ({"up_hysteresis": None}, "up_hysteresis"),
    ({"policy": "fastest"}, "policy"), ({"accept_window": 0}, "accept_window"),
    ({"switch_margin": -0.1}, "switch_margin"), ({"switch_margin": "5%"}, "switch_margin"),
    ({"min_dwell": -1}, "min_dwell"), ({"min_dwell": 1.5}, "min_dwell"),
])
def test_config_errors_name_the_key(doc, key):
    with pytest.raises(AdaptiveConfigError, match=key):
        AdaptiveConfig.from_dict(doc)


def test_config_file_errors(tmp_path):
    with pytest.raises(AdaptiveConfigError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{candidate_steps: [1]}")
        AdaptiveConfig.from_json(tmp_path / "bad.json")
    with pytest.raises(AdaptiveConfigError, match="No such file"):
        AdaptiveConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(AdaptiveConfigError, match="JSON object"):
        (tmp_path / "list.json").write_text("[1, 3, 7]")
        AdaptiveConfig.from_json(tmp_path / "list.json")


def test_tiers_from_candidate_steps():
    assert AdaptiveConfig().tiers(3, 1, 4) == ((1, 1, 2), (3, 1, 4), (7, 1, 8))
    assert AdaptiveConfig(policy="throughput").tiers(5, 4, 8) == ((1, 4, 3), (3, 4, 5), (5, 4, 8), (7, 4, 11))  # base too
    assert AdaptiveConfig().tiers(5, 4, 8) == ((1, 4, 3), (3, 4, 5), (7, 4, 11))  # SGLang's: the base snaps
    tiers = AdaptiveConfig(candidate_steps=(1, 3, 5, 7)).tiers(5, 4, 8)
    assert (5, 4, 8) in tiers  # the base tier comes back unchanged
    assert tiers[0] == (1, 4, 3)  # N <= K + 1 at one step
    assert all(n >= s + 1 for s, _, n in tiers)


def test_invalid_tier_is_a_config_error():
    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0)
    with pytest.raises(AdaptiveConfigError, match=r"candidate_tiers \[3, 1, 5\]"):
        speculative(target, head, EngineConfig(max_batch_size=2, max_context=64), SpecConfig(3, 1, 4),
                   adaptive=AdaptiveConfig(candidate_tiers=((1, 1, 2), (3, 1, 5))))


# ---- in the engine -------------------------------------------------------------------------------------
def test_switching_tiers_mid_generation_is_lossless_and_compiles_nothing():
    """Chain and tree tiers with different K and N. The oracle head's params drive the controller up,
    then the adversary's (same graph, swapped in between calls) drive it down; every output equals
    target-only decoding and nothing compiles after the warm-up."""
    target = bigram_target(target_config())
    oracle, adversary = signed_identity_head(target, +1.0), signed_identity_head(target, -1.0)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9, 3, 7)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (20, 26, 15, 18, 22)]
    cfg = EngineConfig(max_batch_size=4, max_context=128, batch_buckets=(1, 2, 4))
    want = [o.token_ids for o in target_only(target, cfg).generate(prompts, params)]

    adaptive = AdaptiveConfig(candidate_tiers=((1, 2, 3), (2, 1, 3), (4, 2, 6)), ema_alpha=0.5, warmup_batches=2,
                              update_interval=1, policy="ema")
    engine = speculative(target, oracle, cfg, SpecConfig(2, 1, 3), adaptive=adaptive)
    engine.warmup(prefill_lengths=[9], greedy=(True,), progress=False)
    assert sum(k.phase == "round" for k in engine.warmup_plan(prefill_lengths=[9], greedy=(True,))) == 3 * 3
    # Every tier's rounds return one shape (padded: a switch then leaves the allocator's addresses and
    # XLA's command buffers as they were); the host reads each tier's own columns.
    shapes, step = set(), engine.decoder.step
    engine.decoder.step = lambda *a, **k: (lambda res: (shapes.add((engine.decoder.spec.shape, res.shape)), res)[1])(
        step(*a, **k))
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    up = engine.last_stats
    assert up.speculative.tier_history["0"] == [2, 1, 3] and list(up.speculative.tier_history.values())[-1] == [4, 2, 6]
    assert up.compilations_after_warmup == 0

    engine.decoder.params = (engine.decoder.params[0], nnx.split(adversary)[1])
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    down = engine.last_stats
    assert down.speculative.tier_history["0"] == [4, 2, 6] and list(down.speculative.tier_history.values())[-1] == [1, 2, 3]
    assert down.compilations_after_warmup == 0 and down.accept_length == 1.0
    assert up.speculative.tier_switches >= 1 and down.speculative.tier_switches >= 1 and up.speculative.adaptive
    assert engine.decoder.controller.switches == up.speculative.tier_switches + down.speculative.tier_switches
    assert len({tier for tier, _ in shapes}) == 3 and len({shape[1:] for _, shape in shapes}) == 1, shapes


def test_throughput_policy_in_the_engine_is_lossless_times_every_tier_and_follows_the_head():
    """The default policy with the tiers' round times as measured (calibrated at warm-up, then
    held fixed here so the decision is the test's, not the CPU's): the oracle head accepts every
    depth, so the deepest tier wins; the adversary accepts nothing, so the cheapest one wins; every
    output equals target-only decoding, nothing compiles after warm-up, and the stats and info report
    the policy's view."""
    target = bigram_target(target_config())
    oracle, adversary = signed_identity_head(target, +1.0), signed_identity_head(target, -1.0)
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (30, 24, 28)]
    cfg = EngineConfig(max_batch_size=4, max_context=128, batch_buckets=(1, 2, 4))
    want = [o.token_ids for o in target_only(target, cfg).generate(prompts, params)]

    tiers = ((1, 2, 3), (2, 1, 3), (4, 2, 6))
    engine = speculative(target, oracle, cfg, SpecConfig(2, 1, 3),
                         adaptive=AdaptiveConfig(candidate_tiers=tiers, warmup_batches=2, update_interval=1,
                                                 policy="throughput"))
    dec = engine.decoder
    engine.warmup(prefill_lengths=[9], greedy=(True,), progress=False)
    times = dec.controller.times
    plan = {(k.batch, k.kv_len, k.greedy) for k in engine.warmup_plan(prefill_lengths=[9], greedy=(True,))
            if k.phase == "round"}
    assert all(times.has(j, bucket) and times.calibration[j, bucket] > 0 for j in range(3) for bucket in plan)
    times.estimate = lambda j, bucket: (1.0, 1.2, 1.5)[j]  # fixed: E/T decides, not the CPU's timing noise

    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    up = engine.last_stats
    assert list(up.speculative.tier_history.values())[-1] == [4, 2, 6] and up.compilations_after_warmup == 0
    state = up.speculative.adaptive_state
    assert state["policy"] == "throughput" and state["active_tier"] == [4, 2, 6]
    assert state["round_ms"] == {"[1, 2, 3]": 1.0, "[2, 1, 3]": 1.2, "[4, 2, 6]": 1.5}
    assert all(ms > 0 for ms in state["round_ms_call"].values()) and state["host_ms_besides_call"] >= 0
    # The round times are the bucket's that ran the most of this call's rounds, not the last (batch 1).
    by_batch = state["rounds_by_batch"]
    assert sum(by_batch.values()) == up.speculative.round_dispatches and len(by_batch) > 1
    assert by_batch[str(state["bucket"]["batch"])] == max(by_batch.values())
    assert state["expected_accept_length"]["[4, 2, 6]"] > 4.0
    assert times.online, "steady-state rounds give online samples"
    assert engine.info()["adaptive"]["active_tier"] == [4, 2, 6]

    dec.params = (dec.params[0], nnx.split(adversary)[1])
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    down = engine.last_stats
    assert list(down.speculative.tier_history.values())[-1] == [1, 2, 3] and down.compilations_after_warmup == 0
    assert down.accept_length == 1.0


def test_a_bucket_not_warmed_up_is_timed_at_its_first_dispatch():
    target = bigram_target(target_config())
    engine = speculative(target, signed_identity_head(target, +1.0), EngineConfig(max_batch_size=2, max_context=64),
                         SpecConfig(2, 1, 3), adaptive=AdaptiveConfig(candidate_tiers=((1, 1, 2), (2, 1, 3)),
                                                                      policy="throughput"))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    times = engine.decoder.controller.times
    assert len(out[0].token_ids) == 8
    assert {j for j, _ in times.calibration} == {0, 1} and all(ms > 0 for ms in times.calibration.values())
