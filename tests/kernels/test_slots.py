"""The slot kernels (assign_req_to_token_pool, commit_slots): interpreted on CPU and compiled with
-m gpu, bit-exact with their pure-jnp references on random batches: rows of different lengths,
padding rows, requests that commit and requests that do not."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.kernels.assign_req_to_token_pool import assign_req_to_token_pool, assign_req_to_token_pool_reference
from jeagle.kernels.commit_slots import commit_slots, commit_slots_reference
from jeagle.kernels.settings import KernelSettings, use
from tests.kernels.trees import assign_inputs, commit_inputs

SIZES = [1, 3, 64]


def check_assign(mode, b, seed):
    args = assign_inputs(b, seed)
    with use(KernelSettings(backend=mode)):
        got = assign_req_to_token_pool(*args)
    want = assign_req_to_token_pool_reference(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int((want != args[0]).sum()) > 0 or b == 1


def check_commit(mode, b, n, seed):
    args = commit_inputs(b, n, seed)
    with use(KernelSettings(backend=mode)):
        got = commit_slots(*args)
    want = commit_slots_reference(*args)
    for name, x, y in zip(("req_to_token", "tree_slots"), got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{name} b={b} n={n}")
    return args, want


@pytest.mark.parametrize("b", SIZES)
def test_assign_interpreted_matches_reference(b):
    check_assign("interpret", b, seed=b)


@pytest.mark.parametrize("b,n", [(b, n) for b in SIZES for n in (2, 4, 8, 17, 64)])
def test_commit_interpreted_matches_reference(b, n):
    (rt, tree, rows, seq_len, path, acc, commit), (new_rt, new_tree) = check_commit("interpret", b, n,
                                                                                     seed=b * 100 + n)
    # A swap: the multiset of slots a request owns is unchanged.
    for i in range(b):
        r = int(rows[i])
        before = sorted(np.asarray(rt[r]).tolist() + np.asarray(tree[i]).tolist())
        after = sorted(np.asarray(new_rt[r]).tolist() + np.asarray(new_tree[i]).tolist())
        assert before == after


@pytest.mark.gpu
@pytest.mark.parametrize("b", SIZES)
def test_assign_compiled_matches_reference(b):
    check_assign("pallas", b, seed=b + 7)


@pytest.mark.gpu
@pytest.mark.parametrize("b,n", [(b, n) for b in SIZES for n in (2, 4, 8, 17, 64)])
def test_commit_compiled_matches_reference(b, n):
    check_commit("pallas", b, n, seed=b * 100 + n + 7)


def test_lower_to_triton():
    from jeagle.kernels import assign_req_to_token_pool as a, commit_slots as c
    from tests.kernels.lowering import lower_for_h100

    lower_for_h100(functools.partial(a._pallas, interpret=False), *assign_inputs(3, 0))
    lower_for_h100(functools.partial(c._pallas, interpret=False), *commit_inputs(3, 17, 0))


def test_bad_inputs_are_refused():
    x = jnp.zeros((4, 8), jnp.int32)
    v = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="req_to_token must be"):
        assign_req_to_token_pool(x.astype(jnp.float32), v, v, v, v)
    with pytest.raises(ValueError, match="start and end"):
        assign_req_to_token_pool(x, v, v[:1], v, v)
    with pytest.raises(ValueError, match="commit must be bool"):
        commit_slots(x, jnp.zeros((2, 4), jnp.int32), v, v, jnp.zeros((2, 3), jnp.int32), v, v)
    with pytest.raises(ValueError, match="seq_len must be"):
        commit_slots(x, jnp.zeros((2, 4), jnp.int32), v, v[:1], jnp.zeros((2, 3), jnp.int32), v, v > 0)
