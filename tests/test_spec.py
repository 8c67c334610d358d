"""The speculative round: lossless greedy decoding for every tier shape and batch composition, hand-built
trees, oracle/adversarial heads, finish points inside accepted runs, committed KV, sampling exactness."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.kernels.build_tree import build_tree_reference
from jeagle.kernels.tree_speculative_sampling import tree_speculative_sampling_reference
from jeagle.kernels.verify_tree_greedy import verify_tree_greedy_reference
from jeagle.models.eagle import random_draft
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, draft_config, signed_identity_head, target_config
from tests.util import kv_idle

TIERS = [(1, 1, 2), (3, 1, 4), (5, 4, 8), (4, 8, 32)]
BUCKETS = (1, 4, 8)


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def heads(target):
    return {"oracle": signed_identity_head(target, +1.0), "noisy": signed_identity_head(target, +1.0, noise=0.08),
            "eagle3-random": random_draft(draft_config(target.cfg, "eagle3"), seed=4)}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(4, 96, n)) for n in (3, 11, 6, 1, 17, 8, 5, 2)]


def target_only_tokens(model, prompts, sp):
    return [o.token_ids for o in target_only(model, EngineConfig(max_batch_size=8, max_context=128)).generate(prompts, sp)]


def test_spec_config_validation():
    with pytest.raises(ValueError, match="must be num_steps \\+ 1 = 4"):
        SpecConfig(3, 1, 5)
    with pytest.raises(ValueError, match="exceeds the 6 nodes"):
        SpecConfig(2, 2, 8)
    SpecConfig(2, 2, 7)


HEAD_NAMES = ["oracle", "noisy", "eagle3-random"]
BATCHES = (1, 3, 8)


@pytest.fixture(scope="module")
def greedy_reference(target, prompts):
    return target_only_tokens(target, prompts, SamplingParams(max_new_tokens=17, ignore_eos=True))


@pytest.mark.parametrize("tier", TIERS, ids=[f"S{s}K{k}N{n}" for s, k, n in TIERS])
@pytest.mark.parametrize("head_name", HEAD_NAMES)
def test_lossless_greedy_every_tier_and_batch(target, heads, prompts, greedy_reference, tier, head_name):
    """Greedy speculative output equals target-only for every tier and head. Each (tier, head) pair runs one
    batch size, rotated so that every tier and every head meets each of 1, 3 and 8 (a batch of 8 with
    buckets (1, 4, 8) crosses buckets as requests finish): the full product compiled 36 engines on CPU."""
    sp = SamplingParams(max_new_tokens=17, ignore_eos=True)
    want = greedy_reference
    batch = BATCHES[(TIERS.index(tier) + HEAD_NAMES.index(head_name)) % len(BATCHES)]
    buckets = tuple(b for b in BUCKETS if b < batch) + (batch,)
    engine = speculative(target, heads[head_name],
                        EngineConfig(max_batch_size=batch, max_context=128, batch_buckets=buckets), SpecConfig(*tier))
    got = [o.token_ids for o in engine.generate(prompts if batch > 1 else prompts[:3], sp)]
    assert got == (want if batch > 1 else want[:3]), (tier, head_name, batch)
    assert kv_idle(engine)[0] == engine.pool.num_slots - 1


def test_lossless_with_every_layer_unrolled(prompts):
    """A random 5-layer fp32 target whose layers all matter (the bigram target zeroes their outputs):
    its logits and EAGLE-3 aux features are the same for a plain loop, 2 layers per iteration and every
    layer inline, and rounds with every layer unrolled equal target-only greedy (default unroll)."""
    import dataclasses

    from jeagle.models.llama import random_model
    from tests.util import ragged_forward

    cfg = dataclasses.replace(target_config(), num_layers=5)
    target = random_model(cfg, seed=3)
    aux = (1, 2, 4)
    outs = [ragged_forward(target, prompts[:3], unroll=u, aux_layers=aux)[1] for u in (False, 2, True)]
    for o in outs[1:]:
        np.testing.assert_allclose(np.asarray(o.logits), np.asarray(outs[0].logits), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(o.aux_hidden), np.asarray(outs[0].aux_hidden), rtol=1e-5, atol=1e-5)
    head = random_draft(dataclasses.replace(draft_config(cfg, "eagle3"), aux_layer_ids=aux), seed=4)
    sp = SamplingParams(max_new_tokens=17, ignore_eos=True)
    cfg = EngineConfig(max_batch_size=4, max_context=64, batch_buckets=(4,))  # one bucket: fewer compiles
    want = [o.token_ids for o in target_only(target, cfg).generate(prompts[:4], sp)]
    engine = speculative(target, head, dataclasses.replace(cfg, unroll_layers=True), SpecConfig(5, 4, 8))
    assert [o.token_ids for o in engine.generate(prompts[:4], sp)] == want


def test_oracle_accepts_every_step_and_adversary_one(target, prompts):
    sp = SamplingParams(max_new_tokens=25, ignore_eos=True)
    want = target_only_tokens(target, prompts, sp)
    for tier in [(3, 1, 4), (5, 4, 8)]:
        s = tier[0]
        oracle = speculative(target, signed_identity_head(target, +1.0), EngineConfig(max_batch_size=8, max_context=128),
                            SpecConfig(*tier))
        assert [o.token_ids for o in oracle.generate(prompts, sp)] == want
        hist = oracle.last_stats.speculative.accept_length_histogram
        # Every round accepts S drafts + the bonus; only a request's last round may be cut short.
        assert sum(v for k, v in hist.items() if int(k) != s + 1) <= len(prompts)
        assert oracle.last_stats.accept_length > s
        adversary = speculative(target, signed_identity_head(target, -1.0), EngineConfig(max_batch_size=8,
                                                                                       max_context=128), SpecConfig(*tier))
        assert [o.token_ids for o in adversary.generate(prompts, sp)] == want
        assert adversary.last_stats.accept_length == 1.0


def test_a_stats_window_counts_its_own_request_rounds(target, prompts):
    """Accept statistics are counts since start, a window their difference (bench/HISTORY.md,
    2026-12-01: a history trimmed at 100,000 request-rounds read accept length 1.0 for a window that
    began before the trim)."""
    sp = SamplingParams(max_new_tokens=25, ignore_eos=True)
    engine = speculative(target, signed_identity_head(target, +1.0, noise=0.08), EngineConfig(max_batch_size=8,
                         max_context=128), SpecConfig(3, 2, 5))
    engine.decoder.accept_counts[3] += 10**6  # a long history before the windows: none of it may count
    windows = []
    for _ in range(3):
        engine.generate(prompts, sp)
        windows.append(engine.last_stats.speculative)
    first = windows[0]
    hist = {int(k): v for k, v in first.accept_length_histogram.items()}
    assert sum(hist.values()) == first.rounds and len(prompts) < first.rounds < 1000 and hist[4] < 1000
    assert first.accept_length == pytest.approx(sum(k * v for k, v in hist.items()) / first.rounds)
    assert 1.0 < first.accept_length < 4.0  # partial acceptance
    for w in windows[1:]:  # the same greedy requests again: the same rounds, counted apart from the earlier ones
        assert (w.rounds, w.accept_length_histogram, w.accept_length) == (first.rounds, first.accept_length_histogram,
                                                                           first.accept_length)
    recent = engine.decoder.recent_accepts
    assert engine.decoder.info()["avg_spec_accept_length"] == pytest.approx(sum(recent) / len(recent))


def test_eos_and_max_new_tokens_inside_an_accepted_run(target, prompts):
    oracle = signed_identity_head(target, +1.0)
    free = target_only_tokens(target, prompts[:4], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine = speculative(target, oracle, EngineConfig(max_batch_size=4, max_context=128), SpecConfig(5, 4, 8))
    # A stop token met at emitted index 4: inside the first round's run of 6 (after the prefill token).
    stops = [(f[4],) for f in free]
    params = [SamplingParams(max_new_tokens=30, stop_token_ids=s, ignore_eos=True) for s in stops]
    want = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=4, max_context=128)).generate(prompts[:4], params)]
    got = engine.generate(prompts[:4], params)
    assert [o.token_ids for o in got] == want and all(o.finish_reason == "stop" for o in got)
    # max_new_tokens 4: one prefill token and 3 of the first round's 6.
    got = engine.generate(prompts[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in got] == [f[:4] for f in free]
    assert all(o.finish_reason == "length" for o in got)
    assert kv_idle(engine)[0] == engine.pool.num_slots - 1


def test_default_pool_holds_a_full_context_per_row(target, prompts):
    """Without --max-total-tokens the pool gives every row a full context plus the tree's slots: a request
    that fills the context runs (it needed more slots than max_batch_size * max_context: OutOfSlots)."""
    cfg = EngineConfig(max_batch_size=1, max_context=48)
    engine = speculative(target, signed_identity_head(target, +1.0), cfg, SpecConfig(5, 4, 8))
    sp = SamplingParams(max_new_tokens=1000, ignore_eos=True)  # capped to what the context leaves
    (got,) = engine.generate(prompts[:1], sp)
    assert len(prompts[0]) + len(got.token_ids) == 48 - engine.context_reserve
    (want,) = target_only(target, cfg).generate(prompts[:1], sp)
    assert got.token_ids == want.token_ids[:len(got.token_ids)]


def test_committed_kv_equals_target_only(target, heads, prompts):
    from tests.util import ragged_forward

    engine = speculative(target, heads["noisy"], EngineConfig(max_batch_size=4, max_context=128), SpecConfig(5, 4, 8))
    outs = engine.generate(prompts[:4], SamplingParams(max_new_tokens=21, ignore_eos=True))
    seqs = [p + o.token_ids for p, o in zip(prompts[:4], outs)]
    _, ref = ragged_forward(target, seqs)
    t = max(len(s) for s in seqs)
    table = np.asarray(engine.decoder.state.cache.req_to_token)
    k_ours, k_ref = np.asarray(engine.decoder.state.cache.k), np.asarray(ref.k)
    for row in range(4):  # rows are handed out 0, 1, 2, 3
        committed = int(engine.decoder.state.rows.seq_len[row])
        assert committed >= len(prompts[row]) + 1
        ref_slots = 1 + row * t + np.arange(committed)
        np.testing.assert_allclose(k_ours[:, table[row, :committed]], k_ref[:, ref_slots], rtol=1e-5, atol=1e-6)


# ---- hand-built trees ----------------------------------------------------------------------
# Two steps of top-2: root → a(10), b(11); a → c(20), d(21); b → e(22), f(23). All six selected:
# tree nodes 1..6 = a, b, c, d, e, f.
NODE_TOKENS = jnp.array([[10, 11, 20, 21, 22, 23]] * 3, jnp.int32)
NODE_PARENTS = jnp.array([[-1, -1, 0, 0, 1, 1]] * 3, jnp.int32)
SELECTED = jnp.array([[0, 1, 2, 3, 4, 5]] * 3, jnp.int32)


def hand_tree():
    return build_tree_reference(jnp.array([5, 5, 5], jnp.int32), NODE_TOKENS, NODE_PARENTS, SELECTED, max_depth=2)


def test_build_tree_by_hand():
    tree = hand_tree()
    assert tree.tokens[0].tolist() == [5, 10, 11, 20, 21, 22, 23]
    assert tree.parent[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.depth[0].tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert tree.retrieve_next_token[0].tolist() == [1, 3, 5, -1, -1, -1, -1]
    assert tree.retrieve_next_sibling[0].tolist() == [-1, 2, -1, 4, -1, 6, -1]
    assert tree.retrieve_index[1].tolist() == list(range(7, 14))
    assert np.asarray(tree.mask[0, 6]).tolist() == [True, False, True, False, False, False, True]


def test_greedy_verify_by_hand():
    tree = hand_tree()
    predict_in = jnp.full((3, 7), 0, jnp.int32)
    # request 0: root predicts 11 (second sibling b), b predicts 23 (second sibling f), f predicts 99.
    predict_in = predict_in.at[0, 0].set(11).at[0, 2].set(23).at[0, 6].set(99)
    # request 1: no child of the root matches.
    predict_in = predict_in.at[1, 0].set(50)
    # request 2: full depth through a and c; bonus 7.
    predict_in = predict_in.at[2, 0].set(10).at[2, 1].set(20).at[2, 3].set(7)
    predict, accept_index, accept_length, bonus = verify_tree_greedy_reference(
        tree.tokens, tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling, predict_in, 3)
    assert accept_index.tolist() == [[0, 2, 6], [7, -1, -1], [14, 15, 17]]
    assert accept_length.tolist() == [2, 0, 2]
    assert bonus.tolist() == [99, 50, 7]
    assert predict.tolist() == [[11, -1, 23, -1, -1, -1, 99], [50, -1, -1, -1, -1, -1, -1],
                                [10, 20, -1, 7, -1, -1, -1]]


def test_sampling_verify_by_hand():
    tree = hand_tree()
    v = 64
    probs = np.full((3, 7, v), 0.0, np.float32)
    probs[:, :, 40] = 1.0  # default: everything on token 40
    # root: a=0.3, b=0.5, rest 0.2 on 40. coin 0.6 → a rejected (0.3), b accepted (0.8 >= 0.6).
    probs[0, 0] = 0
    probs[0, 0, 10], probs[0, 0, 11], probs[0, 0, 40] = 0.3, 0.5, 0.2
    # at b: e=0.1, f=0.1, 40=0.8; coin 0.99 rejects both → bonus from the residual = token 40.
    probs[0, 2] = 0
    probs[0, 2, 22], probs[0, 2, 23], probs[0, 2, 40] = 0.1, 0.1, 0.8
    coins = np.full((3, 7), 0.5, np.float32)
    coins[0, 0], coins[0, 2] = 0.6, 0.99
    predict, accept_index, accept_length, bonus = tree_speculative_sampling_reference(
        tree.tokens, tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling, jnp.asarray(probs),
        jnp.asarray(coins), jnp.full((3,), 0.5), 3)
    assert accept_index[0].tolist() == [0, 2, -1] and accept_length[0] == 1 and bonus[0] == 40
    # requests 1 and 2: all mass on 40, never drafted → nothing accepted, the bonus is 40.
    assert accept_length[1:].tolist() == [0, 0] and bonus[1:].tolist() == [40, 40]


# ---- sampling is exact -----------------------------------------------------------------------
# N requests, one seed each (seed = i: the draws do not depend on how they are batched), prompt [7], two
# tokens each: the first is the prefill's sample, the second the first round's (the tree walk's accepted
# draft or its residual bonus). A chi-square test of the 256 (first, second) cells against the target's
# joint law p(a) p(b | a) must give p > 0.001 (cells expected below 5 pooled), and no token may fall
# outside the top-k/top-p support.
#
# The engine runs them SAMPLING_BATCH at a time (one generate() call, the scheduler refilling rows as
# requests finish): admission costs O(running requests) per admitted request, so one batch of all N
# (the old form, max_batch_size = N = 20000) spent 410-460 s per case on the host; batches of 128 draw
# the same tokens in ~5 s per 20k requests on 2 CPU cores.
#
# Power (N = 40000, CPU). The lossless sampler gives p = 0.07-0.95 (plain) and 0.12-0.93 (T0.7-k5-p0.8)
# over five seed offsets. Accepting a drafted child when coin <= mass / 0.8 instead of coin <= mass
# (SpecConfig threshold_acc=0.8: 20 % over-acceptance) gives p ~ 1e-31..1e-37 (plain) and ~ 1e-125
# (T0.7-k5-p0.8); threshold_acc=0.9 gives p ~ 1e-19..1e-21 (T0.7-k5-p0.8) but only 0.03-0.004 (plain: the flat
# 16-token law spreads the bias over 255 degrees of freedom). Breaking the reference walk: always
# accepting the first child fails both cases (p = 0; emitted tokens outside the support); drawing the bonus
# from the target row without removing the rejected children's mass gives p = 0 in both; comparing the
# coin with each child's own p instead of the running mass gives p = 0 in plain (T0.7-k5-p0.8 alone does
# not catch that one). test_the_sampling_test_rejects_a_biased_acceptance_rule keeps the threshold_acc=0.8
# sampler as a control that must fail.
SAMPLING_N = 40000
SAMPLING_BATCH = 128


def sampling_pvalue(temperature, top_k, top_p, spec=SpecConfig(3, 2, 5), n=SAMPLING_N):
    """The chi-square p-value of N two-token samples against the target's joint law (see above)."""
    from scipy.stats import chisquare

    from tests.util import ragged_forward

    cfg = target_config(vocab=16, hidden=16, eos=())
    target = bigram_target(cfg, seed=3, scale=1.5)
    head = signed_identity_head(target, +1.0, noise=0.3)  # proposals that are often, not always, right
    prompt = [7]
    b = SAMPLING_BATCH
    engine = speculative(target, head, EngineConfig(max_batch_size=b, max_context=16, batch_buckets=(b,)), spec)
    sp = [SamplingParams(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, seed=i)
          for i in range(n)]
    outs = engine.generate([prompt] * n, sp)
    assert engine.last_stats.accept_length > 1.05  # drafts were accepted, so the tree walk was exercised
    pairs = np.array([o.token_ids[:2] for o in outs])

    # The target's next-token laws after the prompt and after prompt + a, for every a, in one forward.
    seqs = [prompt] + [prompt + [a] for a in range(16)]
    logits, _ = ragged_forward(target, seqs)

    def law(i):
        """Temperature, then top-k, then top-p on the renormalised rest (as HF/vLLM/SGLang apply them)."""
        x = logits[i, len(seqs[i]) - 1].astype(np.float64) / temperature
        p = np.exp(x - x.max())
        order = np.argsort(-p, kind="stable")
        keep = np.zeros(len(p), bool)
        keep[order[: top_k or len(p)]] = True
        p = np.where(keep, p, 0.0) / p[keep].sum()
        ranked = p[order]
        before = np.cumsum(ranked) - ranked
        ok = (before < top_p) | (np.arange(len(p)) == 0)
        q = np.zeros_like(p)
        q[order[ok]] = p[order[ok]]
        return q / q.sum()

    p1 = law(0)
    expected = np.array([p1[a] * law(1 + a) for a in range(16)]).ravel() * n
    observed = np.bincount(pairs[:, 0] * 16 + pairs[:, 1], minlength=256).astype(float)
    assert observed[expected == 0].sum() == 0, "a token outside the filtered support was emitted"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.8)], ids=["plain", "T0.7-k5-p0.8"])
def test_speculative_sampling_follows_the_target_distribution(temperature, top_k, top_p):
    """40k requests, one seed each: the joint law of the first two emitted tokens equals the target's."""
    assert sampling_pvalue(temperature, top_k, top_p) > 0.001


@pytest.mark.slow
def test_the_sampling_test_rejects_a_biased_acceptance_rule():
    """The control: the same test on a sampler that over-accepts drafts by 20 % (threshold_acc 0.8, not
    lossless) must fail, by far (p ~ 1e-31..1e-37 measured over seed offsets; the test's bar is 0.001)."""
    assert sampling_pvalue(1.0, 0, 1.0, SpecConfig(3, 2, 5, threshold_acc=0.8)) < 1e-9


def test_split_round_executables_give_the_same_output(target, heads, prompts):
    """The two-executable round (draft + tree | verify + accept + commit + extend) is the fused one split."""
    sp = SamplingParams(max_new_tokens=15, ignore_eos=True)
    fused = speculative(target, heads["noisy"], EngineConfig(max_batch_size=4, max_context=128), SpecConfig(4, 2, 6))
    split = speculative(target, heads["noisy"], EngineConfig(max_batch_size=4, max_context=128), SpecConfig(4, 2, 6),
                       fused_round=False)
    assert [o.token_ids for o in split.generate(prompts[:4], sp)] == [o.token_ids for o in fused.generate(prompts[:4], sp)]
    assert any(k.phase == "draft" for k in split.executables._exes) and not any(k.phase == "draft" for k in fused.executables._exes)


def test_model_eos_inside_an_accepted_run(target, prompts):
    """The model's own EOS (not a request stop id) met inside the oracle's accepted run."""
    free = target_only_tokens(target, prompts[:1], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    eos = free[3]
    eos_target = bigram_target(target_config(eos=(eos,)))  # same weights (same seed), EOS = that token
    want = target_only(eos_target, EngineConfig(max_batch_size=1, max_context=128)).generate(prompts[:1],
                                                                                      SamplingParams(max_new_tokens=30))
    got = speculative(eos_target, signed_identity_head(eos_target, +1.0), EngineConfig(max_batch_size=1, max_context=128),
                     SpecConfig(5, 4, 8)).generate(prompts[:1], SamplingParams(max_new_tokens=30))
    assert got[0].token_ids == want[0].token_ids == free[: free.index(eos) + 1]
    assert got[0].finish_reason == "stop"


def test_simulated_accept_length_has_the_asked_mean():
    """Timing-only simulated acceptance (bench --simulate-accept): with a head that never matches, the
    rounds still accept τ tokens on average (bonus included), and every request gets its tokens."""
    target = bigram_target(target_config())
    head = signed_identity_head(target, -1.0)  # anti-correlated: greedy verify would accept nothing
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    for tau in (1.0, 3.4):
        spec = speculative(target, head, EngineConfig(max_batch_size=2, max_context=256),
                           SpecConfig(num_steps=5, topk=4, num_draft_tokens=8), simulate_accept=tau)
        outs = spec.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [120, 120]
        assert abs(spec.last_stats.accept_length - tau) < 0.3, (tau, spec.last_stats)
    with pytest.raises(ValueError, match="simulated accept length"):
        SpecConfig(num_steps=3, topk=1, num_draft_tokens=4).check_simulated_accept(4.5)
