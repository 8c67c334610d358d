"""What the round verifies with besides the kernels' walks: the target's sampling distribution over
the tree (`target_probs`) and the bench-only simulated acceptance (`simulated_accept`).

The walks themselves (greedy and sampling) and their outputs are specified by the kernels' pure-jnp
references: jeagle/kernels/verify_tree_greedy.py and jeagle/kernels/tree_speculative_sampling.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jeagle.kernels.verify_tree_greedy import accept_outputs
from jeagle.parallel.sharding import whole_vocab


def simulated_accept(candidates, retrieve_index, target_predict, num_spec_steps: int, mean_accept: float, seed,
                     seq_len):
    """Timing only (SGLang's SGLANG_SIMULATE_ACC_LEN): accept nodes 0..m in node order, whatever the
    tokens, with m = floor(τ-1) or floor(τ-1) + 1 drawn per request and round (from seed, seq_len) so
    that the mean is τ - 1, capped at min(S, N-1): τ = `mean_accept` tokens per round, bonus included.
    Same outputs as the kernels' verify_tree_greedy_reference; the emitted tokens are NOT the
    target's greedy ones."""
    b, n = candidates.shape
    rows = jnp.arange(b)
    base = int(mean_accept - 1.0)
    frac = (mean_accept - 1.0) - base

    def coin(s, length):
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(jax.random.key(s), length), 0x51A))

    length = jnp.minimum(base + (jax.vmap(coin)(seed, seq_len) < frac), min(num_spec_steps - 1, n - 1))
    j = jnp.arange(num_spec_steps)[None, :]
    path = jnp.where(j <= length[:, None], j, -1).astype(jnp.int32)
    return accept_outputs(path, length, length, candidates, retrieve_index, target_predict[rows, length])


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
    # Whole rows out too: the tree walk's bonus draw (kernels' sample_residual) scans them.
    return whole_vocab(jnp.take_along_axis(p, inv, axis=-1))
