"""build_tree: the Pallas kernel (interpreted on CPU, compiled with -m gpu) is bit-exact with its
pure-jnp reference on drafts of every size the round uses (chains and top-K trees)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jeagle.kernels.build_tree import build_tree, build_tree_reference
from jeagle.kernels.settings import KernelSettings, use
from tests.kernels.trees import random_drafts

CASES = [(b, n, k) for b, (n, k) in zip([1, 3, 64, 1, 3, 64, 1, 3, 64, 3, 64, 1, 3, 64, 3],
                                        [(2, 1), (2, 4), (4, 1), (4, 4), (4, 8), (8, 1), (8, 4), (8, 8), (17, 1),
                                         (17, 4), (17, 8), (64, 1), (64, 4), (64, 8), (64, 8)])]
FIELDS = ("tokens", "parent", "depth", "mask", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling")


def check(mode, b, n, k, seed):
    args, steps = random_drafts(b, n, k, seed=seed)
    with use(KernelSettings(backend=mode)):
        got = build_tree(*args, steps)
    want = build_tree_reference(*args, steps)
    for name in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=f"{name} b={b} n={n} k={k}")
    return want


@pytest.mark.parametrize("b,n,k", CASES, ids=[f"B{b}-N{n}-K{k}" for b, n, k in CASES])
def test_interpreted_kernel_matches_reference(b, n, k):
    tree = check("interpret", b, n, k, seed=b * 1000 + n * 10 + k)
    depth = np.asarray(tree.depth)
    if k == 1:
        assert depth.max() == n - 1  # a chain
    elif n >= 17:
        assert depth.max() >= 2  # deep trees, not stars


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,k", CASES, ids=[f"B{b}-N{n}-K{k}" for b, n, k in CASES])
def test_compiled_kernel_matches_reference(b, n, k):
    check("pallas", b, n, k, seed=b * 1000 + n * 10 + k + 7)


def test_lowers_to_triton():
    from jeagle.kernels import build_tree as bt
    from tests.kernels.lowering import lower_for_h100

    args, steps = random_drafts(4, 17, 4, seed=1)
    lower_for_h100(functools.partial(bt._pallas, max_depth=steps, interpret=False), *args)


def test_bad_inputs_are_refused():
    import jax.numpy as jnp

    r, x, s = jnp.zeros(2, jnp.int32), jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match="root must be"):
        build_tree(x, x, x, s, 2)
    with pytest.raises(ValueError, match="node_parents must"):
        build_tree(r, x, x[:, :5], s, 2)
    with pytest.raises(ValueError, match="more than the"):
        build_tree(r, x, x, jnp.zeros((2, 7), jnp.int32), 2)
    with pytest.raises(ValueError, match="integer"):
        build_tree(r, x, x, s.astype(jnp.float32), 2)
