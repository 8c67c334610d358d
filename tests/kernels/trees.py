"""Random valid verify trees for kernel tests: parents precede children, at most K children per
node (K = 1: a chain), requests with different real sizes (the rest -1 padded), and target
predictions that often match a child so walks go deep."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jeagle.kernels.build_tree import build_tree_reference
from jeagle.kernels.verify_tree_greedy import verify_tree_greedy_reference


def _i32(x):
    return jnp.asarray(x, jnp.int32)


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
    return (_i32(cand), tree.retrieve_index, _i32(nxt), _i32(sib), _i32(predict)), steps


def random_sampling_inputs(b: int, n: int, k: int, v: int, seed: int = 0):
    """Tree walk inputs plus target probabilities [B, N, V] (about half the tokens zeroed, as top-k /
    top-p leave them; the tree's own tokens get most of the mass so walks go deep; a few rows put all
    their mass on one child, so a rejection leaves an empty residual) and coins."""
    (cand, ridx, nxt, sib, _), steps = random_trees(b, n, k, seed=seed, vocab=min(v, 12))
    rng = np.random.default_rng(seed + 1)
    logits = rng.normal(size=(b, n, v)) * 2
    logits[rng.random((b, n, v)) < 0.5] = -np.inf
    c = np.asarray(cand)
    for r in range(b):
        for t in range(n):
            if rng.random() < 0.7:
                toks = c[r][c[r] >= 0]  # the tree's tokens: some are this node's children
                logits[r, t, toks] = np.abs(rng.normal(size=toks.size)) * 2 + 3.0
            if rng.random() < 0.1:
                logits[r, t] = -np.inf
                logits[r, t, rng.integers(0, min(v, 12))] = 0.0
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    coins = rng.random((b, n), np.float32)
    final = rng.random((b,), np.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return (cand, ridx, nxt, sib, f32(probs), f32(coins), f32(final)), steps


def random_drafts(b: int, n: int, k: int, seed: int = 0, vocab: int = 1000):
    """What the draft phase hands build_tree: S steps of top-K beam expansion with random draft
    probabilities (flat nodes [B, K + (S-1)K²], parents as flat ids, -1 = the root), S the fewest
    steps that yield N-1 nodes (K = 1: a chain of N-1), and the N-1 best nodes selected."""
    from jeagle.speculative.tree import select_nodes

    s = n - 1 if k == 1 else max(1, -(-(n - 1 - k) // (k * k)) + 1)
    rng = np.random.default_rng(seed)

    def probs(*shape):
        p = rng.dirichlet(np.ones(k + 2), size=shape)[..., :k]  # top-K of a distribution: sums below 1
        return -np.sort(-p, axis=-1)

    scores, tokens, parents = [probs(b)], [rng.integers(0, vocab, (b, k))], [np.full((b, k), -1)]
    beam_scores, beam_flat = scores[0], np.broadcast_to(np.arange(k), (b, k))
    for i in range(1, s):
        expand = (beam_scores[:, :, None] * probs(b, k)).reshape(b, k * k)
        cs = np.argsort(-expand, axis=1, kind="stable")[:, :k]
        scores.append(expand)
        tokens.append(rng.integers(0, vocab, (b, k * k)))
        parents.append(np.repeat(beam_flat, k, axis=1))
        beam_scores = np.take_along_axis(expand, cs, 1)
        beam_flat = k + (i - 1) * k * k + cs
    selected = select_nodes(jnp.asarray(np.concatenate(scores, 1), jnp.float32), n)
    root = jnp.asarray(rng.integers(0, vocab, b), jnp.int32)
    return (root, _i32(np.concatenate(tokens, 1)), _i32(np.concatenate(parents, 1)), selected), s


def assign_inputs(b, seed, c=700):
    """assign_req_to_token_pool inputs: distinct rows, random [start, end) spans (some empty), padding
    rows on the scratch row, a flat slot list with slack at the end."""
    rng = np.random.default_rng(seed)
    rt = rng.integers(0, 1000, (b + 2, c))
    rows = rng.permutation(b + 1)[:b]  # distinct rows
    start = rng.integers(0, c, b)
    end = np.minimum(start + rng.integers(0, 600, b), c)
    empty = rng.random(b) < 0.2  # rows with nothing to write
    end[empty] = start[empty]
    pad = rng.random(b) < 0.2  # padding rows: the scratch row, nothing to write
    rows[pad], start[pad], end[pad] = b + 1, 0, 0
    total = int((end - start).sum())
    loc = rng.integers(1, 10**6, max(total, 1) + int(rng.integers(0, 40)))
    return _i32(rt), _i32(rows), _i32(start), _i32(end), _i32(loc)


def commit_inputs(b, n, seed, s1=6, c=300):
    """commit_slots inputs: accepted paths from a greedy walk over random trees, distinct rows, random
    prefix lengths, about one request in five not committing."""
    (cand, ridx, nxt, sib, pred), steps = random_trees(b, n, 4 if n > 4 else 2, seed=seed)
    _, accept_index, acc, _ = verify_tree_greedy_reference(cand, ridx, nxt, sib, pred, min(steps, s1))
    path = jnp.where(accept_index >= 0, accept_index % n, -1)
    rng = np.random.default_rng(seed)
    rows = rng.permutation(b + 1)[:b]
    seq_len = rng.integers(1, c - s1, b)
    commit = rng.random(b) < 0.8
    rt = rng.integers(1, 10**6, (b + 2, c))
    tree = rng.integers(1, 10**6, (b, n))
    return _i32(rt), _i32(tree), _i32(rows), _i32(seq_len), path, acc, jnp.asarray(commit)
