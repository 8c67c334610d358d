"""Choose the drafted nodes that make up the verify tree.

Scored nodes of one round, per request (flat index space, K + (S-1)·K² entries):

    [ step 0: K nodes | step 1: K² nodes | ... | step S-1: K² nodes ]
      parent -1          parent = a node of the previous step's beam

`select_nodes` keeps the N-1 best scores and sorts their indices ascending, so a parent always
precedes its children and siblings appear in draft order (most probable first). The kernel
`jeagle.kernels.build_tree` (or its reference) turns them into the verify tree of N nodes, a
`jeagle.kernels.build_tree.Tree` (node 0 = the root, the previous round's bonus token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def select_nodes(scores: jax.Array, num_draft_tokens: int) -> jax.Array:
    """Indices [B, N-1] of the N-1 best scored nodes, sorted ascending."""
    _, idx = jax.lax.top_k(scores, num_draft_tokens - 1)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)
