"""Commit a round's accepted KV by swapping slots, as a Pallas kernel (Triton lowering), one program per
request. This is the round's counterpart of SGLang's `assign_extend_cache_locs` plus its accepted-slot
bookkeeping: a request owns its slots for life, so nothing is allocated or freed, only swapped.

Layers, as in JAX's own Pallas ops: `_kernel` (body), `_pallas` (the pallas_call wrapper, in place on
`req_to_token` through input/output aliasing), `commit_slots` (public: validates inputs, asks the
backend switch) and `commit_slots_reference` (pure jnp, the specification, moved from the round).

For request b with `commit[b]`, and j = 0..accept_length[b] (the root and the accepted nodes, path[j]
their node ids): the slot at position L+j of its `req_to_token` row and its tree slot of node path[j]
trade places. The accepted KV (target and draft pools alike) becomes the prefix without a copy, and
the old position slot becomes a free tree slot for the next round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import dispatch, int32_inputs

__all__ = ["commit_slots", "commit_slots_reference"]


def commit_slots_reference(req_to_token, tree_slots, row_ids, seq_len, path, accept_length, commit):
    """req_to_token [R, C]; tree_slots [B, N]; row_ids/seq_len/accept_length [B]; path [B, S+1] node ids
    (-1 padded); commit [B] bool. Returns (req_to_token, tree_slots)."""
    b, n = tree_slots.shape
    c = req_to_token.shape[1]
    j = jnp.arange(path.shape[1])[None, :]
    valid = commit[:, None] & (j <= accept_length[:, None])
    pos = seq_len[:, None] + j
    pos_slots = req_to_token[row_ids[:, None], jnp.minimum(pos, c - 1)]
    acc_slots = jnp.take_along_axis(tree_slots, jnp.maximum(path, 0), 1)
    req_to_token = req_to_token.at[row_ids[:, None], jnp.where(valid, pos, c)].set(acc_slots, mode="drop")
    tree_slots = tree_slots.at[jnp.arange(b)[:, None], jnp.where(valid, path, n)].set(pos_slots, mode="drop")
    return req_to_token, tree_slots


def _kernel(rows_ref, len_ref, acc_ref, commit_ref, path_ref, tree_ref, _, rt_out, tree_out, *, c, n, np_, sp):
    i = pl.program_id(0)
    row, length, acc = rows_ref[i], len_ref[i], acc_ref[i]
    j = jax.lax.broadcasted_iota(jnp.int32, (sp,), 0)
    node = jax.lax.broadcasted_iota(jnp.int32, (np_,), 0)
    path = path_ref[0, :]
    valid = (commit_ref[i] != 0) & (j <= acc) & (path >= 0)
    pos = length + j
    # Every load before any store: the position slots are read from the row being rewritten.
    pos_slots = rt_out[row, jnp.clip(pos, 0, c - 1)]
    tree = tree_ref[0, :]
    owned = (path[None, :] == node[:, None]) & valid[None, :]  # [node, j]: node path[j] is accepted
    acc_slots = jnp.sum(jnp.where(path[None, :] == node[:, None], tree[:, None], 0), axis=0)  # tree[path[j]]
    tree_out[0, :] = jnp.where(jnp.max(owned.astype(jnp.int32), axis=1) > 0,
                               jnp.sum(jnp.where(owned, pos_slots[None, :], 0), axis=1), tree)
    # Lanes that write nothing repeat another lane's store (same address, same value) instead of being
    # masked: the interpreter's masked store is a read-modify-write scatter whose duplicates would
    # race. With a commit that is the root's (lane 0: position L, tree slot of node 0); without, the
    # slot already at position L.
    write = valid & (pos < c)
    first = jnp.clip(length, 0, c - 1)
    root_write = jnp.max(jnp.where(j == 0, write.astype(jnp.int32), 0)) > 0
    root_slot = jnp.sum(jnp.where(j == 0, acc_slots, 0))
    dup = jnp.where(root_write, root_slot, rt_out[row, first])
    rt_out[row, jnp.where(write, pos, first)] = jnp.where(write, acc_slots, dup)

def _pallas(req_to_token, tree_slots, row_ids, seq_len, path, accept_length, commit, *, interpret):
    b, n = tree_slots.shape
    s1 = path.shape[1]
    np_, sp = pl.next_power_of_2(n), pl.next_power_of_2(s1)
    tree_p = jnp.pad(tree_slots, ((0, 0), (0, np_ - n)))
    path_p = jnp.pad(path, ((0, 0), (0, sp - s1)), constant_values=-1)
    row = pl.BlockSpec((1, np_), lambda i: (i, 0))
    rt, tree = pl.pallas_call(
        functools.partial(_kernel, c=req_to_token.shape[1], n=n, np_=np_, sp=sp),
        grid=(b,),
        in_specs=[pl.no_block_spec] * 4 + [pl.BlockSpec((1, sp), lambda i: (i, 0)), row, pl.no_block_spec],
        out_specs=[pl.no_block_spec, row],
        out_shape=[jax.ShapeDtypeStruct(req_to_token.shape, jnp.int32), jax.ShapeDtypeStruct((b, np_), jnp.int32)],
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1),  # vectors of N and S+1 lanes: one warp is plenty
        interpret=interpret,
        name="commit_slots",
    )(row_ids, seq_len, accept_length, commit.astype(jnp.int32), path_p, tree_p, req_to_token)
    return rt, tree[:, :n]


def commit_slots(req_to_token, tree_slots, row_ids, seq_len, path, accept_length, commit):
    """See commit_slots_reference."""
    if req_to_token.ndim != 2 or req_to_token.dtype != jnp.int32:
        raise ValueError(f"req_to_token must be int32 [R, C], got {req_to_token.dtype}{list(req_to_token.shape)}")
    if tree_slots.ndim != 2:
        raise ValueError(f"tree_slots must be [B, N], got {tree_slots.shape}")
    b = tree_slots.shape[0]
    for name, x in (("row_ids", row_ids), ("seq_len", seq_len), ("accept_length", accept_length), ("commit", commit)):
        if x.shape != (b,):
            raise ValueError(f"{name} must be [B={b}], got {x.shape}")
    if path.ndim != 2 or path.shape[0] != b:
        raise ValueError(f"path must be [B={b}, S+1], got {path.shape}")
    if commit.dtype != jnp.bool_:
        raise ValueError(f"commit must be bool, got {commit.dtype}")
    args = int32_inputs("slot inputs", req_to_token, tree_slots, row_ids, seq_len, path, accept_length)
    return dispatch(commit_slots_reference, _pallas, *args, commit)
