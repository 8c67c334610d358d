"""Random valid verify trees for kernel tests: parents precede children, at most K children per
node (K = 1: a chain), requests with different real sizes (the rest -1 padded), and target
predictions that often match a child so walks go deep."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jeagle.spec.tree import build_tree_reference


def random_trees(b: int, n: int, k: int, seed: int = 0, vocab: int = 12):
    rng = np.random.default_rng(seed)
    parents = np.full((b, n), -1, np.int64)
    tokens = rng.integers(0, vocab, (b, n))
    real = rng.integers(1, n + 1, b)
    real[0] = n  # at least one full-size request
    for r in range(b):
        children = np.zeros(n, int)
        for t in range(1, n):
            options = [p for p in range(t) if children[p] < k] if k > 1 else [t - 1]
            p = int(rng.choice(options))
            parents[r, t] = p
            children[p] += 1
    depth = np.zeros((b, n), int)
    for t in range(1, n):
        depth[:, t] = depth[np.arange(b), parents[:, t]] + 1
    tree = build_tree_reference(jnp.asarray(tokens[:, 0], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32),
                                jnp.asarray(np.maximum(parents[:, 1:] - 1, -1), jnp.int32),
                                jnp.broadcast_to(jnp.arange(n - 1, dtype=jnp.int32), (b, n - 1)), max_depth=n)
    nxt, sib = np.asarray(tree.retrieve_next_token).copy(), np.asarray(tree.retrieve_next_sibling).copy()
    cand = np.asarray(tree.tokens).copy()
    for r in range(b):  # nodes past a request's real size are padding
        nxt[r][nxt[r] >= real[r]] = -1
        sib[r][sib[r] >= real[r]] = -1
        nxt[r, real[r]:] = sib[r, real[r]:] = cand[r, real[r]:] = -1
    predict = rng.integers(0, vocab, (b, n))
    for r in range(b):
        for t in range(n):
            kids = [c for c in range(real[r]) if parents[r, c] == t]
            if kids and rng.random() < 0.75:
                predict[r, t] = cand[r, int(rng.choice(kids))]
    steps = int(depth.max()) + 1
    as_j = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (as_j(cand), tree.retrieve_index, as_j(nxt), as_j(sib), as_j(predict)), steps
