"""Build the verify tree from the drafted nodes as a Pallas kernel (Triton lowering), one program per request.

Layers, as in JAX's own Pallas ops: `_kernel` (body), `_pallas` (the pallas_call wrapper), `build_tree`
(public: validates inputs, asks the backend switch) and `build_tree_reference` (pure jnp, the
specification).

The input: the scored nodes of one round (jeagle/speculative/tree.py lays them out), `selected` the indices
of the N-1 kept ones sorted ascending, so a parent always precedes its children and siblings appear in
draft order (most probable first). The output, `Tree`, the verify tree of N nodes (node 0 = the root,
the previous round's bonus token):

    tokens      [B, N]      node 0 = the root
    parent      [B, N]      tree index of each node's parent (-1 for the root)
    depth       [B, N]      0 for the root; positions are L + depth
    mask        [B, N, N]   mask[b, i, j]: node j is node i or one of its ancestors
    retrieve_index        [B, N]  b·N + i (flat index of the node in a [B·N] buffer)
    retrieve_next_token   [B, N]  first child of each node, -1 if none
    retrieve_next_sibling [B, N]  next sibling (next higher index with the same parent), -1 if none

Everything stays in registers as vectors of NP = next_power_of_2(N) lanes, lane 0 being the root and
lane i the i-th selected node: the selected nodes' tokens and flat parents are gathered from global
memory, a parent's tree index is found by comparing flat ids (an [NP, NP] compare: `selected` is
sorted, so the first match is the only one), depth and the ancestor mask come from `max_depth`
rounds of pointer jumping done as one-hot [NP, NP] selects, and first child / next sibling are
minimum reductions over the same compares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import dispatch, int32_inputs

__all__ = ["Tree", "build_tree", "build_tree_reference"]


@jax.tree_util.register_dataclass
@dataclass
class Tree:
    tokens: jax.Array  # [B, N] int32, node 0 = root
    parent: jax.Array  # [B, N] int32
    depth: jax.Array  # [B, N] int32
    mask: jax.Array  # [B, N, N] bool
    retrieve_index: jax.Array  # [B, N] int32
    retrieve_next_token: jax.Array  # [B, N] int32
    retrieve_next_sibling: jax.Array  # [B, N] int32


def build_tree_reference(root: jax.Array, node_tokens: jax.Array, node_parents: jax.Array, selected: jax.Array,
                         max_depth: int) -> Tree:
    """root [B]; node_tokens/node_parents [B, M] over the flat scored nodes (parent -1 = the root);
    selected [B, N-1] sorted ascending. Every selected node's parent must be selected too (it is:
    scores are probability products, so a parent scores at least as high as its child)."""
    b, n1 = selected.shape
    n = n1 + 1
    tokens = jnp.concatenate([root[:, None], jnp.take_along_axis(node_tokens, selected, axis=1)], axis=1)
    flat_parent = jnp.take_along_axis(node_parents, selected, axis=1)  # [B, N-1] flat ids or -1
    # Tree index of the parent: its position in `selected` plus one (0 = root).
    match = flat_parent[:, :, None] == selected[:, None, :]  # [B, N-1, N-1]
    parent_pos = jnp.where(jnp.any(match, -1), jnp.argmax(match, -1) + 1, 0)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent_pos.astype(jnp.int32)], axis=1)

    # Ancestor-or-self mask and depth by pointer jumping, max_depth times.
    idx = jnp.arange(n)
    mask = jnp.broadcast_to(idx[None, :, None] == idx[None, None, :], (b, n, n))
    cur = jnp.broadcast_to(idx, (b, n))
    depth = jnp.zeros((b, n), jnp.int32)
    for _ in range(max_depth):
        up = jnp.take_along_axis(parent, jnp.maximum(cur, 0), axis=1)
        up = jnp.where(cur >= 0, up, -1)
        mask = mask | ((up[:, :, None] == idx[None, None, :]) & (up[:, :, None] >= 0))
        depth = depth + (up >= 0)
        cur = up

    # First child and next sibling, in ascending node index.
    later = idx[None, :] > idx[:, None]  # [N, N] j > i
    is_child = parent[:, None, :] == idx[None, :, None]  # [B, i, j]: j is a child of i
    first_child = jnp.where(jnp.any(is_child, -1), jnp.argmax(is_child, -1), -1)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & later[None] & (parent[:, :, None] >= 0)
    next_sibling = jnp.where(jnp.any(same_parent, -1), jnp.argmax(same_parent, -1), -1)
    retrieve_index = (jnp.arange(b)[:, None] * n + idx[None, :]).astype(jnp.int32)
    return Tree(tokens=tokens.astype(jnp.int32), parent=parent, depth=depth, mask=mask, retrieve_index=retrieve_index,
                retrieve_next_token=first_child.astype(jnp.int32), retrieve_next_sibling=next_sibling.astype(jnp.int32))


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
    """See build_tree_reference: root [B]; node_tokens/node_parents [B, M] over the flat scored nodes
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
