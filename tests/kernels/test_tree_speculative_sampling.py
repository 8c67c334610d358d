"""tree_speculative_sampling: the Pallas kernel (interpreted on CPU, compiled with -m gpu) gives the
same tokens as its pure-jnp reference for the same coins, on random trees of every size the round
uses, vocabularies that are and are not a multiple of the kernel's block, and both thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.kernels.settings import KernelSettings, use
from jeagle.kernels.tree_speculative_sampling import tree_speculative_sampling, tree_speculative_sampling_reference
from tests.kernels.trees import random_sampling_inputs

CASES = [(b, n, k, v) for b, (n, k), v in zip(
    [1, 3, 64, 1, 3, 64, 1, 3, 64, 3, 64, 1, 3, 64, 3],
    [(2, 1), (2, 4), (4, 1), (4, 4), (4, 8), (8, 1), (8, 4), (8, 8), (17, 1), (17, 4), (17, 8), (64, 1), (64, 4),
     (64, 8), (64, 8)],
    [37, 300, 64, 37, 300, 12, 37, 300, 37, 300, 37, 300, 37, 12, 300])]


def check(mode, b, n, k, v, seed, thresholds=(1.0, 1.0)):
    args, steps = random_sampling_inputs(b, n, k, v, seed=seed)
    lengths = []
    for s in sorted({steps, min(steps, 3), 1}):
        with use(KernelSettings(backend=mode)):
            got = tree_speculative_sampling(*args, s, *thresholds)
        want = tree_speculative_sampling_reference(*args, s, *thresholds)
        for name, x, y in zip(("predict", "accept_index", "accept_length", "bonus"), got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                          err_msg=f"{name} b={b} n={n} k={k} v={v} s={s} t={thresholds}")
        lengths.append(np.asarray(want[2]))
    return np.concatenate(lengths)


@pytest.mark.parametrize("b,n,k,v", CASES, ids=[f"B{b}-N{n}-K{k}-V{v}" for b, n, k, v in CASES])
def test_interpreted_kernel_matches_reference(b, n, k, v):
    lengths = check("interpret", b, n, k, v, seed=b * 1000 + n * 10 + k)
    if n >= 8 and b >= 64:
        assert lengths.max() >= 1  # the random inputs do produce accepted walks


@pytest.mark.parametrize("thresholds", [(0.3, 1.0), (1.0, 0.5), (0.5, 0.7)])
def test_relaxed_thresholds(thresholds):
    check("interpret", 8, 17, 4, 300, seed=11, thresholds=thresholds)


def test_bonus_follows_the_residual():
    """Walks that reject every child draw the bonus from q minus those children: over many coins the
    kernel's bonus frequencies match the residual distribution."""
    import jax.numpy as jnp

    b, v = 4000, 5
    cand = jnp.tile(jnp.array([[0, 1, 2]], jnp.int32), (b, 1))  # root, two children (tokens 1, 2)
    ridx = jnp.arange(b * 3, dtype=jnp.int32).reshape(b, 3)
    nxt = jnp.tile(jnp.array([[1, -1, -1]], jnp.int32), (b, 1))
    sib = jnp.tile(jnp.array([[-1, 2, -1]], jnp.int32), (b, 1))
    q = jnp.array([0.1, 0.2, 0.3, 0.15, 0.25], jnp.float32)
    probs = jnp.broadcast_to(q, (b, 3, v))
    coins = jnp.ones((b, 3), jnp.float32)  # coin 1.0 > any partial mass: both children rejected
    final = jnp.asarray(np.random.default_rng(0).random(b), jnp.float32)
    with use(KernelSettings(backend="interpret")):
        _, _, acc, bonus = tree_speculative_sampling(cand, ridx, nxt, sib, probs, coins, final, 3)
    assert int(acc.max()) == 0
    freq = np.bincount(np.asarray(bonus), minlength=v) / b
    want = np.array([0.1, 0.0, 0.0, 0.15, 0.25]) / 0.5
    np.testing.assert_allclose(freq, want, atol=0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,k,v", CASES, ids=[f"B{b}-N{n}-K{k}-V{v}" for b, n, k, v in CASES])
def test_compiled_kernel_matches_reference(b, n, k, v):
    check("pallas", b, n, k, v, seed=b * 1000 + n * 10 + k + 7)


@pytest.mark.gpu
def test_compiled_kernel_large_vocab():
    check("pallas", 64, 8, 4, 49152, seed=3)


def test_bad_inputs_are_refused():
    import jax.numpy as jnp

    x = jnp.zeros((2, 4), jnp.int32)
    p = jnp.zeros((2, 4, 9), jnp.float32)
    c, f = jnp.zeros((2, 4)), jnp.zeros((2,))
    with pytest.raises(ValueError, match="target_probs must be"):
        tree_speculative_sampling(x, x, x, x, p.astype(jnp.bfloat16), c, f, 2)
    with pytest.raises(ValueError, match="coins must be"):
        tree_speculative_sampling(x, x, x, x, p, c[:, :3], f, 2)
    with pytest.raises(ValueError, match="thresholds"):
        tree_speculative_sampling(x, x, x, x, p, c, f, 2, 0.0)


@pytest.mark.parametrize("v", [37, 49152])
def test_lowers_to_triton(v):
    import functools

    from jeagle.kernels import tree_speculative_sampling as tss
    from tests.kernels.lowering import lower_for_h100

    args, _ = random_sampling_inputs(4, 8, 4, v, seed=1)
    lower_for_h100(functools.partial(tss._pallas, num_spec_steps=4, interpret=False), *args)


@pytest.mark.parametrize("mode", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
def test_bonus_never_lands_on_a_token_without_mass(mode):
    """Zero-mass holes at and around the block boundary (V = 3,000: blocks of 2,048, the last one
    overlapping): whatever the coin, the bonus is a token with mass; rows with no mass at all or NaN
    probabilities give what the reference gives."""
    import jax.numpy as jnp

    b, v = 512, 3000
    rng = np.random.default_rng(7)
    q = rng.random(v).astype(np.float32)
    q[952] = 0
    q[2040:2150] = 0
    q[2990:] = 0
    q /= q.sum()
    probs = np.broadcast_to(q, (b, 1, v)).copy()
    probs[1] = 0.0  # no mass at all
    probs[2] = np.nan
    one = lambda x: jnp.asarray(np.full((b, 1), x), jnp.int32)  # noqa: E731
    cand, ridx, nxt, sib = one(0), jnp.arange(b, dtype=jnp.int32)[:, None], one(-1), one(-1)
    coins = jnp.zeros((b, 1), jnp.float32)
    final = jnp.asarray(np.concatenate([[0.5, 0.5, 0.5], np.linspace(0, 1, b - 3, endpoint=False)]), jnp.float32)
    args = (cand, ridx, nxt, sib, jnp.asarray(probs), coins, final, 1)
    with use(KernelSettings(backend=mode)):
        bonus = np.asarray(tree_speculative_sampling(*args)[3])
    want = np.asarray(tree_speculative_sampling_reference(*args)[3])
    assert bonus[1] == want[1] == v - 1 and bonus[2] == want[2] == 0
    assert (q[bonus[3:]] > 0).all()
