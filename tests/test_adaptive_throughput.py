"""The adaptive throughput policy: expected tokens per second from observed, nested and
depth-model accept lengths, round times and dwell; in the engine, nested tiers' would-be accept
lengths equal running those tiers, and the policy stays lossless."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.speculative.adaptive import AdaptiveConfig, AdaptiveController, TierState
from jeagle.speculative.adaptive_throughput import SEED_ROUNDS, STALE_DECAY, RoundTimes, ThroughputPolicy, nested_tiers
from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config


# ---- the throughput policy ---------------------------------------------------------------------------
TIERS = ((1, 4, 3), (3, 4, 5), (7, 4, 11))  # reach 1, 3, 7


def throughput(initial=1, tiers=TIERS, **kw):
    kw = {"warmup_batches": 0, "update_interval": 1, "accept_window": 10_000, "policy": "throughput", "min_dwell": 0,
          **kw}
    return ThroughputPolicy(AdaptiveConfig(**kw), tiers, initial)


def test_counts_equal_a_per_request_reference():
    """observe / record keep the counts a per-request loop keeps (depth d tried by a request that
    accepted d - 1, passed by one that accepted d; a tier's tokens = accepted + 1 over the requests it
    saw), whatever shape `nested` comes in; a wrong count of nested values is an error."""
    rng = np.random.default_rng(4)
    tiers = ((1, 4, 3), (3, 4, 5), (5, 4, 8), (7, 4, 11))
    pol, keep_w = throughput(initial=2, tiers=tiers, accept_window=32), 1.0 - 1.0 / 32
    tried, passed, tokens, weight = [0.0] * 8, [0.0] * 8, np.zeros(4), np.zeros(4)
    for _ in range(40):
        reach = int(rng.integers(1, 8))
        acc = rng.integers(0, 9, int(rng.integers(1, 17))).tolist()
        keep = keep_w ** len(acc)
        tried = [x * (keep if d <= reach else keep**STALE_DECAY) for d, x in enumerate(tried)]
        passed = [x * (keep if d <= reach else keep**STALE_DECAY) for d, x in enumerate(passed)]
        for a in acc:
            a = min(a, reach)
            for d in range(1, a + 1):
                passed[d] += 1.0
            for d in range(1, min(a + 1, reach) + 1):
                tried[d] += 1.0
        pol.observe(acc, reach)
        assert pol.tried[1:] == pytest.approx(tried[1:]) and pol.passed[1:] == pytest.approx(passed[1:])

        would = rng.integers(-1, 5, (len(acc), 2))  # (5,4,8) nests (1,4,3) and (3,4,5)
        tokens, weight = tokens * keep, weight * keep
        tokens[2], weight[2] = tokens[2] + sum(acc) + len(acc), weight[2] + len(acc)
        for col, j in enumerate((0, 1)):
            known = would[:, col][would[:, col] >= 0]
            tokens[j], weight[j] = tokens[j] + known.sum() + len(known), weight[j] + len(known)
        pol.record(acc, 2, would.tolist() if len(acc) % 2 else would.reshape(-1).tolist())
        assert pol.tokens == pytest.approx(tokens) and pol.weight == pytest.approx(weight)
    with pytest.raises(ValueError, match="nested"):
        pol.record([1, 2], 2, [[0, 1]])


def test_buffered_verifies_give_the_counts_of_verify_by_verify_updates():
    """update() buffers verifies and folds them when a decision is due (every update_interval), when
    MAX_PENDING wait, or when the estimates are read: the counts equal observe/record one verify at a
    time, whichever way the buffer was cut (a report in between changes nothing), with verifies of
    two tiers, with and without nested values, arrays or lists; a wrong count of nested values is an
    error at once, and the decoder's arrays are copied, not kept."""
    rng = np.random.default_rng(7)
    tiers = ((1, 4, 3), (3, 4, 5), (5, 4, 8), (7, 4, 11))
    times = lambda j: None  # noqa: E731  (no round times: no decision moves the tier)
    verifies = []
    for v in range(23):
        ran = 1 if v in (5, 6, 17) else 2  # (3,4,5) nests (1,4,3); (5,4,8) nests both
        n = int(rng.integers(1, 17))
        would = None if v == 11 else rng.integers(-1, 4, (n, 1 if ran == 1 else 2))
        verifies.append((ran, rng.integers(-1, 7, n), would))
    runs = []
    for interval, polls in ((4, ()), (3, (2, 9, 10)), (50, ())):  # 50: folded by MAX_PENDING only
        pol = throughput(initial=2, tiers=tiers, accept_window=24, update_interval=interval)
        for v, (ran, acc, would) in enumerate(verifies):
            buf = acc.copy()
            assert not pol.update(buf if v % 2 else buf.tolist(), ran, times, would)
            buf[:] = 99  # the decoder's buffer reused: what waits must not change
            if v in polls:
                pol.expected_tokens()  # /server_info reads the estimates: it folds what waits
        pol.expected_tokens()
        runs.append(pol)
    ref = throughput(initial=2, tiers=tiers, accept_window=24)
    for ran, acc, would in verifies:
        ref.observe(acc, ref.reach[ran])
        ref.record(acc, ran, would)
    for pol in runs:
        assert pol._pending == []
        assert pol.tried == pytest.approx(ref.tried) and pol.passed == pytest.approx(ref.passed)
        assert pol.tokens == pytest.approx(ref.tokens) and pol.weight == pytest.approx(ref.weight)
    with pytest.raises(ValueError, match="nested"):
        runs[0].update([1, 2], 2, times, [[0, 1]])


def test_window_verifies_spans_that_many_verifies_and_folds_like_single_updates():
    """window_verifies m: a verify of n requests keeps (1 - 1/max(W, m n))^n of the counts (W =
    accept_window), so a batch of 16 remembers ~m verifies where W = 32 alone is two; a batch of one
    is unchanged. Buffered verifies of varying sizes fold to the counts of single updates."""
    pol = throughput(accept_window=32, window_verifies=8)
    assert pol.keep(16) == pytest.approx((1 - 1 / 128) ** 16) and pol.keep(1) == pytest.approx(1 - 1 / 32)
    assert throughput(accept_window=32).keep(16) == pytest.approx((1 - 1 / 32) ** 16)
    pol.observe([3] * 16, reach=3)
    pol.observe([0] * 16, reach=3)  # one verify of 16 later
    assert pol.passed[3] == pytest.approx(16 * (1 - 1 / 128) ** 16)
    rng = np.random.default_rng(3)
    tiers = ((1, 4, 3), (3, 4, 5), (5, 4, 8))
    verifies = []
    for v in range(19):  # (3,4,5) nests (1,4,3); (5,4,8) nests both; every fifth verify without nested values
        ran, n = (2 if v % 7 else 1), int(rng.integers(1, 17))
        would = None if v % 5 == 4 else rng.integers(-1, 4, (n, ran))
        verifies.append((ran, rng.integers(0, 6, n), would))
    buffered = throughput(initial=2, tiers=tiers, accept_window=24, window_verifies=6, update_interval=5)
    ref = throughput(initial=2, tiers=tiers, accept_window=24, window_verifies=6)
    for ran, acc, would in verifies:
        buffered.update(acc, ran, lambda j: None, would)
        ref.observe(acc, ref.reach[ran])
        ref.record(acc, ran, would)
    buffered.expected_tokens()
    assert buffered.tried == pytest.approx(ref.tried) and buffered.passed == pytest.approx(ref.passed)
    assert buffered.tokens == pytest.approx(ref.tokens) and buffered.weight == pytest.approx(ref.weight)
    # At a switch the seed is SEED_ROUNDS of the window at the last verify's size: 0.25 x 8 x 16.
    pol = throughput(initial=0, accept_window=32, window_verifies=8, update_interval=1)
    assert pol.update([1] * 16, 0, lambda j: (1.0, 1.2, 6.0)[j]) and pol.index == 1
    assert pol.weight == pytest.approx([SEED_ROUNDS * 8 * 16] * 3)


def geometric_rounds(rng, p, reach, n):
    """n accepted-draft counts of rounds whose every depth passes with probability p, capped at reach."""
    out = []
    for _ in range(n):
        a = 0
        while a < reach and rng.random() < p:
            a += 1
        out.append(a)
    return out


def test_expected_tokens_recover_a_known_acceptance_through_censoring():
    """Rounds of reach 3 (depths past 3 never tried) at p = 0.8 per depth: p_1..p_3 are estimated from
    the data, deeper ones extrapolate the deepest tried, so every tier's E is near the truth."""
    rng = np.random.default_rng(0)
    pol = throughput(initial=1, warmup_batches=10**9)
    for _ in range(400):
        pol.observe(geometric_rounds(rng, 0.8, 3, 8), reach=3)
    rates = pol.accept_rates()
    assert rates[:3] == pytest.approx([0.8] * 3, abs=0.03) and rates[6] == pytest.approx(rates[2], abs=1e-3)
    truth = [1 + sum(0.8**d for d in range(1, r + 1)) for r in (1, 3, 7)]
    assert pol.expected_tokens() == pytest.approx(truth, rel=0.04)


def test_a_depth_never_reached_keeps_the_prior_of_the_one_above():
    pol = throughput()
    pol.observe([0, 0, 0, 0], reach=7)  # depth 1 always fails: depths 2.. never tried
    rates = pol.accept_rates()
    assert rates[0] == pytest.approx((0 + 2 * 0.5) / (4 + 2)) and all(r == pytest.approx(rates[0]) for r in rates)
    assert pol.tried[2:] == [0.0] * 6 and pol.passed[1:] == [0.0] * 7


def test_counts_decay_over_the_accept_window_in_request_rounds():
    pol = throughput(accept_window=4)
    pol.observe([3], reach=3)
    pol.observe([0, 0], reach=3)  # two request-rounds age the counts twice
    assert pol.passed[3] == pytest.approx(0.75**2) and pol.tried[1] == pytest.approx(0.75**2 + 2)
    pol.observe([], reach=3)  # nothing observed: nothing ages
    assert pol.passed[3] == pytest.approx(0.75**2)


def test_counts_past_the_running_reach_fade_faster():
    """A deep tier failed in an earlier phase; now a shallow tier accepts everything: the deep depths'
    old failures fade STALE_DECAY times faster, so the deep tier is tried again within a window."""
    pol = throughput(initial=2, accept_window=8)
    pol.observe([3] * 8, reach=7)  # depth 4 fails in the old phase
    pol.observe([3] * 8, reach=3)  # the shallow tier: depths 1..3 pass, depth 4 unseen
    old4 = (1 - 1 / 8) ** 8
    assert pol.tried[4] == pytest.approx(8 * old4**4) and pol.tried[3] == pytest.approx(8 * old4 + 8)
    for _ in range(3):
        pol.observe([3] * 8, reach=3)
    assert pol.accept_rates()[3] > 0.9  # the prior (depth 3's ~1) wins over the faded failure


@pytest.mark.parametrize("p,times,want", [
    (0.9, (1.0, 1.3, 2.0), 2),  # accepts deep: the 7-step tier pays (E 5.8 / 2.0 vs 3.4 / 1.3)
    (0.9, (1.0, 1.3, 5.0), 1),  # ... unless its round costs 5 short ones
    (0.3, (1.0, 1.3, 2.0), 0),  # accepts little: the cheapest round wins
])
def test_decisions_maximise_expected_tokens_per_second(p, times, want):
    rng = np.random.default_rng(1)
    pol = throughput(initial=1)
    for _ in range(200):
        pol.update(geometric_rounds(rng, p, pol.reach[pol.index], 16), pol.index, lambda j: times[j])
    assert pol.index == want
    e = pol.expected_tokens()
    assert max(range(3), key=lambda j: e[j] / times[j]) == want


def test_switch_margin_and_unknown_times_hold_the_tier():
    pol = throughput(initial=0, switch_margin=0.5)
    pol.observe([1] * 50, reach=1)  # p_1 ~ 1: E = 2, 4, 8 at reach 1, 3, 7
    assert not pol._decide(lambda j: (1.0, 2.9, 6.0)[j])  # 4/2.9 = 1.38 < 2 x 1.5: stays
    assert pol._decide(lambda j: (1.0, 1.2, 6.0)[j]) and pol.index == 1
    assert not pol._decide(lambda j: None if j == 1 else 1.0)  # the active tier's time unknown: no basis
    assert pol.last_rates[1] is None


def test_round_times_calibration_online_and_ratio():
    t = RoundTimes(window=3, min_samples=1)
    assert t.estimate(0, (1, 128, True)) is None and not t.has(0, (1, 128, True))
    t.calibrated(0, (1, 128, True), 2.0)
    t.calibrated(1, (1, 128, True), 4.0)
    assert t.has(1, (1, 128, True)) and t.estimate(1, (1, 128, True)) == 4.0
    t.observed(0, (1, 128, True), 3.0)  # online 1.5x the calibration: tier 1, not observed, scales alike
    assert t.estimate(0, (1, 128, True)) == 3.0 and t.estimate(1, (1, 128, True)) == pytest.approx(6.0)
    t.observed(0, (1, 128, True), 5.0)
    assert t.estimate(0, (1, 128, True)) == pytest.approx(4.0) and t.ratio == pytest.approx(2.0)


def test_round_times_are_medians_an_outlier_does_not_move():
    """One round the host kept waiting (40 ms among 2 ms rounds) leaves the estimate where it was: an
    average would have carried it for tens of rounds."""
    t = RoundTimes(window=5, min_samples=3)
    t.calibrated(0, "b", 2.0)
    t.observed(0, "b", 8.0)  # one noisy first round: the calibration (scaled by the median ratio) speaks
    assert t.estimate(0, "b") == pytest.approx(2.0 * 4.0)
    t.observed(0, "b", 4.0)
    t.observed(0, "b", 4.0)
    assert t.estimate(0, "b") == 4.0  # its own samples now: their median
    for ms in (2.0, 40.0, 2.0, 2.0):
        t.observed(0, "b", ms)
    assert t.estimate(0, "b") == 2.0  # the window's last 5: 4, 2, 40, 2, 2
    t.observed(1, "x", 1.5)  # never calibrated: online from the first sample
    assert t.estimate(1, "x") == 1.5


# ---- nested tiers: would-be accept lengths, dwell ------------------------------------------------------
NESTED = ((1, 4, 2), (3, 4, 5), (5, 4, 8), (7, 4, 11))


def test_nested_tiers_share_k_and_have_no_more_steps():
    assert nested_tiers(NESTED) == [(), (0,), (0, 1), (0, 1, 2)]
    assert nested_tiers(((3, 1, 4), (5, 4, 8), (6, 4, 16))) == [(), (), (1,)]  # another K: not nested


def test_nested_accept_lengths_are_the_estimates_of_the_tiers_they_observe():
    """Running (5,4,8), each round also says what (1,4,2) and (3,4,5) would have accepted: their
    estimates are those rounds' means, not the depth model's extrapolation of (5,4,8)'s depths."""
    pol = throughput(initial=2, tiers=NESTED, warmup_batches=10**9)
    for _ in range(50):  # (5,4,8) accepts 4 drafts; (3,4,5)'s narrower tree would have accepted 1
        pol.update([4, 4], 2, lambda j: 1.0, nested=[[1, 1, 1][:2], [1, 1]])
    e = pol.expected_tokens()
    assert e[0] == pytest.approx(2.0) and e[1] == pytest.approx(2.0) and e[2] == pytest.approx(5.0)
    assert pol.model_tokens()[1] == pytest.approx(4.0, abs=0.1)  # depth-only: (3,4,5) reaches 3 of the 4


def test_a_larger_tier_is_the_depth_model_scaled_to_the_active_tier():
    """Running (3,4,5) with (1,4,2) nested: (5,4,8) and (7,4,11), which no (3,4,5) round observes, are
    the depth model's estimates times the active tier's observed / modelled accept length."""
    pol = throughput(initial=1, tiers=NESTED, warmup_batches=10**9)
    for _ in range(30):
        pol.update([3, 1], 1, lambda j: 1.0, nested=[[1], [0]])
    e, model = pol.expected_tokens(), pol.model_tokens()
    assert e[1] == pytest.approx(3.0) and e[0] == pytest.approx(1.5)
    assert e[2] == pytest.approx(model[2] * 3.0 / model[1]) and e[3] == pytest.approx(model[3] * 3.0 / model[1])



def test_controller_reports_the_throughput_view():
    states = [TierState(t, t[0]) for t in TIERS]
    c = AdaptiveController(AdaptiveConfig(warmup_batches=0, update_interval=1, policy="throughput"), states, 3)
    assert c.active is states[1]
    for j, ms in enumerate((1.0, 1.1, 1.6)):
        c.times.calibrated(j, "b", ms)
    assert c.on_verify_complete([3, 3, 3], ran=1, bucket="b") and c.active is states[2]
    rep = c.report()
    assert rep["policy"] == "throughput" and rep["active_tier"] == [7, 4, 11] and rep["switches"] == 1
    assert set(rep["expected_accept_length"]) == {"[1, 4, 3]", "[3, 4, 5]", "[7, 4, 11]"}
    assert rep["expected_tokens_per_ms"]["[7, 4, 11]"] > rep["expected_tokens_per_ms"]["[3, 4, 5]"]


def test_nested_tiers_accept_lengths_equal_running_those_tiers():
    """A (5,4,8) round reports what (1,4,2) and (3,4,5) would have accepted. From the same state (a
    request's first round after its prefill) that is exactly what a round of each of them accepts
    (greedy, fp32), for a head that accepts some depths and not others."""
    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0, noise=0.04, seed=2)
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9, 3, 7, 4, 6, 8)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    cfg = EngineConfig(max_batch_size=2, max_context=128, batch_buckets=(1, 2))
    tiers = ((1, 4, 2), (3, 4, 5), (5, 4, 8))
    big = speculative(target, head, cfg, SpecConfig(5, 4, 8),
                      adaptive=AdaptiveConfig(candidate_tiers=tiers, policy="throughput", warmup_batches=10**9,
                                              min_dwell=0))
    seen = []
    feed = big.decoder.controller.on_verify_complete
    big.decoder.controller.on_verify_complete = lambda acc, ran, bucket, nested=None: (
        seen.append((list(acc), ran, nested)), feed(acc, ran, bucket, nested))[1]
    first = {}
    for s, _, n in tiers[:2]:
        small = speculative(target, head, cfg, SpecConfig(s, 4, n))
        first[s] = []
        for p in prompts:
            small.decoder.recent_accepts.clear()
            small.generate([p], [params])
            first[s].append(small.decoder.recent_accepts[0] - 1)
    would, ran_big = [], []
    for p in prompts:
        seen.clear()
        big.generate([p], [params])
        acc, ran, nested = seen[0]
        ran_big.extend(acc)
        assert ran == 2 and len(acc) == 1 and len(nested[0]) == 2
        assert all(0 <= w <= a + 1 for w in nested[0] for a in acc)  # at most one node the running tree lacked
        would.append(nested[0])
    assert [w[0] for w in would] == first[1] and [w[1] for w in would] == first[3]
    assert len(set(first[3])) > 1, "the head should accept different depths on different prompts"
    assert any(w[1] > a for w, a in zip(would, ran_big)), "a case where (3,4,5) holds a node (5,4,8) lacks"


def test_observe_every_feeds_the_policy_one_verify_in_e_each_standing_for_e():
    """observe_every E: the controller hands the policy verifies 0, E, 2E, ... (the rest only counted);
    each decays the counts as E verifies of its size do, and decisions keep the cadence of
    update_interval verifies (observed or not)."""
    tiers = ((3, 4, 5), (5, 4, 8), (7, 4, 11))
    cfg = AdaptiveConfig(policy="throughput", candidate_tiers=tiers, warmup_batches=4, update_interval=8,
                         observe_every=4, accept_window=40)
    ctl = AdaptiveController(cfg, [TierState(t, t[0]) for t in tiers], 5)
    seen, decisions = [], []
    pol = ctl.policy
    update = pol.update
    pol.update = lambda acc, ran, times, nested=None: seen.append(np.array(acc)) or update(acc, ran, times, nested)
    decide = pol._decide
    pol._decide = lambda times: decisions.append(pol.batches) or decide(times)
    rng = np.random.default_rng(3)
    verifies = [rng.integers(0, 5, 6) for _ in range(21)]
    for v, acc in enumerate(verifies):
        assert ctl.observes() == (v % 4 == 0)
        ctl.on_verify_complete(acc, 1, bucket=(6, 512, True), nested=rng.integers(0, 4, (6, 1)))
    assert [a.tolist() for a in seen] == [verifies[v].tolist() for v in range(0, 21, 4)]
    assert ctl.verifies == 21 and pol.batches == 24
    assert decisions == [12, 20]  # past the 4 warm-up verifies: the 8th and the 16th
    ref = ThroughputPolicy(AdaptiveConfig(policy="throughput", candidate_tiers=tiers, accept_window=40), tiers, 1)
    for a in seen:  # one verify of 6 requests standing for 4: the decay of 24 request-rounds
        ref.observe(a, ref.reach[1], keep=(1 - 1 / 40) ** 24)
    pol.expected_tokens()
    assert pol.tried == pytest.approx(ref.tried) and pol.passed == pytest.approx(ref.passed)
    ema = AdaptiveController(AdaptiveConfig(observe_every=4), [TierState(t, t[0]) for t in tiers], 5)
    assert all(ema.observes() or ema.on_verify_complete([1, 2]) for _ in range(3))  # EMA sees every verify


@pytest.mark.parametrize("observe_every", [1, 3])
def test_throughput_policy_with_nested_tiers_is_lossless_and_switches(observe_every):
    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0, noise=0.04, seed=2)
    rng = np.random.default_rng(12)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (30, 24, 28)]
    cfg = EngineConfig(max_batch_size=4, max_context=128, batch_buckets=(1, 2, 4))
    want = [o.token_ids for o in target_only(target, cfg).generate(prompts, params)]
    engine = speculative(target, head, cfg, SpecConfig(5, 4, 8),
                         adaptive=AdaptiveConfig(candidate_tiers=((1, 4, 2), (3, 4, 5), (5, 4, 8)),
                                                 policy="throughput", warmup_batches=2,
                                                 observe_every=observe_every))
    engine.warmup(prefill_lengths=[9], greedy=(True,), progress=False)
    # (5,4,8) takes 3x a shallower round here: the nested tiers' observed accept lengths decide.
    engine.decoder.controller.times.estimate = lambda j, bucket: (1.0, 1.0, 3.0)[j]
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.last_stats
    assert stats.compilations_after_warmup == 0 and stats.speculative.tier_switches >= 1
    pol = engine.decoder.controller.policy
    assert pol.weight[0] > 0 and pol.weight[1] > 0, "(5,4,8)'s rounds observe (1,4,2) and (3,4,5)"
    times = engine.decoder.controller.times  # the round-time model's inputs: calls timed, steps' host time seen
    assert times.calls and all(ms > 0 for ms in times.calls.values()) and set(times.calls) == set(times.calibration)
    assert times.host and all(ms >= 0 for d in times.host.values() for ms in d) and times.threaded is False


def test_round_times_scale_calibrations_by_the_bucket_s_own_ratio():
    """At a bucket where the active tier's rounds measure 2x its calibration, another tier is estimated
    at 2x its own calibration there, whatever the ratios seen at other buckets; the report shows both."""
    t = RoundTimes(window=5, min_samples=2)
    for j, ms in enumerate((1.0, 1.5)):
        t.calibrated(j, "b16", ms)
        t.calibrated(j, "b1", ms / 2)
    for _ in range(4):
        t.observed(0, "b1", 0.5 * 1.1)  # 1.1x at batch 1
    assert t.estimate(1, "b16") == pytest.approx(1.5 * 1.1)  # no samples at b16 yet: the global ratio
    t.observed(0, "b16", 2.0)
    t.observed(0, "b16", 2.0)
    assert t.estimate(1, "b16") == pytest.approx(3.0) and t.estimate(1, "b1") == pytest.approx(0.75 * 1.1)
    assert t.report(2, "b16") == {"calibrated": [1.0, 1.5], "call": [None, None], "observed": [2.0, None],
                                  "host_besides_call": None}


@pytest.mark.parametrize("threaded", [False, True])
def test_round_times_model_where_the_host_sets_the_pace(threaded):
    """Rounds in flight one behind the other take the longer of the host's part (the call + the step's
    other host work; beside each other on a dispatch thread) and the device's (calibration - call). At a
    host-bound bucket (batch 16 on the H200: 0.96 ms call + ~0.7 ms other host work against 1.43 ms of
    device) a cheaper tier's round is barely shorter; its calibration scaled by the active tier's
    observed / calibrated ratio promised 0.82x of the active round, which the policy switched for and lost."""
    t = RoundTimes(window=5, min_samples=2, threaded=threaded)
    t.calibrated(0, "b16", 1.95, call_ms=0.85)  # (3,4,5): device 1.10 ms
    t.calibrated(1, "b16", 2.39, call_ms=0.96)  # (5,4,8), the active tier: device 1.43 ms
    t.calibrated(2, "b16", 2.90, call_ms=1.05)  # (7,4,11): device 1.85 ms
    old = 1.95 * 1.66 / 2.39  # what the calibration x ratio estimate gave
    for _ in range(3):
        t.observed(1, "b16", 1.66)
        t.host_observed("b16", 0.70)
    assert t.estimate(1, "b16") == pytest.approx(1.66)  # observed: its own median
    if threaded:  # host max(call, 0.70) < device everywhere: device-bound, the calibration's device part scales
        assert t.modelled(1, "b16") == pytest.approx(1.43) and t.estimate(0, "b16") == pytest.approx(1.10 * 1.66 / 1.43)
    else:
        assert t.modelled(1, "b16") == pytest.approx(0.96 + 0.70) and t.modelled(0, "b16") == pytest.approx(0.85 + 0.70)
        assert t.estimate(0, "b16") == pytest.approx(1.55 * 1.66 / 1.66)  # 0.93x of the active round, not 0.82x
        assert t.estimate(0, "b16") > old + 0.15
        assert t.estimate(2, "b16") == pytest.approx(1.85)  # the device's part: 1.85 > 1.05 + 0.70
    assert t.report(3, "b16")["call"] == [0.85, 0.96, 1.05] and t.report(3, "b16")["host_besides_call"] == 0.70


def test_round_times_model_where_the_device_sets_the_pace():
    """Batch 1: little host work besides the call; a cheaper tier's shorter device time is its gain."""
    t = RoundTimes(window=5, min_samples=2)
    t.calibrated(0, "b1", 1.50, call_ms=0.40)  # device 1.10
    t.calibrated(1, "b1", 1.90, call_ms=0.45)  # device 1.45
    for _ in range(2):
        t.observed(1, "b1", 1.50)
        t.host_observed("b1", 0.20)
    assert t.estimate(0, "b1") == pytest.approx(1.10 * 1.50 / 1.45)
    t2 = RoundTimes(window=5, min_samples=2)  # no call times (an older calibration): calibration x ratio
    t2.calibrated(0, "b1", 1.50)
    t2.calibrated(1, "b1", 1.90)
    for _ in range(2):
        t2.observed(1, "b1", 1.50)
        t2.host_observed("b1", 0.20)
    assert t2.estimate(0, "b1") == pytest.approx(1.50 * 1.50 / 1.90)


def test_a_new_tier_runs_min_dwell_verifies_before_the_next_switch():
    """Switching executables costs device time (bench/HISTORY.md, 2026-11-26): a tier just switched to
    is kept `min_dwell` verifies even when the estimates turn against it at once."""
    pol = throughput(initial=1, tiers=NESTED, min_dwell=4)
    pol.update([3], 1, lambda j: [1.0, 1.0, 0.5, 1.0][j], nested=[[1]])  # (5,4,8) looks twice as fast: switch
    assert pol.index == 2 and pol.since_switch == 0
    for i in range(4):  # now (1,4,2) looks far better, but the dwell holds (5,4,8)
        pol.update([0], 2, lambda j: [0.1, 1.0, 1.0, 1.0][j], nested=[[0, 0]])
        assert pol.index == (2 if i < 3 else 0)


def test_calibration_without_a_warmup_counts_its_compiles_once():
    """No warm-up: the first round's bucket is timed for the policy on the spot, compiling the tiers'
    executables inside the timing. Their compile time is counted once (was twice: a negative serving
    wall in `--json`), so compile time stays within the call's wall and serving time is positive."""
    import time

    target = bigram_target(target_config())
    head = signed_identity_head(target, +1.0)
    engine = speculative(target, head, EngineConfig(max_batch_size=1, max_context=64, batch_buckets=(1,)),
                         SpecConfig(3, 4, 5), adaptive=AdaptiveConfig(candidate_tiers=((1, 4, 2), (3, 4, 5)),
                                                                      policy="throughput"))
    t0 = time.perf_counter()
    engine.generate([[5, 6, 7]], [SamplingParams(max_new_tokens=8, ignore_eos=True)])
    elapsed = time.perf_counter() - t0
    stats = engine.last_stats
    assert 0 < stats.compile_s <= elapsed and stats.wall_s > 0


def test_a_tier_is_the_reference_times_their_ratio_observed_at_other_buckets():
    """The calibrations (padding rows, nothing in flight) put (3,4,5)'s round at 0.75x (5,4,8)'s where online
    rounds at batch 16 on the H200 were 0.98x (bench/HISTORY.md, 2026-11-28): at a bucket where a tier has not
    run its `min_samples` rounds, the online ratio of the two tiers at other buckets decides, not the model."""
    t = RoundTimes(window=5, min_samples=2)
    for b in ("b16", "b8", "b4"):
        t.calibrated(0, b, 1.85, call_ms=1.21)  # (3,4,5)
        t.calibrated(1, b, 2.45, call_ms=2.23)  # (5,4,8)
    for _ in range(2):
        t.observed(0, "b16", 1.44)
        t.observed(1, "b16", 1.47)
        t.observed(1, "b8", 1.30)
        t.host_observed("b8", 0.22)
    assert t.relative(0, 1) == pytest.approx(1.44 / 1.47) and t.relative(0, 2) is None
    assert t.estimate(0, "b8") == pytest.approx(1.30 * 1.44 / 1.47)  # the model would say (1.21 + 0.22) / (2.23 + 0.22)
    # A bucket no tier has run: the tier observed most anywhere, through its calibration, times the ratio.
    assert t.estimate(0, "b4") / t.estimate(1, "b4") == pytest.approx(1.44 / 1.47)
    for _ in range(3):  # new samples move the ratio (a cached median is dropped at its tier's next sample)
        t.observed(0, "b16", 2.88)
    assert t.relative(0, 1) == pytest.approx(2.88 / 1.47)
