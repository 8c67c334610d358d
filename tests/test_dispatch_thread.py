"""`EngineConfig.dispatch_thread` (jeagle/runtime/dispatch.py): the executables' calls on a thread of
their own change no token and no logprob — greedy EAGLE equals target-only, sampled runs equal the
calling-thread engine's for the same seeds, rounds per dispatch R = 2 too — every slot comes back, the
calls did run on the dispatch thread, and a failing call raises on the engine's thread. fp32, tiny models."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.runtime.dispatch import Dispatched, Dispatching, resolve
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import kv_idle

MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config())


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.08)  # partial acceptance


@pytest.fixture(scope="module")
def workload():
    """Six requests on four rows: a stop token, max-new limits, one that runs into the context's end."""
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(4, 96, n)) for n in (5, 2, 9, 3, 7, 80)]
    params = [SamplingParams(max_new_tokens=m, ignore_eos=True) for m in (4, 23, 9, 13, 6)]
    params[3] = SamplingParams(max_new_tokens=30, stop_token_ids=(7, 11, 19))
    params.append(SamplingParams(max_new_tokens=64, ignore_eos=True))
    return prompts, params


def config(**kw):
    return EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4), **kw)


def watch_calls(engine, fail_at: int | None = None) -> list[str]:
    """Wrap the engine's executables: each call records the thread it ran on; call number `fail_at`
    (from 0) raises before it runs (the state is not donated: the engine can go on after an abort)."""
    threads, executables = [], engine.decoder.executables
    get = executables.get

    def wrapped(key):
        exe = get(key)

        def call(*args):
            threads.append(threading.current_thread().name)
            if fail_at is not None and len(threads) == fail_at + 1:
                raise RuntimeError("injected device failure")
            return exe(*args)
        return call
    executables.get = wrapped
    return threads


def on_the_dispatch_thread(threads) -> bool:
    return bool(threads) and all(t.startswith("jeagle-dispatch") for t in threads)


@pytest.fixture(scope="module")
def reference(target, workload):
    prompts, params = workload
    return [o.token_ids for o in target_only(target, config()).generate(prompts, params)]


@pytest.mark.parametrize("rounds", [1, 2])
def test_speculative_tokens_and_logprobs_are_the_calling_threads(target, head, workload, reference, rounds):
    prompts, params = workload
    eng = speculative(target, head, config(dispatch_thread=True, rounds_per_dispatch=rounds), SpecConfig(3, 2, 5))
    threads = watch_calls(eng)
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got[:5] == reference[:5]
    assert got[5] == reference[5][:len(got[5])] and got[5]  # speculation keeps S + 1 positions in reserve
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1
    assert on_the_dispatch_thread(threads)  # every prefill and round call
    sampled = [SamplingParams(max_new_tokens=16, temperature=0.9, seed=50 + i, ignore_eos=True, logprobs=2)
               for i in range(4)]
    plain = speculative(target, head, config(rounds_per_dispatch=rounds), SpecConfig(3, 2, 5))
    plain_threads = watch_calls(plain)
    a, b = eng.generate(prompts[:4], sampled), plain.generate(prompts[:4], sampled)
    assert plain_threads and not any(t.startswith("jeagle-dispatch") for t in plain_threads)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        np.testing.assert_array_equal([t.logprob for t in x.logprobs], [t.logprob for t in y.logprobs])
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


def test_target_only_tokens_are_the_calling_threads(target, workload, reference):
    prompts, params = workload
    eng = target_only(target, config(dispatch_thread=True))
    threads = watch_calls(eng)
    assert [o.token_ids for o in eng.generate(prompts, params)] == reference
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1 and on_the_dispatch_thread(threads)


def test_a_failed_call_aborts_once_and_the_engine_serves_on(target, head, workload, reference):
    """A call that fails on the dispatch thread raises once on the engine's thread; `abort_all` (what
    the server does then) frees every row and slot, admitted-not-prefilled requests included, and the
    engine serves the same tokens afterwards."""
    prompts, params = workload
    eng = speculative(target, head, config(dispatch_thread=True), SpecConfig(3, 2, 5))
    watch_calls(eng, fail_at=5)
    for p, sp in zip(prompts, params):
        eng.submit(p, sp)
    with pytest.raises(RuntimeError, match="injected device failure"):
        for _ in range(200):
            eng.step()
    aborted = eng.abort_all()
    assert aborted and all(r.out.finish_reason == "abort" for r in aborted)
    eng.check_kv()
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1 and not eng.has_work
    got = [o.token_ids for o in eng.generate(prompts, params)]
    assert got[:5] == reference[:5] and got[5] == reference[5][:len(got[5])]
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


class Calls(Dispatching):
    """A decoder's dispatch part alone: the 'executable' adds its input to the state."""

    param_leaves = ()

    def __init__(self):
        self.use_dispatch_thread(True)
        self.state = 0
        self.order = []


def test_calls_run_in_order_and_the_state_waits_for_them():
    d = Calls()

    def exe(_params, state, x):
        d.order.append(x)
        return jnp.full(2, state + x), state + x

    results = [d.dispatch(exe, x) for x in (1, 2, 3)]
    assert all(isinstance(r, Dispatched) for r in results)
    assert d.state == 6 and d.order == [1, 2, 3]  # reading the state waits for the last call
    assert [int(np.asarray(r)[0]) for r in results] == [1, 3, 6] and int(resolve(results[2])[1]) == 6


def test_a_failing_call_raises_on_the_engines_thread():
    d = Calls()

    def exe(_params, _state, _x):
        raise RuntimeError("the device failed")

    r = d.dispatch(exe, 1)
    with pytest.raises(RuntimeError, match="the device failed"):
        np.asarray(r)
    assert d.state == 0  # raised once: the state's next read does not raise it again
    d2 = Calls()
    d2.dispatch(exe, 1)
    with pytest.raises(RuntimeError, match="the device failed"):
        d2.state  # noqa: B018 (the read is the test)
    d3 = Calls()
    d3.dispatch(exe, 1)
    d3.settle()  # the abort path: waits, raises nothing, leaves nothing in flight
    assert d3.state == 0
