"""The draft's one-pass softmax + top-K kernel (jeagle/kernels/topk.py): interpreted on CPU and compiled
with -m gpu, against `jax.lax.top_k(jax.nn.softmax(x), k)`. Cases: the shipped head's 8,192-entry draft
vocabulary, rows padded to a power of two, k from 1 to the adaptive tiers' 10; ties and -inf logits;
longer vocabularies (32k-entry EAGLE-3 heads, EAGLE-1 heads over the target's) and the switch taking
the reference; the draft's top-K going through it inside a round. `top_k` (the kernel's indices, the
values gathered) against `jax.lax.top_k`, and the logprobs' blocked top-20 going through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.kernels.settings import KernelSettings, use
from jeagle.kernels.topk import MAX_VOCAB, softmax_topk, softmax_topk_reference, top_k
from tests.kernels.lowering import lower_for_h100

# (rows, vocabulary, k): batch 1 / batch 4 of a (5,4,8) draft step, a 12,288-token head (16 warps), padded
# rows, k = 1 and 10.
SHAPES = [(1, 8192, 4), (16, 8192, 4), (2, 12288, 4), (1, 16384, 8), (5, 1000, 4), (3, 5000, 10), (4, 64, 1),
          (2, 4096, 8)]


def logits(r, v, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(r, v)) * 3, dtype)


def check(mode, r, v, k, seed, dtype=jnp.float32):
    x = logits(r, v, seed, dtype)
    with use(KernelSettings(backend=mode)):
        p, idx = jax.jit(lambda a: softmax_topk(a, k))(x)
    want_p, want_idx = softmax_topk_reference(x, k)
    assert p.shape == idx.shape == (r, k) and p.dtype == jnp.float32 and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(p), np.asarray(want_p), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("r,v,k", SHAPES)
def test_interpreted_kernel_matches_reference(r, v, k):
    check("interpret", r, v, k, seed=r + v + k)


def test_bf16_logits_and_leading_axes():
    x = logits(6, 8192, 1, jnp.bfloat16).reshape(2, 3, 8192)  # [B, K, Vd] as a draft step has them
    with use(KernelSettings(backend="interpret")):
        p, idx = softmax_topk(x, 4)
    want_p, want_idx = softmax_topk_reference(x, 4)
    assert p.shape == (2, 3, 4)
    # bf16 logits tie often: the kernel breaks ties to the lower index, as the reference does
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_idx))
    np.testing.assert_allclose(np.asarray(p), np.asarray(want_p), rtol=1e-5)


def test_ties_and_minus_infinity():
    inf = float("inf")
    x = jnp.asarray([[1.0, 3.0, 3.0, -inf, 3.0, -inf, 0.5, 3.0] + [-inf] * 8,
                     [-inf] * 14 + [2.0, -inf]])
    with use(KernelSettings(backend="interpret")):
        p, idx = softmax_topk(x, 6)
    # equal logits in index order; past the finite ones, -inf entries by index, never one twice
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2, 4, 7, 0, 6], [14, 0, 1, 2, 3, 4]])
    np.testing.assert_allclose(np.asarray(p[0]), np.asarray(softmax_topk_reference(x[:1], 6)[0][0]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(p[1]), [1, 0, 0, 0, 0, 0])


def test_wider_draft_vocabularies_take_the_kernel(monkeypatch):
    """A 12,288-token EAGLE-3 head's rows (padded to 16,384) go through the kernel, not the reference, and
    the kernel runs them with 16 warps."""
    import jeagle.kernels.topk as topk

    seen = []
    real = topk.pl.pallas_call
    monkeypatch.setattr(topk.pl, "pallas_call", lambda *a, **kw: seen.append(kw["compiler_params"].num_warps)
                        or real(*a, **kw))
    x = logits(2, 12288, 3)
    with use(KernelSettings(backend="interpret")):
        p, idx = softmax_topk(x, 4)
    assert seen == [16]
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(softmax_topk_reference(x, 4)[1]))


def test_switch_and_validation(monkeypatch):
    import jeagle.kernels.topk as topk

    calls = []
    monkeypatch.setattr(topk, "_pallas", lambda *a, **kw: calls.append(1) or (_ for _ in ()).throw(AssertionError))
    x = logits(2, 64, 0)
    with use(KernelSettings(backend="interpret", topk=False)):
        softmax_topk(x, 3)  # the switch off: the reference, the kernel never called
    with use(KernelSettings(backend="reference")):
        softmax_topk(x, 3)
    big = logits(2, MAX_VOCAB + 1, 0)  # a longer vocabulary: the reference, equal to itself
    with use(KernelSettings(backend="interpret")):
        p, idx = softmax_topk(big, 4)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(softmax_topk_reference(big, 4)[1]))
    assert not calls
    with pytest.raises(ValueError, match="k must be in"):
        softmax_topk(x, 65)
    with pytest.raises(ValueError, match="k must be in"):
        softmax_topk(x, 0)


def test_rounds_take_the_draft_topk_through_the_kernel(monkeypatch):
    """draft_topk (every draft step, the draft extend, a speculative prefill) asks the kernel."""
    import jeagle.kernels.topk as topk
    from jeagle.speculative import round as spec_round

    seen = []
    real = topk._pallas
    monkeypatch.setattr(topk, "_pallas", lambda x, k, **kw: seen.append((x.shape, k)) or real(x, k, **kw))

    class Head:
        def draft_to_target(self, ids):
            return ids + 100

    with use(KernelSettings(backend="interpret")):
        p, ids = spec_round.draft_topk(Head(), logits(6, 128, 2).reshape(2, 3, 128), 4)
    want_p, want_ids = softmax_topk_reference(logits(6, 128, 2), 4)
    assert seen == [((6, 128), 4)]
    np.testing.assert_array_equal(np.asarray(ids).reshape(6, 4), np.asarray(want_ids) + 100)


# top_k: the logprobs' block maxima and candidates at batch 32 x 6 emitted tokens (k = 20), the grammar
# walk's 8 candidates, leading axes, a row padded to a power of two.
TOP_K_SHAPES = [((192, 384), 20), ((7, 2560), 20), ((2, 3, 384), 20), ((5, 1024), 8), ((3, 1000), 20)]


def check_top_k(mode, shape, k, seed):
    x = jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)
    with use(KernelSettings(backend=mode)):
        vals, idx = jax.jit(lambda a: top_k(a, k))(x)
    want_v, want_i = jax.lax.top_k(x, k)
    assert vals.shape == idx.shape == shape[:-1] + (k,) and vals.dtype == x.dtype and idx.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))


@pytest.mark.parametrize("shape,k", TOP_K_SHAPES)
def test_top_k_equals_lax_top_k(shape, k):
    check_top_k("interpret", shape, k, seed=sum(shape) + k)


def test_top_k_ties_switch_and_validation(monkeypatch):
    import jeagle.kernels.topk as topk

    inf = float("inf")
    x = jnp.asarray([[1.0, 3.0, 3.0, -inf, 3.0, -inf, 0.5, 3.0]])
    with use(KernelSettings(backend="interpret")):
        vals, idx = top_k(x, 5)
    np.testing.assert_array_equal(np.asarray(idx), [[1, 2, 4, 7, 0]])  # equal values in index order
    np.testing.assert_array_equal(np.asarray(vals), [[3.0, 3.0, 3.0, 3.0, 1.0]])
    nan = np.array([-1], np.int32).view(np.float32)[0]  # the NaN whose bits are all ones
    with use(KernelSettings(backend="interpret")):
        _, idx = top_k(jnp.asarray([[1.0, nan, 2.0, 0.5]]), 4)
        assert sorted(np.asarray(idx)[0].tolist()) == [0, 1, 2, 3]  # every index once
        assert top_k(jnp.zeros((0, 40)), 20)[1].shape == (0, 20)  # no rows: XLA's
    calls = []
    monkeypatch.setattr(topk, "_pallas", lambda *a, **kw: calls.append(1) or (_ for _ in ()).throw(AssertionError))
    for settings in (KernelSettings(backend="interpret", topk=False), KernelSettings(backend="reference")):
        with use(settings):
            np.testing.assert_array_equal(np.asarray(top_k(x, 5)[1]), [[1, 2, 4, 7, 0]])  # XLA's top-k
    assert not calls
    with pytest.raises(ValueError, match="k must be in"):
        top_k(x, 9)


def test_logprobs_top_k_goes_through_the_kernel(monkeypatch):
    """`jeagle.sampling.logprobs.top_k_blocked` over a 49,152-entry vocabulary: the block maxima's and the
    candidates' top 20 both through the kernel, the result equal to `jax.lax.top_k`'s."""
    import jeagle.kernels.topk as topk
    from jeagle.sampling.logprobs import LOGPROB_TOP, top_k_blocked

    seen = []
    real = topk._pallas
    monkeypatch.setattr(topk, "_pallas", lambda x, k, **kw: seen.append((x.shape, k)) or real(x, k, **kw))
    x = jax.random.normal(jax.random.key(3), (3, 49152))
    with use(KernelSettings(backend="interpret")):
        vals, ids = top_k_blocked(x, LOGPROB_TOP)
    assert seen == [((3, 384), LOGPROB_TOP), ((3, 2560), LOGPROB_TOP)]
    want_v, want_i = jax.lax.top_k(x, LOGPROB_TOP)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))


def test_lowers_for_h100():
    with use(KernelSettings(backend="pallas")):
        for r, v, k in [(4, 8192, 4), (192, 8192, 4), (10, 5000, 10), (4, 12288, 4), (192, 12288, 4)]:
            lower_for_h100(lambda a: softmax_topk(a, k), logits(r, v, 0))
        for r, v, k in [(192, 384, 20), (192, 2560, 20), (256, 1024, 8)]:
            lower_for_h100(lambda a: top_k(a, k), logits(r, v, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("r,v,k", SHAPES)
def test_compiled_kernel_matches_reference(r, v, k):
    check("pallas", r, v, k, seed=r + k)
    check("pallas", r, v, k, seed=r + k + 1, dtype=jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,k", TOP_K_SHAPES)
def test_compiled_top_k_equals_lax_top_k(shape, k):
    check_top_k("pallas", shape, k, seed=sum(shape) + k + 1)
