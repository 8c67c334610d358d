"""Prefix caching, slots on demand and retraction: the radix tree, the slot ownership
invariants under random admit/finish/abort/retract sequences, and engines whose output with the cache
on, with a pool too small for the batch (retraction), equals the output with neither (fp32)."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.models.eagle import random_draft
from jeagle.models.llama import random_model
from jeagle.runtime.kv import MIN_CACHED, SHARE_WAIT, Committed, KVManager, ShortOfSlots
from jeagle.runtime.radix import RadixCache, bigram_keys
from jeagle.runtime.requests import RequestLimits, make_request
from jeagle.runtime.slots import SlotPool
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import draft_config, target_config


# ---- the radix tree -------------------------------------------------------------------------------------------
def test_radix_match_insert_split_and_lru_eviction():
    c = RadixCache()
    had, a = c.insert([1, 2, 3, 4], np.array([10, 11, 12, 13]))
    assert had == 0 and c.cached_slots == 4
    had, b = c.insert([1, 2, 7], np.array([20, 21, 22]))  # splits [1,2,3,4] after 2
    assert had == 2 and c.cached_slots == 5
    slots, node = c.match([1, 2, 3, 9])
    assert slots.tolist() == [10, 11, 12] and node.key == [3]  # the match ends mid-node: split there
    assert c.match([5])[0].tolist() == [] and c.match([1, 2, 7, 8])[0].tolist() == [10, 11, 22]
    c.lock(b)  # [1,2] + [7] in use
    assert c.evictable_slots == 2  # [3] and [4]
    freed = c.evict(10)
    assert sorted(np.concatenate(freed).tolist()) == [12, 13] and c.cached_slots == 3
    c.unlock(b)
    c.match([1, 2, 7])  # touched: newer than anything else
    c.insert([9, 9], np.array([30, 31]))
    assert np.concatenate(c.evict(1)).tolist() == [22]  # least recently used leaf first: [7] (then [1,2])
    with pytest.raises(AssertionError, match="nobody locked"):
        c.unlock(b)


def test_radix_matches_long_runs_to_the_first_difference():
    """Matches end exactly where keys first differ, in long and short runs (the comparison takes a
    different path for runs over 32 keys)."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 50, 1200).tolist()
    cache = RadixCache()
    cache.insert(base, np.arange(1, 1201, dtype=np.int32))
    for cut in (0, 1, 31, 32, 33, 500, 1199):
        key = base[:cut] + [99] + base[cut + 1:]
        got, _ = cache.match(key)
        assert len(got) == cut and got.tolist() == list(range(1, cut + 1)), cut
    got, _ = cache.match(base + [7, 8])
    assert len(got) == 1200


def test_bigram_keys_need_the_next_token():
    assert bigram_keys([1, 2, 3], 2, 100) == [102, 203]
    with pytest.raises(ValueError):
        bigram_keys([1, 2, 3], 3, 100)


def test_random_admit_finish_abort_retract_sequences_keep_every_slot_owned_once():
    """Many random sequences over a small pool: every slot stays free, cached once or owned by one
    request once; refcounts stay >= 0; eviction never frees a slot a request uses."""
    rng = np.random.default_rng(0)
    trimmed = 0
    for speculative_, num_slots in [(False, 200), (True, 200), (False, 120), (True, 120)]:
        pool = SlotPool(num_slots=num_slots, max_reqs=6)
        kv = KVManager(pool, speculative=speculative_, vocab=8, prefix_cache=True)
        kv.chunk = 3
        limits = RequestLimits(max_ctx=64, vocab_size=8, eos_token_ids=(), context_reserve=2 if speculative_ else 0,
                               pool_slots=num_slots - 1)
        extra = 5 if speculative_ else 0
        bases = [list(rng.integers(0, 8, 20)) for _ in range(3)]  # shared prefixes: the cache gets hits
        running, index = [], 0
        for _ in range(400):
            op = rng.random()
            if op < 0.4 and pool.free_rows:
                base = bases[rng.integers(3)]
                prompt = base[: rng.integers(1, 21)] + list(rng.integers(0, 8, rng.integers(0, 6)))
                r = make_request(index, prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 30))), limits,
                                 lambda n, m: n + m + 2 + extra, lambda n, m: min(n + m + 2, 64))
                index += 1
                if kv.admit(r, min(r.position_cap, len(r.seq) + kv.chunk), extra):
                    assert r.table[: r.cached].tolist() == (r.table[: r.cached]).tolist()
                    kv.prefilled(r)
                    running.append(r)
            elif op < 0.75 and running:  # a request grows: emits tokens, asks for slots
                r = running[rng.integers(len(running))]
                r.out.token_ids.extend(int(t) for t in rng.integers(0, 8, rng.integers(1, 4)))
                try:
                    kv.ensure(r, min(len(r.seq) + 3, r.position_cap))
                except ShortOfSlots:  # the pool is short: what requests grew ahead of need goes back
                    for x in running:
                        kv.trim(x, min(len(x.seq) + int(rng.integers(0, 3)), x.position_cap))
            elif running:  # finish (cached), retract (cached), or abort (nothing cached)
                r = running.pop(rng.integers(len(running)))
                how = rng.integers(3)
                written = min(len(r.seq) - 1, len(r.table))
                # The device may have swapped its own slots around (speculative rounds): a permutation.
                own = np.concatenate([r.table[r.cached:], r.extra])
                perm = own[rng.permutation(len(own))] if speculative_ else own
                table = np.concatenate([r.table[: r.cached], perm])[: len(r.table)]
                kv.release(r, None if how == 2 else Committed(written, table))
            kv.check(running)
            if kv.cache is not None:
                assert all(n.ref >= 0 for n in kv.cache.nodes())
                assert kv.cache.locked_slots <= kv.cache.cached_slots
        for r in running:
            kv.release(r)
        assert kv.cache.locked_slots == 0 and all(n.ref == 0 for n in kv.cache.nodes())
        kv.flush()
        assert pool.free_slots == num_slots - 1 and pool.free_rows == 6
        trimmed += kv.trimmed_total
    assert trimmed > 0  # tables grew ahead of need (geometrically) and gave their tails back when short


# ---- engines ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    cfg = target_config()
    return random_model(cfg, 1), random_draft(draft_config(cfg), 2)  # real attention: a wrong KV shows


def prompts_with_prefixes():
    rng = np.random.default_rng(5)
    system = list(rng.integers(4, 96, 40))
    prompts = [system + list(rng.integers(4, 96, n)) for n in (3, 7, 5, 9)]  # a shared prefix
    prompts.append(prompts[1] + [7, 8, 9, 10])  # nested: another prompt whole, then more
    prompts.append(system[:30] + list(rng.integers(4, 96, 6)))  # diverging inside the shared prefix
    prompts.append(list(rng.integers(4, 96, 12)))  # nothing shared
    return prompts


def make(models, kind, **kw):
    """An engine over the tiny models; admission at once (the counts of retractions and trims below must not
    follow the admission gate's timed holds, `runtime/admission.py`, tested in test_admission_gate.py)."""
    target, head = models
    cfg = EngineConfig(**{"max_batch_size": 3, "max_context": 160, "admission_delay": 0.0, **kw})
    return target_only(target, cfg) if kind == "target" else speculative(target, head, cfg, SpecConfig(3, 2, 5))


def run(engine, prompts, params):
    outs = [o.token_ids for o in engine.generate(prompts, params)]
    engine.check_kv()
    return outs


@pytest.mark.parametrize("kind", ["target", "eagle"])
def test_prefix_cache_and_retraction_leave_output_unchanged(models, kind):
    prompts = prompts_with_prefixes()
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (40, 30, 50, 35, 30, 45, 40)]
    want = run(make(models, kind, prefix_cache=False), prompts, params)

    cached = make(models, kind)
    assert run(cached, prompts, params) == want
    first = cached.last_stats
    assert first.cached_tokens >= 30 and first.retractions == 0  # later admissions reused earlier prompts
    # Again: every prompt (and answer) is cached now; output unchanged.
    assert run(cached, prompts, params) == want
    again = cached.last_stats
    # (All but the last token of each prompt; the short unshared one is under MIN_CACHED.)
    assert again.cached_tokens == sum(len(p) - 1 for p in prompts if len(p) - 1 >= MIN_CACHED)
    if kind == "eagle":  # the draft's KV came along: it drafts as well as after a full prefill
        assert abs(again.accept_length - first.accept_length) <= 0.02 * first.accept_length + 0.05

    # A pool too small for three such requests at once: slots on demand, then retraction (admission
    # made eager, as a wrong estimate would: the default keeps room for the running requests' growth).
    small = make(models, kind, max_total_tokens=130, schedule_conservativeness=0.0)  # eager: retractions
    small.kv.chunk = 4
    assert run(small, prompts, params) == want
    assert small.last_stats.retractions > 0 and small.info()["retractions"] == small.last_stats.retractions
    assert small.kv.trimmed_total > 0  # tables grown while the pool had room gave their tails back first
    small.flush_cache()
    assert small.pool.free_slots == small.pool.num_slots - 1 and small.pool.free_rows == small.max_running

    # The same without the cache: retracted requests prefill everything again.
    bare = make(models, kind, max_total_tokens=130, prefix_cache=False, schedule_conservativeness=0.0)
    bare.kv.chunk = 4
    assert run(bare, prompts, params) == want and bare.last_stats.retractions > 0
    assert bare.pool.free_slots == bare.pool.num_slots - 1


def test_sampled_and_penalized_requests_resume_identically_after_retraction(models):
    """Target-only sampling draws each token by its position: a retracted request resumes with the
    same tokens. Penalties count its tokens so far again when it resumes."""
    prompts = prompts_with_prefixes()[:5]
    params = [SamplingParams(max_new_tokens=30, temperature=0.9, seed=11 + i, ignore_eos=True,
                             frequency_penalty=0.7 if i % 2 else 0.0, repetition_penalty=1.3 if i == 2 else 1.0)
              for i in range(5)]
    want = run(make(models, "target", prefix_cache=False), prompts, params)
    small = make(models, "target", max_total_tokens=110, schedule_conservativeness=0.0)
    small.kv.chunk = 4
    assert run(small, prompts, params) == want and small.last_stats.retractions > 0


def test_step_by_step_invariants_and_abort_during_retraction(models):
    engine = make(models, "eagle", max_total_tokens=140, schedule_conservativeness=0.0)
    engine.kv.chunk = 4
    prompts = prompts_with_prefixes()
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=40, ignore_eos=True)) for p in prompts]
    aborted = False
    for _ in range(2000):
        if not engine.has_work:
            break
        engine.step()
        engine.check_kv()
        if engine.retractions and not aborted:  # abort a retracted request and a running one
            waiting = [r for r in reqs if r.retractions and not r.done and r.table is None]
            for r in waiting[:1] + [r for r in reqs if r.table is not None][:1]:
                engine.abort(r)
            aborted = True
            engine.check_kv()
    assert aborted and not engine.has_work
    assert all(r.done for r in reqs) and any(r.out.finish_reason == "abort" for r in reqs)
    engine.flush_cache()
    assert engine.pool.free_slots == engine.pool.num_slots - 1 and engine.pool.free_rows == engine.max_running


def test_n_samples_of_one_prompt_share_its_prefill(models):
    """Identical prompts submitted together: the first is prefilled, the rest reuse its KV (all but
    the last token) from the cache — n > 1 in the server."""
    engine = make(models, "target")
    prompt = prompts_with_prefixes()[0]
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s) for s in range(3)]
    reqs = [engine.submit(prompt, p) for p in params]
    while engine.has_work:
        engine.step()
    assert [r.cached_tokens for r in reqs] == [0, len(prompt) - 1, len(prompt) - 1]
    assert len({tuple(r.out.token_ids) for r in reqs}) > 1


@pytest.mark.parametrize("shared, groups", [(24, 1), (SHARE_WAIT + 8, 2), (40, "same")])
def test_a_short_shared_prefix_does_not_split_the_prefill(models, shared, groups):
    """Prompts sharing a chat template's short system line are prefilled together (computing it again
    costs less than another prefill dispatch); a long shared prefix, or one prompt sent several times
    (n > 1), is prefilled once and the rest take it from the cache, together in the next prefill (not
    one prefill each). The output is the same either way."""
    rng = np.random.default_rng(7)
    system = list(rng.integers(4, 96, shared))
    prompts = [system + list(rng.integers(4, 96, n)) for n in (9, 14, 11, 20)]
    if groups == "same":
        prompts = [prompts[0]] * 4
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = run(make(models, "target", max_batch_size=4, max_context=400, prefix_cache=False), prompts, params)
    engine = make(models, "target", max_batch_size=4, max_context=400)
    calls = []
    prefill = engine.decoder.prefill

    def counting(reqs, *a, **k):
        calls.append(len(reqs))
        return prefill(reqs, *a, **k)
    engine.decoder.prefill = counting
    assert run(engine, prompts, params) == want
    assert calls == ([4] if groups == 1 else [1, 3])
    cached = engine.last_stats.cached_tokens
    if groups == "same":
        assert cached == 3 * (len(prompts[0]) - 1)
    elif groups == 1:
        assert cached == 0
    else:  # the shared run, and a suffix token now and then that happens to agree
        assert 3 * shared <= cached < 3 * (shared + 9)


@pytest.mark.parametrize("kind", ["target", "eagle"])
def test_the_next_turn_continues_a_request_that_finished_while_others_run(models, kind):
    """A finished request's slot table is read lazily (not between two rounds of a running batch),
    but before anything waiting is admitted: the next turn of a chat, sent while other requests still
    run, takes the finished turn from the prefix cache. Its output equals a cold engine's."""
    rng = np.random.default_rng(9)
    first, other = list(rng.integers(4, 96, 30)), list(rng.integers(4, 96, 12))
    engine = make(models, kind)
    a = engine.submit(first, SamplingParams(max_new_tokens=6, ignore_eos=True))
    b = engine.submit(other, SamplingParams(max_new_tokens=60, ignore_eos=True))
    while not a.done:
        engine.step()
    assert not b.done and engine.num_running == 1
    turn = first + a.out.token_ids + list(rng.integers(4, 96, 5))
    c = engine.submit(turn, SamplingParams(max_new_tokens=8, ignore_eos=True))
    while engine.has_work:
        engine.step()
        engine.check_kv()
    # Everything the first turn committed (speculative keys need the next token: all but its last).
    assert c.cached_tokens >= len(first) + len(a.out.token_ids) - 2
    cold = make(models, kind, prefix_cache=False)
    assert c.out.token_ids == cold.generate([turn], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids


def test_a_roomy_pool_updates_no_slot_table_while_requests_run(models):
    """Each slot-table update is a dispatch between two rounds that stalls the device: with room to
    spare a request gets its whole context at admission and nothing grows while it runs; a pool
    without room grows requests on demand, with the same output."""
    prompts = prompts_with_prefixes()
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (40, 30, 50, 35, 30, 45, 40)]
    outs = {}
    for pool in (None, 200):
        engine = make(models, "eagle", **({} if pool is None else {"max_total_tokens": pool}))
        engine.kv.chunk = 4
        updates = []
        assign = engine.decoder.assign_slots
        engine.decoder.assign_slots = lambda entries: (updates.append(len(entries)), assign(entries))
        outs[pool] = run(engine, prompts, params)
        assert (len(updates) == 0) == (pool is None), (pool, updates)
    assert outs[None] == outs[200]


def test_admission_keeps_room_for_what_running_requests_will_decode(models):
    """Under a short pool, admission keeps room for the expected share of the running requests'
    remaining tokens (SGLang's new_token_ratio): fewer retractions than admitting whatever fits now,
    the same tokens. A retraction raises the share; each step relaxes it towards its floor."""
    from jeagle.runtime.kv_flow import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO

    prompts = prompts_with_prefixes()
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True)] * len(prompts)
    want = run(make(models, "target", prefix_cache=False), prompts, params)
    eager = make(models, "target", max_total_tokens=130, schedule_conservativeness=0.0)
    eager.kv.chunk = 4
    assert run(eager, prompts, params) == want and eager.new_token_ratio == 0.0
    careful = make(models, "target", max_total_tokens=130)
    careful.kv.chunk = 4
    assert careful.new_token_ratio == INIT_NEW_TOKEN_RATIO
    assert run(careful, prompts, params) == want
    assert careful.last_stats.retractions < eager.last_stats.retractions, (careful.last_stats.retractions,
                                                                           eager.last_stats.retractions)
    assert MIN_NEW_TOKEN_RATIO <= careful.info()["new_token_ratio"] <= 1.0
    before = careful.new_token_ratio  # idle now: the estimate only relaxes
    for _ in range(1000):
        careful._decay_ratio()
    assert careful.new_token_ratio == MIN_NEW_TOKEN_RATIO <= before
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        EngineConfig(schedule_conservativeness=-1.0)
    # Requests submitted together are admitted in one step: each admission counts the ones before it.
    first_step = {}
    short = [list(np.random.default_rng(i).integers(4, 96, 10)) for i in range(3)]
    for name, c in (("eager", 0.0), ("careful", 1.0)):
        engine = make(models, "target", max_total_tokens=100, schedule_conservativeness=c, prefix_cache=False)
        engine.kv.chunk = 4
        for p in short:
            engine.submit(p, SamplingParams(max_new_tokens=60, ignore_eos=True))
        engine.step()
        first_step[name] = engine.num_running
        if name == "careful":  # held back by the expected growth: no trimming of the running requests' tails
            for _ in range(10):
                engine.step()
            assert engine.num_waiting and engine.kv.trimmed_total == 0
        engine.abort_all()
    assert first_step["careful"] < first_step["eager"], first_step


def test_admission_does_not_count_a_cached_prefix_against_the_pool(models):
    """Three requests behind a cached 40-token prefix fit a pool that could not hold three copies of
    it: the expected-growth rule counts what a request adds, not what it shares."""
    system = prompts_with_prefixes()[0][:40]
    engine = make(models, "target", max_total_tokens=95)
    engine.kv.chunk = 4
    run(engine, [system + [5, 6]], SamplingParams(max_new_tokens=2))  # the prefix is cached now
    asks = [system + [10 + i, 11 + i, 12 + i] for i in range(3)]
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in asks]
    peak = 0
    while engine.has_work:
        engine.step()
        peak = max(peak, engine.num_running)
        engine.check_kv()
    assert peak == 3 and engine.retractions == 0 and all(r.cached_tokens >= 40 for r in reqs)
    assert 3 * (len(asks[0]) + 12) > engine.pool.num_slots - 1  # three uncached copies would not fit
