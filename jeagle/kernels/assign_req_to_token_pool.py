"""Write newly allocated KV slots into `req_to_token` rows as a Pallas kernel (Triton lowering), one
program per request (SGLang's `assign_req_to_token_pool`).

Layers, as in JAX's own Pallas ops: `_kernel` (body), `_pallas` (the pallas_call wrapper, in place on
`req_to_token` through input/output aliasing), `assign_req_to_token_pool` (public: validates inputs,
asks the backend switch) and `assign_req_to_token_pool_reference` (pure jnp, the specification).

Request b owns `out_cache_loc[offset_b : offset_b + end_b - start_b]`, offset_b being the sum of the
earlier requests' lengths (computed inside the kernel from `start`/`end`, so the host uploads one
flat slot list and no offsets), and writes it to `req_to_token[row_ids[b], start_b:end_b]` in blocks.
Requests with `start == end` (padding rows) write nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jeagle.kernels.backend import dispatch, int32_inputs

__all__ = ["assign_req_to_token_pool", "assign_req_to_token_pool_reference"]

BLOCK = 256


def assign_req_to_token_pool_reference(req_to_token, row_ids, start, end, out_cache_loc):
    """req_to_token [R, C]; row_ids/start/end [B]; out_cache_loc [T] >= sum(end - start)."""
    c = req_to_token.shape[1]
    length = end - start
    offset = jnp.cumsum(length) - length
    col = jnp.arange(c)[None, :]
    src = offset[:, None] + col - start[:, None]
    take = (col >= start[:, None]) & (col < end[:, None])
    vals = out_cache_loc[jnp.clip(src, 0, out_cache_loc.shape[0] - 1)]
    rows = jnp.where(take, row_ids[:, None], req_to_token.shape[0])  # out of range → dropped
    return req_to_token.at[rows, jnp.broadcast_to(col, rows.shape)].set(vals, mode="drop")


def _kernel(rows_ref, start_ref, end_ref, loc_ref, _, out_ref, *, b, bp, t, c):
    i = pl.program_id(0)
    lane_b = jax.lax.broadcasted_iota(jnp.int32, (bp,), 0)
    earlier = lane_b < i
    lengths = end_ref[jnp.minimum(lane_b, b - 1)] - start_ref[jnp.minimum(lane_b, b - 1)]
    offset = jnp.sum(jnp.where(earlier, lengths, 0))
    row, start = rows_ref[i], start_ref[i]
    length = end_ref[i] - start
    lane = jax.lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)

    def body(j, written):
        # Lanes past the end repeat the last element (same address, same value) instead of being
        # masked: the interpreter's masked store is a read-modify-write scatter whose duplicate
        # addresses would race.
        k = jnp.minimum(j * BLOCK + lane, length - 1)
        out_ref[row, jnp.clip(start + k, 0, c - 1)] = loc_ref[jnp.clip(offset + k, 0, t - 1)]
        return written + 1

    jax.lax.fori_loop(0, pl.cdiv(length, BLOCK), body, jnp.int32(0))


def _pallas(req_to_token, row_ids, start, end, out_cache_loc, *, interpret):
    b = row_ids.shape[0]
    return pl.pallas_call(
        functools.partial(_kernel, b=b, bp=pl.next_power_of_2(b), t=out_cache_loc.shape[0], c=req_to_token.shape[1]),
        grid=(b,),
        in_specs=[pl.no_block_spec] * 5,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct(req_to_token.shape, jnp.int32),
        input_output_aliases={4: 0},
        interpret=interpret,
        name="assign_req_to_token_pool",
    )(row_ids, start, end, out_cache_loc, req_to_token)


def assign_req_to_token_pool(req_to_token, row_ids, start, end, out_cache_loc):
    """req_to_token with rows `row_ids` [B] written at [start, end) from the flat `out_cache_loc`."""
    if req_to_token.ndim != 2 or req_to_token.dtype != jnp.int32:
        raise ValueError(f"req_to_token must be int32 [R, C], got {req_to_token.dtype}{list(req_to_token.shape)}")
    if row_ids.ndim != 1 or start.shape != row_ids.shape or end.shape != row_ids.shape:
        raise ValueError(f"row_ids, start and end must be [B], got {row_ids.shape}, {start.shape}, {end.shape}")
    if out_cache_loc.ndim != 1 or out_cache_loc.shape[0] < 1:
        raise ValueError(f"out_cache_loc must be a non-empty [T], got {out_cache_loc.shape}")
    args = int32_inputs("slot inputs", req_to_token, row_ids, start, end, out_cache_loc)
    return dispatch(assign_req_to_token_pool_reference, _pallas, *args)
