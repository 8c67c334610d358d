"""Greedy tree verification as a Pallas kernel (Triton lowering), one program per request.

Layers, as in JAX's own Pallas ops: `_kernel` (body), `_pallas` (the pallas_call wrapper with padding
to power-of-two blocks), `verify_tree_greedy` (public, validates inputs, goes through the backend
switch) and `verify_tree_greedy_reference` (pure jnp, the specification).

The tree walks (this one and tree_speculative_sampling's) start at the root and go down one depth at
a time, trying the current node's children through `retrieve_next_token` (first child) and
`retrieve_next_sibling` (next sibling, ascending index = most probable first). Outputs, per request:

    accept_index  [B, S+1]  retrieve indices (b·N + node) of the root and the accepted nodes, -1 padded
    accept_length [B]       accepted draft tokens, the bonus excluded
    predict       [B, N]    at each accepted node, the token emitted after it (the accepted child's
                            token, or the bonus at the last one); -1 elsewhere

Greedy: accept the first child whose token equals the target argmax at the current node. The kernel
runs one request's walk per program: at each depth it follows `retrieve_next_token` to the first
child and `retrieve_next_sibling` along the siblings until a child matches, writing `predict` at every
accepted node, the retrieve indices of the accepted path and its length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jeagle.kernels.backend import dispatch, int32_inputs

__all__ = ["verify_tree_greedy", "verify_tree_greedy_reference", "accept_outputs", "reference_walk"]


def reference_walk(candidates, next_token, next_sibling, num_steps, try_child):
    """The pure-jnp walk both references share. try_child(state, node, child, active) -> (accepted [B]
    bool, state); returns run(state) -> (accepted nodes [B, S+1] node ids -1 padded, accept_length [B],
    last node [B], state)."""
    b, n = candidates.shape
    rows = jnp.arange(b)

    def run(state):
        cur = jnp.zeros((b,), jnp.int32)
        alive = jnp.ones((b,), bool)
        path = jnp.full((b, num_steps), -1, jnp.int32).at[:, 0].set(0)
        length = jnp.zeros((b,), jnp.int32)
        for depth in range(1, num_steps):
            child = jnp.where(alive, next_token[rows, cur], -1)

            def body(_, carry):
                child, found, state = carry
                active = (child >= 0) & ~found
                ok, state = try_child(state, cur, jnp.maximum(child, 0), active)
                found = found | (active & ok)
                child = jnp.where(active & ~ok, next_sibling[rows, jnp.maximum(child, 0)], child)
                return child, found, state

            child, found, state = jax.lax.fori_loop(0, n, body, (child, jnp.zeros((b,), bool), state))
            found = found & alive
            path = path.at[:, depth].set(jnp.where(found, child, -1))
            length = length + found
            cur = jnp.where(found, child, cur)
            alive = found
        return path, length, cur, state

    return run


def accept_outputs(path, length, last, candidates, retrieve_index, bonus):
    """(predict, accept_index, accept_length, bonus) of an accepted path [B, S+1] (node ids, -1 padded)."""
    b, n = candidates.shape
    rows = jnp.arange(b)
    accept_index = jnp.where(path >= 0, jnp.take_along_axis(retrieve_index, jnp.maximum(path, 0), 1), -1)
    # predict at each accepted node: the next accepted node's token, or the bonus at the last one.
    nxt = jnp.concatenate([path[:, 1:], jnp.full((b, 1), -1, jnp.int32)], 1)
    nxt_tok = jnp.where(nxt >= 0, jnp.take_along_axis(candidates, jnp.maximum(nxt, 0), 1), bonus[:, None])
    predict = jnp.full((b, n), -1, jnp.int32)
    predict = predict.at[rows[:, None], jnp.where(path >= 0, path, n)].set(nxt_tok.astype(jnp.int32), mode="drop")
    return predict, accept_index.astype(jnp.int32), length.astype(jnp.int32), bonus.astype(jnp.int32)


def verify_tree_greedy_reference(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                 target_predict, num_spec_steps: int):
    """candidates/target_predict [B, N] (target argmax at each node); num_spec_steps = S + 1."""
    b, n = candidates.shape
    rows = jnp.arange(b)

    def try_child(state, cur, child, active):
        return candidates[rows, child] == target_predict[rows, cur], state

    path, length, last, _ = reference_walk(candidates, retrieve_next_token, retrieve_next_sibling, num_spec_steps,
                                           try_child)({})
    return accept_outputs(path, length, last, candidates, retrieve_index, target_predict[rows, last])


def _kernel(cand_ref, ridx_ref, next_ref, sib_ref, tpred_ref, predict_ref, accidx_ref, acclen_ref, *, num_steps):
    predict_ref[...] = jnp.full(predict_ref.shape, -1, jnp.int32)
    accidx_ref[...] = jnp.full(accidx_ref.shape, -1, jnp.int32)
    accidx_ref[0, 0] = ridx_ref[0, 0]

    def depth(_, carry):
        cur, num, alive = carry
        target = tpred_ref[0, cur]
        first = jnp.where(alive, next_ref[0, cur], -1)

        def walking(c):
            child, found = c
            return (child >= 0) & jnp.logical_not(found)

        def step(c):
            child, _ = c
            hit = cand_ref[0, child] == target
            return jnp.where(hit, child, sib_ref[0, child]), hit

        child, found = jax.lax.while_loop(walking, step, (first, jnp.bool_(False)))

        @pl.when(found)
        def _():
            predict_ref[0, cur] = target
            accidx_ref[0, num + 1] = ridx_ref[0, child]

        return jnp.where(found, child, cur), num + found.astype(jnp.int32), found

    cur, num, _ = jax.lax.fori_loop(1, num_steps, depth, (jnp.int32(0), jnp.int32(0), jnp.bool_(True)))
    predict_ref[0, cur] = tpred_ref[0, cur]  # the bonus
    acclen_ref[0, 0] = num


def _pallas(candidates, retrieve_index, next_token, next_sibling, target_predict, num_spec_steps, *, interpret):
    b, n = candidates.shape
    np_, sp = pl.next_power_of_2(n), pl.next_power_of_2(num_spec_steps)

    def pad(x):
        return jnp.pad(x, ((0, 0), (0, np_ - n)), constant_values=-1)

    row = pl.BlockSpec((1, np_), lambda i: (i, 0))
    predict, accidx, acclen = pl.pallas_call(
        functools.partial(_kernel, num_steps=num_spec_steps),
        grid=(b,),
        in_specs=[row] * 5,
        out_specs=[row, pl.BlockSpec((1, sp), lambda i: (i, 0)), pl.BlockSpec((1, 1), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, np_), jnp.int32), jax.ShapeDtypeStruct((b, sp), jnp.int32),
                   jax.ShapeDtypeStruct((b, 1), jnp.int32)],
        interpret=interpret,
        name="verify_tree_greedy",
    )(pad(candidates), pad(retrieve_index), pad(next_token), pad(next_sibling), pad(target_predict))
    predict, accidx, acclen = predict[:, :n], accidx[:, :num_spec_steps], acclen[:, 0]
    last = jnp.take_along_axis(accidx, acclen[:, None], 1)[:, 0] - jnp.arange(b) * n
    bonus = jnp.take_along_axis(predict, last[:, None], 1)[:, 0]
    return predict, accidx, acclen, bonus


def tree_inputs(candidates, **others):
    """The walk's [B, N] integer rows as int32, after checking that `others` share candidates' shape."""
    shape = candidates.shape
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"candidates must be [B, N], got {shape}")
    for name, x in others.items():
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, candidates {shape}")
    return int32_inputs("tree inputs", candidates, *others.values())


def verify_tree_greedy(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
                       num_spec_steps: int):
    """See verify_tree_greedy_reference: (predict [B,N], accept_index [B,S+1], accept_length [B], bonus [B])."""
    args = tree_inputs(candidates, retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
                       retrieve_next_sibling=retrieve_next_sibling, target_predict=target_predict)
    if num_spec_steps < 1:
        raise ValueError(f"num_spec_steps must be >= 1, got {num_spec_steps}")
    return dispatch(verify_tree_greedy_reference, _pallas, *args, num_spec_steps=num_spec_steps)
