"""Build the verify tree from the drafted nodes as a Pallas kernel (Triton lowering), one program per request.

Layers, as in JAX's own Pallas ops: `_kernel` (body), `_pallas` (the pallas_call wrapper), `build_tree`
(public: validates inputs, asks the backend switch) and `build_tree_reference` (pure jnp, the
specification, from jeagle.spec.tree).

Everything stays in registers as vectors of NP = next_power_of_2(N) lanes, lane 0 being the root and
lane i the i-th selected node: the selected nodes' tokens and flat parents are gathered from global
memory, a parent's tree index is found by comparing flat ids (an [NP, NP] compare: `selected` is
sorted, so the first match is the only one), depth and the ancestor mask come from `max_depth`
rounds of pointer jumping done as one-hot [NP, NP] selects, and first child / next sibling are
minimum reductions over the same compares.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import dispatch, int32_inputs
from jeagle.spec.tree import Tree, build_tree_reference

__all__ = ["build_tree", "build_tree_reference"]


def _kernel(root_ref, tok_ref, par_ref, sel_ref, tokens_ref, parent_ref, depth_ref, mask_ref, ridx_ref, next_ref,
            sib_ref, *, n, m, np_, max_depth):
    i = pl.program_id(0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (np_,), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (np_, np_), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (np_, np_), 0)
    node = (lane >= 1) & (lane < n)  # the selected nodes (lane 0: the root; lanes >= n: padding)
    sel = jnp.where(node, sel_ref[i, jnp.clip(lane - 1, 0, n - 2)], -1)
    flat = jnp.clip(sel, 0, m - 1)
    tokens = jnp.where(node, tok_ref[i, flat], jnp.where(lane == 0, root_ref[i], -1))
    flat_parent = jnp.where(node, par_ref[i, flat], -1)

    # Tree index of each node's parent: the lane whose selected flat id equals the flat parent.
    match = (flat_parent[:, None] == sel[None, :]) & (flat_parent[:, None] >= 0) & node[None, :]
    parent_lane = jnp.min(jnp.where(match, col, np_), axis=1)
    parent = jnp.where(node, jnp.where(parent_lane < np_, parent_lane, 0), -1)

    # Ancestors by pointer jumping: up = parent[cur] as a one-hot select.
    mask = row == col
    cur, depth = lane, jnp.zeros((np_,), jnp.int32)
    for _ in range(max_depth):
        up = jnp.max(jnp.where(cur[:, None] == col, parent[None, :], -1), axis=1)
        mask = mask | ((up[:, None] == col) & (up[:, None] >= 0))
        depth = depth + (up >= 0).astype(jnp.int32)
        cur = up

    real = col < n
    is_child = (parent[None, :] == row) & real  # [i, j]: j is a child of i
    first_child = jnp.min(jnp.where(is_child, col, np_), axis=1)
    sibling = (parent[:, None] == parent[None, :]) & (col > row) & (parent[:, None] >= 0) & real
    next_sibling = jnp.min(jnp.where(sibling, col, np_), axis=1)

    tokens_ref[0, :] = tokens
    parent_ref[0, :] = parent
    depth_ref[0, :] = depth
    mask_ref[0, :, :] = mask.astype(jnp.int8)
    ridx_ref[0, :] = i * n + lane
    next_ref[0, :] = jnp.where(first_child < np_, first_child, -1)
    sib_ref[0, :] = jnp.where(next_sibling < np_, next_sibling, -1)


def _pallas(root, node_tokens, node_parents, selected, max_depth: int, *, interpret) -> Tree:
    b, n1 = selected.shape
    n, m = n1 + 1, node_tokens.shape[1]
    np_ = pl.next_power_of_2(n)
    row = pl.BlockSpec((1, np_), lambda i: (i, 0))
    vec = jax.ShapeDtypeStruct((b, np_), jnp.int32)
    outs = pl.pallas_call(
        functools.partial(_kernel, n=n, m=m, np_=np_, max_depth=max_depth),
        grid=(b,),
        in_specs=[pl.no_block_spec] * 4,
        out_specs=[row, row, row, pl.BlockSpec((1, np_, np_), lambda i: (i, 0, 0)), row, row, row],
        out_shape=[vec, vec, vec, jax.ShapeDtypeStruct((b, np_, np_), jnp.int8), vec, vec, vec],
        # One warp holds an [NP, NP] tile up to NP = 16 at 8 elements a thread; more warps only wait.
        compiler_params=plgpu.CompilerParams(num_warps=max(1, min(4, np_ * np_ // 256))),
        interpret=interpret,
        name="build_tree",
    )(root, node_tokens, node_parents, selected)
    tokens, parent, depth, mask, ridx, nxt, sib = (x[:, :n] if np_ > n else x for x in outs)
    return Tree(tokens=tokens, parent=parent, depth=depth, mask=(mask[:, :, :n] if np_ > n else mask) != 0,
                retrieve_index=ridx,
                retrieve_next_token=nxt, retrieve_next_sibling=sib)


def build_tree(root, node_tokens, node_parents, selected, max_depth: int) -> Tree:
    """See jeagle.spec.tree: root [B]; node_tokens/node_parents [B, M] over the flat scored nodes
    (parent -1 = the root); selected [B, N-1] sorted ascending, every selected node's parent selected."""
    if root.ndim != 1:
        raise ValueError(f"root must be [B], got {root.shape}")
    b = root.shape[0]
    if node_tokens.ndim != 2 or node_tokens.shape[0] != b or node_parents.shape != node_tokens.shape:
        raise ValueError(f"node_tokens and node_parents must both be [B={b}, M], got {node_tokens.shape} and "
                         f"{node_parents.shape}")
    if selected.ndim != 2 or selected.shape[0] != b or selected.shape[1] < 1:
        raise ValueError(f"selected must be [B={b}, N-1] with N >= 2, got {selected.shape}")
    if selected.shape[1] > node_tokens.shape[1]:
        raise ValueError(f"selected has {selected.shape[1]} nodes, more than the {node_tokens.shape[1]} drafted")
    args = int32_inputs("tree inputs", root, node_tokens, node_parents, selected)
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    return dispatch(build_tree_reference, _pallas, *args, max_depth=max_depth)
