"""Penalties: repetition, frequency and presence penalties, min_tokens and logit_bias give
the same greedy tokens as a plain numpy reference (a teacher-forced forward per token, the penalties
applied by hand) in target-only decoding and in EAGLE rounds of every tier (the tree's path tokens
counted), with decode steps and rounds looped on the device; requests without penalties in the same
batch keep their tokens; sampled requests with penalties follow the penalized distribution. fp32,
tiny models."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from jeagle.engine import EngineConfig, speculative, target_only
from jeagle.sampling import SamplingParams
from jeagle.speculative.round import SpecConfig
from tests.spec_models import bigram_target, signed_identity_head, target_config
from tests.util import last_logits, ragged_forward, kv_idle

MAX_CONTEXT = 96
EOS = 3


@pytest.fixture(scope="module")
def target():
    return bigram_target(target_config(), scale=4.0)  # soft: penalties change the argmax


@pytest.fixture(scope="module")
def head(target):
    return signed_identity_head(target, +1.0, noise=0.05)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [list(map(int, rng.integers(4, 96, n))) for n in (6, 3, 9, 4)]


def penalize(x, prompt, out, p: SamplingParams, stops):
    """The penalties by hand, on one position's fp64 logits."""
    x = x.astype(np.float64).copy()
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(out).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    if len(out) < p.min_tokens:
        x[list(stops)] = -np.inf
    return x


def reference(target, prompt, p: SamplingParams):
    stops = set() if p.ignore_eos else {EOS}
    stops |= set(p.stop_token_ids)
    out = []
    while len(out) < p.max_new_tokens:
        tok = int(np.argmax(penalize(last_logits(target, prompt + out, MAX_CONTEXT), prompt, out, p, stops)))
        out.append(tok)
        if tok in stops:
            break
    return out


CASES = [
    dict(frequency_penalty=2.0),
    dict(presence_penalty=2.0, repetition_penalty=1.3),
    dict(repetition_penalty=0.7, frequency_penalty=-0.5),
    dict(logit_bias=((10, 2.0), (20, -100.0), (EOS, 9.0)), min_tokens=6),  # EOS wins once min_tokens allows
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def penalized(prompts):
    params = [SamplingParams(max_new_tokens=MAX_NEW, **kw) for kw in CASES]
    return params


@pytest.fixture(scope="module")
def expected(target, prompts, penalized):
    return [reference(target, p, sp) for p, sp in zip(prompts, penalized)]


def test_reference_is_not_trivial(target, prompts, penalized, expected):
    """The penalties change these outputs (else the test below would prove nothing)."""
    plain = [reference(target, p, SamplingParams(max_new_tokens=MAX_NEW)) for p in prompts]
    assert all(a != b for a, b in zip(plain, expected))
    assert len(expected[3]) == 7 and expected[3][-1] == EOS  # min_tokens held EOS back for 6 tokens


@pytest.mark.parametrize("steps", [1, 3])
def test_target_only_equals_the_reference(target, prompts, penalized, expected, steps):
    eng = target_only(target, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4),
                                           decode_steps=steps))
    assert [o.token_ids for o in eng.generate(prompts, penalized)] == expected


@pytest.mark.parametrize("tier,rounds", [((3, 2, 5), 1), ((2, 1, 3), 1), ((4, 3, 8), 2)])
def test_eagle_equals_the_reference(target, head, prompts, penalized, expected, tier, rounds):
    eng = speculative(target, head, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4),
                                                 rounds_per_dispatch=rounds), SpecConfig(*tier))
    outs = eng.generate(prompts, penalized)
    assert [o.token_ids for o in outs] == expected
    assert eng.last_stats.to_dict()["accept_length"] > 1.0
    assert kv_idle(eng)[0] == eng.pool.num_slots - 1


def test_mixed_batch_keeps_plain_requests(target, head, prompts, penalized, expected):
    """Plain requests batched with penalized ones (on rows penalized requests used before) keep
    their tokens."""
    plain = SamplingParams(max_new_tokens=MAX_NEW)
    base = [o.token_ids for o in target_only(target, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT)).generate(
        prompts, [plain] * 4)]
    mixed = [penalized[0], plain, penalized[3], plain, plain, penalized[1]]
    ps = prompts + prompts[:2]
    for eng in (target_only(target, EngineConfig(max_batch_size=2, max_context=MAX_CONTEXT, batch_buckets=(1, 2))),
                speculative(target, head, EngineConfig(max_batch_size=2, max_context=MAX_CONTEXT, batch_buckets=(1, 2)),
                            SpecConfig(3, 2, 5))):
        got = [o.token_ids for o in eng.generate(ps, mixed)]
        assert got[1] == base[1] and got[3] == base[3] and got[4] == base[0]
        assert got[0] == expected[0] and got[2] == reference(target, prompts[2], penalized[3])
        assert got[5] == expected[1]


def test_sampled_with_penalties_follow_the_penalized_law():
    """Seeded samples at temperature 1 with frequency + presence penalties, EAGLE on: after a first
    token 69 (the sharper bigram target's likeliest self-transition, p(69 | 69) = 0.33), the second
    token's empirical law matches the penalized target law (69 pushed down by e^-3), not the raw one."""
    target = bigram_target(target_config(), scale=16.0)
    head = signed_identity_head(target, +1.0, noise=0.05)
    prompt, t0 = [17, 69], 69
    sp = dict(max_new_tokens=2, temperature=1.0, frequency_penalty=2.0, presence_penalty=1.0, ignore_eos=True)
    n = 800
    eng = speculative(target, head, EngineConfig(max_batch_size=16, max_context=MAX_CONTEXT), SpecConfig(3, 2, 5))
    outs = eng.generate([prompt] * n, [SamplingParams(seed=i, **sp) for i in range(n)])
    seconds = [o.token_ids[1] for o in outs if o.token_ids[0] == t0]
    assert len(seconds) > 150
    logits, _ = ragged_forward(target, [prompt + [t0]])
    softmax = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()  # noqa: E731
    law = softmax(penalize(logits[0, -1], prompt, [t0], SamplingParams(**sp), set()))
    raw = softmax(logits[0, -1].astype(np.float64))
    emp = np.bincount(seconds, minlength=law.size) / len(seconds)
    assert raw[t0] > 0.25 and law[t0] < 0.05  # the penalty bites on the repeated token
    m = len(seconds)
    sigma = lambda p: np.sqrt(p * (1 - p) / m)  # noqa: E731
    assert abs(emp[t0] - law[t0]) < 4 * sigma(law[t0]) + 0.01 and emp[t0] < raw[t0] - 10 * sigma(raw[t0])
    for t in np.flatnonzero(law > 0.03):  # the likely tokens, each within 4 sigma of the penalized law
        assert abs(emp[t] - law[t]) < 4 * sigma(law[t]) + 0.01, (t, emp[t], law[t])


def test_bad_penalties_are_refused(target):
    for kw in (dict(frequency_penalty=2.5), dict(presence_penalty=-3), dict(repetition_penalty=0.0),
               dict(min_tokens=-1), dict(logit_bias=((5, 101.0),)), dict(logit_bias=((5, 1.0), (5, 2.0)))):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    eng = target_only(target, EngineConfig(max_batch_size=1, max_context=MAX_CONTEXT))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.check([5, 6], SamplingParams(logit_bias=((1000, 1.0),)))


def test_eagle3_head_drafts_under_penalties_losslessly(target, prompts, penalized, expected):
    """An EAGLE-3 head (its own draft vocabulary, d2t) drafts under the penalties mapped onto that
    vocabulary; the output is still the reference's."""
    from jeagle.models.eagle import random_draft
    from tests.spec_models import draft_config

    head3 = random_draft(draft_config(target.cfg, "eagle3"), seed=4)
    eng = speculative(target, head3, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4)),
                      SpecConfig(3, 2, 5))
    assert [o.token_ids for o in eng.generate(prompts, penalized)] == expected


def test_tokens_repeated_inside_one_round_are_counted():
    """A token that follows itself (69 on the sharper bigram target: its likeliest successor) is
    drafted again and again inside one round; the verify must count the path's earlier copies, or it
    accepts more repeats than target-only decoding emits."""
    target = bigram_target(target_config(), scale=16.0)
    head = signed_identity_head(target, +1.0)
    prompts = [[17, 69], [40, 69, 69], [69]]
    sp = SamplingParams(max_new_tokens=16, frequency_penalty=1.0, ignore_eos=True)  # (0.3 did not need the path)
    want = [reference(target, p, sp) for p in prompts]
    assert all(w.count(69) >= 2 for w in want)  # the repeats happen
    eng = speculative(target, head, EngineConfig(max_batch_size=4, max_context=MAX_CONTEXT, batch_buckets=(1, 2, 4)),
                      SpecConfig(4, 2, 6))
    assert [o.token_ids for o in eng.generate(prompts, [sp] * 3)] == want
    assert eng.last_stats.to_dict()["accept_length"] > 1.5
