"""Rounds run on the device: `rounds_per_dispatch` R in {1, 2, 4} gives the same tokens
for every tier and batch mix — requests that finish mid-dispatch (max new tokens, stop tokens, the
context's end), more requests than rows, sampled requests with seeds — leaves every KV slot free,
compiles nothing after warm-up, and `dataflow` is the default verify_done wait. fp32, tiny models."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import kv_idle

ROUNDS = (1, 2, 4)
MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.08)  # partial acceptance: accept lengths vary


@pytest.fixture(scope="module")
def workload():
    """Six requests on four rows: max-new limits that end inside a dispatch, a stop token, one that
    runs into the context's end."""
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9, 3, 7, 80)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (4, 23, 9, 13, 6)]
    params[3] = SamplingParams(max_new_tokens=30, stop_token_ids=(7, 11, 19))
    params.append(SamplingParams(max_new_tokens=64, ignore_eos=True))  # 80 + 64 > 96: cut at the context
    return prompts, params


def spec(target, head, rounds, tier=(3, 2, 5), batch=4, **kw):
    cfg = EngineConfig(max_batch_size=batch, max_context=MAX_CONTEXT, rounds_per_dispatch=rounds,
                       batch_buckets=(1, 2, 4), **kw)
    return speculative(target, head, cfg, SpecConfig(*tier))


@pytest.fixture(scope="module")
def reference(target, workload):
    prompts, params = workload
    eng = target_only(target, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT))
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("tier", [(3, 2, 5), (2, 1, 3)])
def test_greedy_tokens_equal_for_every_rounds_per_dispatch(target, head, workload, reference, tier):
    prompts, params = workload
    first = None
    for rounds in ROUNDS:
        eng = spec(target, head, rounds, tier)
        outs = eng.generate(prompts, params)
        got = [o.token_ids for o in outs]
        assert got[:5] == reference[:5], rounds
        # At the context's end speculation keeps S + 1 positions in reserve, so it stops a little sooner
        # than target-only decoding: the same tokens up to there, and the same for every R.
        assert outs[5].finish_reason == "length" and got[5] == reference[5][:len(got[5])]
        assert len(prompts[5]) + len(got[5]) + eng.decoder.context_reserve == MAX_CONTEXT
        first = first or got
        assert got == first, rounds
        assert kv_idle(eng)[0] == eng.pool.num_slots - 1, rounds  # every slot back
        stats = eng.last_stats.to_dict()
        assert stats["rounds_per_dispatch"] == rounds and stats["verify_done_wait"] == "dataflow"
        if rounds > 1:  # several rounds per dispatch, written out in one executable: fewer dispatches
            assert stats["round_dispatches"] < stats["rounds"]
            assert eng.decoder.round_key(eng.decoder.spec, 4, 128, True).label.endswith(f"-r{rounds}u")


@pytest.mark.parametrize("rounds", [2, 4])
def test_the_device_loop_equals_unrolled_rounds(target, head, workload, reference, rounds):
    """`unroll_rounds=False`: the rounds in a `lax.while_loop` that stops once every row finished (the
    default writes them out); greedy tokens equal target-only's, sampled ones equal R = 1's for the
    same seeds, and every slot comes back."""
    prompts, params = workload
    eng = spec(target, head, rounds, unroll_rounds=False)
    outs = eng.generate(prompts, params)
    got = [o.token_ids for o in outs]
    assert got[:5] == reference[:5]
    assert outs[5].finish_reason == "length" and got[5] == reference[5][:len(got[5])]
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1
    assert eng.last_stats.to_dict()["rounds_per_dispatch"] == rounds
    assert eng.decoder.round_key(eng.decoder.spec, 4, 128, True).label.endswith(f"-r{rounds}")
    sampled = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(4)]
    loop = spec(target, head, 1).generate(prompts[:4], sampled)
    assert [o.token_ids for o in eng.generate(prompts[:4], sampled)] == [o.token_ids for o in loop]
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


def test_batch_of_one_and_sampled_requests(target, head, workload):
    prompts, _ = workload
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    got = {}
    for rounds in (1, 4):
        for batch in (1, 4):
            eng = spec(target, head, rounds, batch=batch)
            got[rounds, batch] = [o.token_ids for o in eng.generate(prompts[:4], params[:4])]
    assert got[1, 1] == got[4, 1] == got[1, 4] == got[4, 4]


def test_abort_mid_dispatch_frees_everything(target, head, workload):
    """What the server does on a stop string: abort from the token callback while rounds are in
    flight. The tokens before the abort are R = 1's; nothing leaks."""
    prompts, params = workload
    outs = {}
    for rounds in (1, 4):
        eng = spec(target, head, rounds)
        reqs = []

        def on_tokens(index, ids, reqs=reqs, eng=eng):
            r = reqs[index]
            if len(r.out.token_ids) >= 5:
                eng.abort(r)

        reqs.extend(eng.submit(p, sp, on_tokens=on_tokens) for p, sp in zip(prompts[:4], params[:4]))
        while eng.has_work:
            eng.step()
        outs[rounds] = [r.out.token_ids[:5] for r in reqs]
        assert kv_idle(eng)[0] == eng.pool.num_slots - 1 and eng.pool.free_rows == 4
    assert outs[1] == outs[4]


def test_nothing_compiles_after_warmup(target, head, workload):
    prompts, params = workload
    eng = spec(target, head, 4)
    eng.warmup_for([len(p) for p in prompts], max(sp.max_new_tokens for sp in params), greedy=(True,),
                   progress=False)
    eng.generate(prompts, params)
    assert eng.last_stats.compilations_after_warmup == 0


def test_rounds_per_dispatch_is_checked():
    with pytest.raises(ValueError, match="rounds_per_dispatch"):
        EngineConfig(rounds_per_dispatch=0)
