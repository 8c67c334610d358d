"""Admission's sums over the running requests (`KVFlow`'s `AdmissionBooks`), kept through one
`_admit_waiting` call instead of summed for every admitted request: the same admission decisions as
the per-request sums they replace (`reference_admit` below, the code before them), checked call by
call on engines under pool pressure (expected-growth refusals, trims, retractions, aborts, requests
arriving while others run, several prefill groups per call); and `FloatSum` equal to `sum()` bit for bit."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.models.eagle import random_draft
from jeagle.models.llama import random_model
from jeagle.runtime.kv_flow import FloatSum
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import draft_config, target_config


def test_float_sum_is_builtin_sum_bit_for_bit():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 60))
        scale = 10.0 ** rng.integers(-3, 17, n)  # magnitudes far apart: where compensation matters
        terms = [float(x) for x in rng.random(n) * scale]
        terms = [0.0 if rng.random() < 0.2 else x for x in terms]
        if trial % 3 == 0:
            terms = [float(k) + 0.1 * (j % 7) for j, k in enumerate(rng.integers(0, 40, n))]
        s = FloatSum()
        for i, x in enumerate(terms):
            s.add(x)
            assert s.value() == sum(terms[: i + 1]), (trial, i)


# ---- the code the books replaced, kept as the reference -------------------------------------------------------
def reference_expected_room(self, r, positions: int) -> int:
    ratio = self.new_token_ratio
    running = self._holders()
    if ratio <= 0 or not running:
        return 0

    def expected(x) -> float:
        return len(x.seq) + ratio * max(0, x.position_cap - len(x.seq))

    grow = sum(max(0.0, expected(x) - len(x.table)) for x in running) + max(0.0, expected(r) - positions)
    return math.ceil(grow)


def reference_admit(self, r) -> bool:
    lay, kv = self.decoder.layout, self.kv
    extra = lay.tree + lay.scratch
    chunk = kv.chunk
    running = self._holders()
    headroom = sum(min(chunk, x.position_cap - len(x.table)) for x in running)
    elsewhere = (sum(x.position_cap - len(x.table) for x in running)
                 + (self.pool.free_rows - 1) * (self.max_context + extra))
    positions = (r.position_cap if kv.roomy(r.position_cap + extra + headroom, elsewhere)
                 else min(r.position_cap, len(r.seq) + chunk))
    room = max(headroom, self._expected_room(r, positions))
    if not kv.admit(r, positions, extra, room):
        if room > headroom or not (self.pool.free_rows and self._trim_running()):
            return False
        positions = min(r.position_cap, len(r.seq) + chunk)
        if not kv.admit(r, positions, extra, max(headroom, self._expected_room(r, positions))):
            return False
    if not r.retractions:
        r.cached_tokens = r.cached
    self._admitted += 1
    r.admit_order = self._admitted
    return True


def check_books(engine) -> None:
    """Before each admission: the kept books equal the sums over `_holders()` computed afresh."""
    admit = engine._admit

    def checked(r):
        books, ratio, chunk = engine._books(), engine.new_token_ratio, engine.kv.chunk
        running = engine._holders()
        assert books.holders == len(running)
        assert books.headroom == sum(min(chunk, x.position_cap - len(x.table)) for x in running)
        assert books.want == sum(x.position_cap - len(x.table) for x in running)
        if running:
            grow = sum(max(0.0, len(x.seq) + ratio * max(0, x.position_cap - len(x.seq)) - len(x.table))
                       for x in running)
            assert books.grow.value() == grow
        engine.checked += 1
        return admit(r)
    engine.checked = 0
    engine._admit = checked


def log_decisions(engine) -> list:
    """Every `KVManager.admit` call (what admission asked for and got) and every trim, in order."""
    log, admit, trim = [], engine.kv.admit, engine._trim_running

    def logged_admit(r, positions, extra, headroom=0):
        got = admit(r, positions, extra, headroom)
        log.append(("admit", r.index, positions, extra, headroom, got, engine.pool.free_slots))
        return got

    def logged_trim():
        n = trim()
        log.append(("trim", n))
        return n
    engine.kv.admit, engine._trim_running = logged_admit, logged_trim
    return log


@pytest.fixture(scope="module")
def models():
    cfg = target_config()
    return random_model(cfg, 1), random_draft(draft_config(cfg), 2)


def workload(seed: int):
    """Requests arriving over the first steps (a few sharing a long prefix, one repeated), and aborts."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(4, 96, 40)]
    arrivals = []
    for i in range(24):
        body = [int(t) for t in rng.integers(4, 96, int(rng.integers(3, 30)))]
        prompt = system + body if i % 3 == 0 else body
        arrivals.append((int(rng.integers(0, 40)) if i >= 8 else 0, prompt,
                         SamplingParams(max_new_tokens=int(rng.integers(3, 50)), ignore_eos=True)))
    arrivals.append((5, arrivals[3][1], arrivals[3][2]))
    aborts = {12: 2, 25: 10}  # step: the request (by arrival) aborted then, if not done
    return arrivals, aborts


def drive(engine, arrivals, aborts) -> list:
    reqs, step = [None] * len(arrivals), 0
    while step < 3000:
        for i, (at, prompt, params) in enumerate(arrivals):
            if at == step:
                reqs[i] = engine.submit(prompt, params, index=i)
        if step in aborts and reqs[aborts[step]] is not None:
            engine.abort(reqs[aborts[step]])
        if not engine.has_work and all(r is not None for r in reqs):
            break
        engine.step()
        step += 1
    engine.check_kv()
    return [(r.out.token_ids, r.out.finish_reason, r.retractions) for r in reqs]


CASES = [  # kind, conservativeness, chunk, max_prefill_tokens (one pool: the executables compile once)
    ("target", 1.0, 4, 8192),
    ("target", 0.0, 4, 256),  # eager: trims before refusals, retractions; several prefill groups per call
    ("eagle", 0.3, 4, 8192),
]


@pytest.mark.parametrize("kind,conservativeness,chunk,prefill", CASES)
def test_admission_decisions_equal_the_per_request_sums(models, kind, conservativeness, chunk, prefill):
    """The same engine runs the workload with the books, then, idle and reset, with the reference:
    every admission asks the pool for the same, gets the same, and the outputs are the same."""
    target, head = models
    cfg = EngineConfig(max_batch_size=6, max_context=160, max_total_tokens=180,
                       schedule_conservativeness=conservativeness, max_prefill_tokens=prefill,
                       batch_buckets=(6,), min_prefill_bucket=32,
                       admission_delay=0.0)  # at once: timed holds (runtime/admission.py) would part the two runs
    engine = target_only(target, cfg) if kind == "target" else speculative(target, head, cfg, SpecConfig(3, 2, 5))
    engine.kv.chunk = chunk
    log = log_decisions(engine)
    results, logs, counts = {}, {}, {}
    admit = engine._admit
    for name in ("books", "reference"):
        arrivals, aborts = workload(7)
        if name == "reference":
            engine._admit = types.MethodType(reference_admit, engine)
            engine._expected_room = types.MethodType(reference_expected_room, engine)
        else:
            check_books(engine)
        engine.flush_cache()
        engine.new_token_ratio, engine._admitted, engine.retractions, engine.kv.trimmed_total = (
            engine._ratio_init, 0, 0, 0)
        results[name] = drive(engine, arrivals, aborts)
        logs[name], counts[name] = list(log), (engine.retractions, engine.kv.trimmed_total, engine.new_token_ratio)
        log.clear()
        engine._admit = admit
    assert logs["books"] == logs["reference"]
    assert results["books"] == results["reference"]
    assert counts["books"] == counts["reference"]
    assert engine.checked > len(arrivals)
    refused = sum(1 for e in logs["books"] if e[0] == "admit" and not e[5])
    assert refused > 0  # the pool was short: admission turned requests away
    if conservativeness < 1.0:  # retractions, and admissions that trimmed the running requests' tails first
        log = logs["books"]
        assert counts["books"][0] > 0
        assert any(a[0] == "admit" and not a[5] and t[0] == "trim" and t[1] > 0 and b[0] == "admit" and b[1] == a[1]
                   for a, t, b in zip(log, log[1:], log[2:]))
