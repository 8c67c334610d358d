"""Organize the drafted nodes into the verify tree (pure-jnp references; Pallas kernels replace them).

Scored nodes of one round, per request (flat index space, K + (S-1)·K² entries):

    [ step 0: K nodes | step 1: K² nodes | ... | step S-1: K² nodes ]
      parent -1          parent = a node of the previous step's beam

`select_nodes` keeps the N-1 best scores and sorts their indices ascending, so a parent always
precedes its children and siblings appear in draft order (most probable first). `build_tree` turns
them into the verify tree of N nodes (node 0 = the root, the previous round's bonus token):

    parent      [B, N]      tree index of each node's parent (-1 for the root)
    depth       [B, N]      0 for the root; positions are L + depth
    mask        [B, N, N]   mask[b, i, j]: node j is node i or one of its ancestors
    retrieve_index        [B, N]  b·N + i (flat index of the node in a [B·N] buffer)
    retrieve_next_token   [B, N]  first child of each node, -1 if none
    retrieve_next_sibling [B, N]  next sibling (next higher index with the same parent), -1 if none
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


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


def select_nodes(scores: jax.Array, num_draft_tokens: int) -> jax.Array:
    """Indices [B, N-1] of the N-1 best scored nodes, sorted ascending."""
    _, idx = jax.lax.top_k(scores, num_draft_tokens - 1)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


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
