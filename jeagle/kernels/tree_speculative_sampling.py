"""Target-only tree speculative sampling as a Pallas kernel (Triton lowering), one program per request.

Layers, as in JAX's own Pallas ops: `_kernel` (body), `_pallas` (the pallas_call wrapper),
`tree_speculative_sampling` (public: validates inputs, asks the backend switch) and
`tree_speculative_sampling_reference` (pure jnp, the specification; the walk and its outputs are
verify_tree_greedy's).

Sampling (lossless for thresholds 1.0): one uniform coin per visited node; walking the children in
order, child x is accepted when coin <= (target mass of the children tried so far, x included) /
threshold_acc, or when p(x) >= threshold_single; a rejected child's target probability moves into the
residual, and the bonus is drawn from relu(p - residual), normalised, by inverse CDF. This is
inverse-CDF sampling from p over the children in order, so each emitted token follows p exactly.

Per request the kernel walks the tree from the root. At each node it draws nothing new: the node's
coin `coins[cur]` is compared, child after child in sibling order, with the target mass of the
children tried so far (`coin <= mass / threshold_acc`, or `p(child) >= threshold_single`), exactly
the additions and comparisons of the reference, so the walk is bit-exact. The bonus token is an
inverse-CDF draw from the target row of the last node with the rejected children's tokens removed
(the residual relu(q - resid): a rejected child's resid equals its q). That row is read from global
memory in blocks of `block` tokens, twice: once for the total mass and the last non-zero token,
once with a running sum until the block holding `final_coin · total`. The last block overlaps the
previous one instead of reading past V, so the interpreter (which clamps slices) and the compiled
kernel read the same addresses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jeagle.kernels.backend import dispatch
from jeagle.kernels.verify_tree_greedy import accept_outputs, reference_walk, tree_inputs

__all__ = ["tree_speculative_sampling", "tree_speculative_sampling_reference", "sample_residual"]

MAX_BLOCK = 2048


def tree_speculative_sampling_reference(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                                        target_probs, coins, final_coin, num_spec_steps: int,
                                        threshold_single: float = 1.0, threshold_acc: float = 1.0):
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
    path, length, last, state = reference_walk(candidates, retrieve_next_token, retrieve_next_sibling, num_spec_steps,
                                               try_child)(init)
    q = target_probs[rows, last]
    bonus = sample_residual(q, state["resid"], final_coin)
    return accept_outputs(path, length, last, candidates, retrieve_index, bonus)


def sample_residual(q, resid, coin):
    """Inverse-CDF draw from relu(q - resid) normalised; falls back to q if nothing is left. Sorts and
    scans along whole rows: under a tensor-parallel mesh the caller hands in whole vocabulary rows
    (jeagle.speculative.verify.target_probs returns them)."""
    r = jnp.maximum(q - resid, 0.0)
    total = r.sum(-1, keepdims=True)
    r = jnp.where(total > 0, r, q)
    cdf = jnp.cumsum(r, -1)
    u = coin[:, None] * cdf[:, -1:]
    tok = jnp.sum(cdf <= u, -1)  # first index whose cdf exceeds u
    # Never land on a zero-probability token at the top edge (u == total).
    last_nonzero = r.shape[-1] - 1 - jnp.argmax(r[:, ::-1] > 0, -1)
    return jnp.minimum(tok, last_nonzero).astype(jnp.int32)


def _kernel(cand_ref, ridx_ref, next_ref, sib_ref, coins_ref, final_ref, probs_ref,
            predict_ref, accidx_ref, acclen_ref, bonus_ref, *, num_steps, v, block, t_single, t_acc):
    i = pl.program_id(0)
    predict_ref[...] = jnp.full(predict_ref.shape, -1, jnp.int32)
    accidx_ref[...] = jnp.full(accidx_ref.shape, -1, jnp.int32)
    accidx_ref[0, 0] = ridx_ref[0, 0]

    def depth(_, carry):
        cur, num, alive = carry
        coin = coins_ref[0, cur]
        first = jnp.where(alive, next_ref[0, cur], -1)

        def walking(c):
            child, found, _ = c
            return (child >= 0) & jnp.logical_not(found)

        def step(c):
            child, _, mass = c
            p = probs_ref[i, cur, cand_ref[0, child]]
            mass = mass + p
            ok = (coin <= mass / t_acc) | (p >= t_single)
            return jnp.where(ok, child, sib_ref[0, child]), ok, mass

        child, found, _ = jax.lax.while_loop(walking, step, (first, jnp.bool_(False), jnp.float32(0.0)))

        @pl.when(found)
        def _():
            predict_ref[0, cur] = cand_ref[0, child]
            accidx_ref[0, num + 1] = ridx_ref[0, child]

        return jnp.where(found, child, cur), num + found.astype(jnp.int32), found

    cur, num, alive = jax.lax.fori_loop(1, num_steps, depth, (jnp.int32(0), jnp.int32(0), jnp.bool_(True)))
    acclen_ref[0, 0] = num

    # ---- bonus: inverse CDF over the residual of the last node ------------------------------
    # The walk died at `cur` iff some depth found no child: then every child of `cur` was rejected.
    rejected_head = jnp.where(alive, -1, next_ref[0, cur])
    lane = jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
    num_blocks = pl.cdiv(v, block)

    def load(j, use_resid):
        start = jnp.minimum(j * block, v - block)
        idx = start + lane
        q = jnp.where(idx >= j * block, probs_ref[i, cur, pl.ds(start, block)], 0.0)

        def drop(c):
            child, r = c
            return sib_ref[0, child], jnp.where(idx == cand_ref[0, child], 0.0, r)

        head = jnp.where(use_resid, rejected_head, -1)
        _, r = jax.lax.while_loop(lambda c: c[0] >= 0, drop, (head, q))
        return idx, q, r

    # Totals and the search both chain `running + cumsum(block)` and carry its last (largest: the
    # terms are >= 0) element, so the search sees exactly the totals' partial sums and `u < total`
    # always lands inside a block, on a lane with mass.
    def totals(j, c):
        tq, tr, lq, lr = c
        idx, q, r = load(j, jnp.bool_(True))
        return (jnp.max(tq + jnp.cumsum(q)), jnp.max(tr + jnp.cumsum(r)),
                jnp.maximum(lq, jnp.max(jnp.where(q > 0, idx, -1))), jnp.maximum(lr, jnp.max(jnp.where(r > 0, idx, -1))))

    zero = jnp.float32(0.0)
    tq, tr, lq, lr = jax.lax.fori_loop(0, num_blocks, totals, (zero, zero, jnp.int32(-1), jnp.int32(-1)))
    use_resid = tr > 0
    total, last = jnp.where(use_resid, tr, tq), jnp.where(use_resid, lr, lq)
    last = jnp.where(last < 0, v - 1, last)  # no mass at all: the reference's clamp gives V-1
    u = final_ref[0, 0] * total

    def searching(c):
        j, _, tok = c
        return (j < num_blocks) & (tok < 0)

    def search(c):
        j, running, _ = c
        idx, _, r = load(j, use_resid)
        cdf = running + jnp.cumsum(r)
        hit = (cdf > u) & (r > 0) & (idx >= j * block)
        first = jnp.min(jnp.where(hit, idx, v))
        return j + 1, jnp.max(cdf), jnp.where(first < v, first, -1)

    _, _, tok = jax.lax.while_loop(searching, search, (jnp.int32(0), zero, jnp.int32(-1)))
    tok = jnp.where(tok >= 0, jnp.minimum(tok, last), last)
    tok = jnp.where(u != u, 0, tok)  # NaN probabilities: the reference's count of cdf <= u is 0
    predict_ref[0, cur] = tok
    bonus_ref[0, 0] = tok


def _pallas(candidates, retrieve_index, next_token, next_sibling, target_probs, coins, final_coin, num_spec_steps,
            threshold_single=1.0, threshold_acc=1.0, *, interpret):
    b, n = candidates.shape
    v = target_probs.shape[-1]
    np_, sp = pl.next_power_of_2(n), pl.next_power_of_2(num_spec_steps)
    block = min(MAX_BLOCK, 1 << (v.bit_length() - 1))  # a power of two <= V

    def pad(x, value=-1):
        return jnp.pad(x, ((0, 0), (0, np_ - n)), constant_values=value)

    row = pl.BlockSpec((1, np_), lambda i: (i, 0))
    one = pl.BlockSpec((1, 1), lambda i: (i, 0))
    kernel = functools.partial(_kernel, num_steps=num_spec_steps, v=v, block=block, t_single=float(threshold_single),
                               t_acc=float(threshold_acc))
    predict, accidx, acclen, bonus = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[row] * 4 + [row, one, pl.no_block_spec],
        out_specs=[row, pl.BlockSpec((1, sp), lambda i: (i, 0)), one, one],
        out_shape=[jax.ShapeDtypeStruct((b, np_), jnp.int32), jax.ShapeDtypeStruct((b, sp), jnp.int32),
                   jax.ShapeDtypeStruct((b, 1), jnp.int32), jax.ShapeDtypeStruct((b, 1), jnp.int32)],
        interpret=interpret,
        name="tree_speculative_sampling",
    )(pad(candidates), pad(retrieve_index), pad(next_token), pad(next_sibling), pad(coins, 0.0),
      final_coin[:, None], target_probs)
    return predict[:, :n], accidx[:, :num_spec_steps], acclen[:, 0], bonus[:, 0]


def tree_speculative_sampling(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_probs,
                              coins, final_coin, num_spec_steps: int, threshold_single: float = 1.0,
                              threshold_acc: float = 1.0):
    """See tree_speculative_sampling_reference: (predict [B,N], accept_index [B,S+1], accept_length [B],
    bonus [B]).

    target_probs [B, N, V] float32 (temperature, top-k and top-p applied); coins [B, N] and
    final_coin [B] uniform in [0, 1)."""
    tree = tree_inputs(candidates, retrieve_index=retrieve_index, retrieve_next_token=retrieve_next_token,
                       retrieve_next_sibling=retrieve_next_sibling)
    shape = candidates.shape
    if target_probs.ndim != 3 or target_probs.shape[:2] != shape or target_probs.dtype != jnp.float32:
        raise ValueError(f"target_probs must be float32 [B, N, V] = [{shape[0]}, {shape[1]}, V], got "
                         f"{target_probs.dtype}{list(target_probs.shape)}")
    if coins.shape != shape or final_coin.shape != shape[:1]:
        raise ValueError(f"coins must be [B, N] and final_coin [B], got {coins.shape} and {final_coin.shape}")
    if num_spec_steps < 1:
        raise ValueError(f"num_spec_steps must be >= 1, got {num_spec_steps}")
    if not (0 < threshold_acc <= 1 and 0 < threshold_single <= 1):
        raise ValueError(f"thresholds must be in (0, 1], got single={threshold_single} acc={threshold_acc}")
    coins, final_coin = coins.astype(jnp.float32), final_coin.astype(jnp.float32)
    return dispatch(tree_speculative_sampling_reference, _pallas, *tree, target_probs, coins, final_coin,
                    num_spec_steps=num_spec_steps, threshold_single=threshold_single, threshold_acc=threshold_acc)
