"""verify_tree_greedy: the Pallas kernel (interpreted on CPU, compiled with -m gpu) is bit-exact
with its pure-jnp reference on random trees of every size the round uses."""

from __future__ import annotations

import numpy as np
import pytest

from jeagle.kernels.settings import KernelSettings, use
from jeagle.kernels.verify_tree_greedy import verify_tree_greedy, verify_tree_greedy_reference
from tests.kernels.trees import random_trees

CASES = [(b, n, k) for b, (n, k) in zip([1, 3, 64, 1, 3, 64, 1, 3, 64, 3, 64, 1, 3, 64, 3],
                                        [(2, 1), (2, 4), (4, 1), (4, 4), (4, 8), (8, 1), (8, 4), (8, 8), (17, 1),
                                         (17, 4), (17, 8), (64, 1), (64, 4), (64, 8), (64, 8)])]


def check(mode, b, n, k, seed):
    args, steps = random_trees(b, n, k, seed=seed)
    for s in sorted({steps, min(steps, 3), 1}):
        with use(KernelSettings(backend=mode)):
            got = verify_tree_greedy(*args, s)
        want = verify_tree_greedy_reference(*args, s)
        for name, x, y in zip(("predict", "accept_index", "accept_length", "bonus"), got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name} b={b} n={n} k={k} s={s}")
    return np.asarray(want[2])


@pytest.mark.parametrize("b,n,k", CASES, ids=[f"B{b}-N{n}-K{k}" for b, n, k in CASES])
def test_interpreted_kernel_matches_reference(b, n, k):
    lengths = check("interpret", b, n, k, seed=b * 1000 + n * 10 + k)
    if n >= 8 and b > 1:
        assert lengths.max() >= (2 if k == 1 else 1)  # the random trees do produce accepted walks


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,k", CASES, ids=[f"B{b}-N{n}-K{k}" for b, n, k in CASES])
def test_compiled_kernel_matches_reference(b, n, k):
    check("pallas", b, n, k, seed=b * 1000 + n * 10 + k + 7)


def test_bad_inputs_are_refused():
    import jax.numpy as jnp

    x = jnp.zeros((2, 4), jnp.int32)
    with pytest.raises(ValueError, match="candidates must be"):
        verify_tree_greedy(jnp.zeros(4, jnp.int32), x, x, x, x, 2)
    with pytest.raises(ValueError, match="retrieve_next_token has shape"):
        verify_tree_greedy(x, x, jnp.zeros((2, 5), jnp.int32), x, x, 2)
    with pytest.raises(ValueError, match="integer"):
        verify_tree_greedy(x, x, x, x, jnp.zeros((2, 4)), 2)


def test_lowers_to_triton():
    import functools

    from jeagle.kernels import verify_tree_greedy as vtg
    from tests.kernels.lowering import lower_for_h100

    args, _ = random_trees(4, 17, 4, seed=1)
    lower_for_h100(functools.partial(vtg._pallas, num_spec_steps=4, interpret=False), *args)
