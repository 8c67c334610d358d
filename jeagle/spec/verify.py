"""Tree verification (pure-jnp references; Pallas kernels replace them behind one switch).

Both walks start at the root and go down one depth at a time, trying the current node's children
through `retrieve_next_token` (first child) and `retrieve_next_sibling` (next sibling, ascending
index = most probable first). Outputs, per request:

    accept_index  [B, S+1]  retrieve indices (b·N + node) of the root and the accepted nodes, -1 padded
    accept_length [B]       accepted draft tokens, the bonus excluded
    predict       [B, N]    at each accepted node, the token emitted after it (the accepted child's
                            token, or the bonus at the last one); -1 elsewhere

Greedy: accept the first child whose token equals the target argmax at the current node.
Sampling (lossless for thresholds 1.0): one uniform coin per visited node; walking the children in
order, child x is accepted when coin <= (target mass of the children tried so far, x included) /
threshold_acc, or when p(x) >= threshold_single; a rejected child's target probability moves into the
residual, and the bonus is drawn from relu(p - residual), normalised, by inverse CDF. This is
inverse-CDF sampling from p over the children in order, so each emitted token follows p exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jeagle.sharding import whole_vocab


def _walk(candidates, next_token, next_sibling, num_steps, try_child):
    """Shared walk. try_child(state, node, child) -> (accepted [B] bool, state); returns
    (accepted nodes [B, S+1] node ids -1 padded, accept_length [B], last node [B], state)."""
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


def verify_tree_greedy_reference(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                 target_predict, num_spec_steps: int):
    """candidates/target_predict [B, N] (target argmax at each node); num_spec_steps = S + 1."""
    b, n = candidates.shape
    rows = jnp.arange(b)

    def try_child(state, cur, child, active):
        return candidates[rows, child] == target_predict[rows, cur], state

    path, length, last, _ = _walk(candidates, retrieve_next_token, retrieve_next_sibling, num_spec_steps,
                                  try_child)({})
    return _outputs(path, length, last, candidates, retrieve_index, target_predict[rows, last])


def _outputs(path, length, last, candidates, retrieve_index, bonus):
    b, n = candidates.shape
    rows = jnp.arange(b)
    accept_index = jnp.where(path >= 0, jnp.take_along_axis(retrieve_index, jnp.maximum(path, 0), 1), -1)
    # predict at each accepted node: the next accepted node's token, or the bonus at the last one.
    nxt = jnp.concatenate([path[:, 1:], jnp.full((b, 1), -1, jnp.int32)], 1)
    nxt_tok = jnp.where(nxt >= 0, jnp.take_along_axis(candidates, jnp.maximum(nxt, 0), 1), bonus[:, None])
    predict = jnp.full((b, n), -1, jnp.int32)
    predict = predict.at[rows[:, None], jnp.where(path >= 0, path, n)].set(nxt_tok.astype(jnp.int32), mode="drop")
    return predict, accept_index.astype(jnp.int32), length.astype(jnp.int32), bonus.astype(jnp.int32)


def simulated_accept(candidates, retrieve_index, target_predict, num_spec_steps: int, mean_accept: float, seed,
                     seq_len):
    """Timing only (SGLang's SGLANG_SIMULATE_ACC_LEN): accept nodes 0..m in node order, whatever the
    tokens, with m = floor(τ-1) or floor(τ-1) + 1 drawn per request and round (from seed, seq_len) so
    that the mean is τ - 1, capped at min(S, N-1): τ = `mean_accept` tokens per round, bonus included.
    Same outputs as verify_tree_greedy_reference; the emitted tokens are NOT the target's greedy ones."""
    b, n = candidates.shape
    rows = jnp.arange(b)
    base = int(mean_accept - 1.0)
    frac = (mean_accept - 1.0) - base

    def coin(s, length):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.key(s), length), 0x51A))

    length = jnp.minimum(base + (jax.vmap(coin)(seed, seq_len) < frac), min(num_spec_steps - 1, n - 1))
    j = jnp.arange(num_spec_steps)[None, :]
    path = jnp.where(j <= length[:, None], j, -1).astype(jnp.int32)
    return _outputs(path, length, length, candidates, retrieve_index, target_predict[rows, length])


def tree_sampling_reference(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_probs,
                            coins, final_coin, num_spec_steps: int, threshold_single: float = 1.0,
                            threshold_acc: float = 1.0):
    """target_probs [B, N, V] (temperature/top-k/top-p applied); coins [B, N] uniform per node;
    final_coin [B] for the bonus."""
    b, n = candidates.shape
    v = target_probs.shape[-1]
    rows = jnp.arange(b)

    def try_child(state, cur, child, active):
        tok = candidates[rows, child]
        p = target_probs[rows, cur, tok]
        acc = state["prob_acc"] + jnp.where(active, p, 0.0)
        coin = coins[rows, cur]
        ok = (coin <= acc / threshold_acc) | (p >= threshold_single)
        rejected = active & ~ok
        resid = state["resid"].at[rows, tok].set(jnp.where(rejected, p, state["resid"][rows, tok]))
        taken = active & ok
        # Moving to a new node: fresh accumulator and residual (its coin is coins[child]).
        acc = jnp.where(taken, 0.0, acc)
        resid = jnp.where(taken[:, None], 0.0, resid)
        return ok, {"prob_acc": acc, "resid": resid}

    init = {"prob_acc": jnp.zeros((b,), jnp.float32), "resid": jnp.zeros((b, v), jnp.float32)}
    path, length, last, state = _walk(candidates, retrieve_next_token, retrieve_next_sibling, num_spec_steps,
                                      try_child)(init)
    q = target_probs[rows, last]
    bonus = sample_residual(q, state["resid"], final_coin)
    return _outputs(path, length, last, candidates, retrieve_index, bonus)


def sample_residual(q, resid, coin):
    """Inverse-CDF draw from relu(q - resid) normalised; falls back to q if nothing is left."""
    r = jnp.maximum(q - resid, 0.0)
    total = r.sum(-1, keepdims=True)
    r = whole_vocab(jnp.where(total > 0, r, q))  # whole rows under a tp mesh (the cumsum below)
    cdf = jnp.cumsum(r, -1)
    u = coin[:, None] * cdf[:, -1:]
    tok = jnp.sum(cdf <= u, -1)  # first index whose cdf exceeds u
    # Never land on a zero-probability token at the top edge (u == total).
    last_nonzero = r.shape[-1] - 1 - jnp.argmax(r[:, ::-1] > 0, -1)
    return jnp.minimum(tok, last_nonzero).astype(jnp.int32)


def target_probs(logits, temperature, top_k, top_p):
    """Softmax of [B, N, V] logits after temperature, top-k and top-p (per request [B])."""
    b, n, v = logits.shape
    t = jnp.maximum(temperature, 1e-6)[:, None, None]
    x = whole_vocab(logits / t)  # whole rows under a tp mesh (the sort and cumsum below)
    order = jnp.argsort(-x, axis=-1)
    sx = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(v)
    keep = (top_k[:, None, None] <= 0) | (rank < top_k[:, None, None])
    sx = jnp.where(keep, sx, -jnp.inf)
    p = whole_vocab(jax.nn.softmax(sx, -1))
    before = jnp.cumsum(p, -1) - p
    sx = jnp.where((before < top_p[:, None, None]) | (rank == 0), sx, -jnp.inf)
    p = jax.nn.softmax(sx, -1)
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(p, inv, axis=-1)
