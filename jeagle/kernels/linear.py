"""Skinny matmuls: a few rows of activations times one layer of a stacked weight, read in place.

`linear(x, w, layer)` = `x @ w[layer]` for x [M, K] and w [L, K, N] (or [K, N]), accumulated in fp32
and returned in x's dtype (or `out_dtype`), for the small M of decode steps, speculative rounds and
draft steps. `transposed=True` takes w as [N, K] (an output head's [vocabulary, hidden] layout) and
returns x @ w.T: the draft head's logits at the few rows of a draft step (XLA's small-M kernels read
the 9.4 MB of SmolLM2's draft head at ~0.25-0.6 TB/s: bench/HISTORY.md, 2026-11-26).

Why a kernel: XLA compiles these badly inside the layer loop (bench/HISTORY.md, 2026-11-26). At
M = 1 it rewrites the dot into a multiply and a reduction; when the vector comes from a fusion it
judges expensive to repeat (the RMSNorm before q|k|v, the SwiGLU before the down projection, the
attention merge before the output projection) it writes the whole [K, N] product to memory first and
reduces it in a second kernel: three times the weight's bytes and two ops, ~21 us of a SmolLM2 layer's
~36 us. At M = 8..16 the dot goes to a GEMM library whose operand is the loop's dynamic slice of the
stacked weight, which XLA copies out first (~7 us a layer at batch 16), or to cuBLAS's small-M
kernels (~3.8 us each for 1.1 MB). This kernel reads layer `layer` of the stacked weight through
pointer arithmetic (as `paged_attention` reads the pools), one program per column block (and prefix
of K, `splits`), with the rows padded to Triton's 16-row tile.

Semantics (the reference is the specification): `(x @ w[layer])` with fp32 accumulation, cast to x's
dtype. Not bit-identical to XLA's own dot in bf16 (a different summation order), as two GEMM
libraries are not; greedy losslessness compares speculative with target-only decoding, which both use
it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jeagle.kernels.backend import backend
from jeagle.kernels.settings import KernelSettings, current

__all__ = ["linear", "linear_invariant", "linear_reference", "linear_serves", "linear_tiles", "MAX_ROWS", "ROW_TILE"]

# Rows (M) up to which `linear_serves` by default (`KernelSettings.linear_max_rows`, JEAGLE_LINEAR_MAX_ROWS);
# beyond, XLA's GEMMs, which measured faster from ~128 rows in device time (verifies of 144 and 432 rows
# through this kernel, in row tiles: a batch-48 round 2.81 vs 2.40 ms busy; bench/HISTORY.md, 2026-11-26).
MAX_ROWS = KernelSettings.linear_max_rows
# Weights (K x N elements) up to which `linear_serves`; beyond, XLA's dot. SmolLM2's layer matmuls (<= 1.8 M
# elements) and its draft head's logits (4.7 M) run faster through the kernel; the Llama-3.1-8B shape's
# (16.8-117 M) run at 1.0-2.0 TB/s through it, where XLA's dot reads them at ~2.6 (8B target-only at
# batch 1: 135.5 vs 173.8 tok/s on the H100, bench/HISTORY.md, 2026-11-26). Between 4.7 and 16.8 M it is
# unmeasured; 8 M is the cut.
MAX_WEIGHT = 8 * 1024 * 1024
BLOCK_N = 32  # columns per program; 16-wide blocks measured slower (1.011 vs 0.990 ms a batch-1 step)
TARGET_PROGRAMS = 132  # K is split until column blocks x splits reach about one program per H100 SM
MAX_SPLITS = 8
# `linear_invariant`'s rows per program, whatever M is: every row of every call goes through the same
# [ROW_TILE, BK] x [BK, BN] products (one row tile at a decode step's B rows, two at a batch-16 verify's 128),
# so a row's result cannot depend on how many rows share the call (a tile of another height may lower to
# another MMA instruction). 64: Hopper's warpgroup MMA height.
ROW_TILE = 64


def linear_reference(x, w, layer=None, *, transposed=False, out_dtype=None):
    """x [M, K] @ (w[layer] if w is [L, K, N] else w [K, N]), fp32 accumulation, in `out_dtype` (default
    x's dtype); `transposed`: w is [L, N, K] or [N, K] and the product is x @ w.T."""
    wl = w if w.ndim == 2 else w[layer]
    if transposed:
        out = jnp.einsum("mk,nk->mn", x, wl.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        out = jnp.dot(x, wl, preferred_element_type=jnp.float32)
    return out.astype(out_dtype or x.dtype)


def _largest_pow2_divisor(n: int, lo: int, hi: int) -> int | None:
    b = hi
    while b >= lo:
        if n % b == 0:
            return b
        b //= 2
    return None


def linear_tiles(m: int, k: int, n: int, max_rows: int | None = None) -> tuple[int, int, int, int] | None:
    """(rows padded, K block, N block, K splits) for an [m, k] x [k, n] product, or None when the kernel
    does not take it (m over `max_rows`, default the current settings' `linear_max_rows`; a weight over
    MAX_WEIGHT elements, or k / n not multiples of 16,
    Triton's smallest dot). A vector form for one row (products summed over K instead of a 16-row dot)
    measured slower (1.154 vs 0.990 ms a batch-1 step; bench/HISTORY.md, 2026-11-26): one row is padded to 16 like any
    other count."""
    if m < 1 or m > (max_rows or current().linear_max_rows) or k * n > MAX_WEIGHT:
        return None
    bk = _largest_pow2_divisor(k, 16, 128)
    if bk is None or n % 16:
        return None
    bn = _largest_pow2_divisor(n, 16, BLOCK_N)
    splits = max(1, min(k // bk, MAX_SPLITS, TARGET_PROGRAMS // (n // bn)))
    return max(16, pl.next_power_of_2(m)), bk, bn, splits


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, bk, bn, blocks, splits, transposed):
    j = pl.program_id(0)
    layer = layer_ref[0]
    col = pl.multiple_of(j * bn, bn)
    if splits == 1:
        first, last = 0, blocks
    else:
        run = -(-blocks // splits)
        first = jnp.minimum(pl.program_id(1) * run, blocks)
        last = jnp.minimum(first + run, blocks)

    def body(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        xb = x_ref[:, pl.ds(k0, bk)]  # [Mp, BK]
        if transposed:  # [BN, BK] rows of a [N, K] weight
            wb = w_ref[layer, pl.ds(col, bn), pl.ds(k0, bk)].astype(xb.dtype)
            return acc + jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        wb = w_ref[layer, pl.ds(k0, bk), pl.ds(col, bn)]  # [BK, BN] of this layer, read in place
        return acc + jax.lax.dot_general(xb, wb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    zero = jnp.zeros((x_ref.shape[0], bn), jnp.float32) + (layer * 0).astype(jnp.float32)  # a typed loop carry
    acc = jax.lax.fori_loop(first, last, body, zero)
    if splits == 1:
        o_ref[:, :] = acc.astype(o_ref.dtype)
    else:
        o_ref[0, :, :] = acc


def _pallas(x, w, layer, tiles, *, transposed, out_dtype, interpret, row_tiles=None):
    """The kernel. row_tiles None: every row in one program's tile of `tiles[0]` rows, the K splits summed by
    XLA. A count (`linear_invariant`): a grid axis over that many tiles of `tiles[0]` rows, each program one
    tile, and the splits added in split order."""
    invariant = row_tiles is not None
    row_tiles = row_tiles or 1
    m, k = x.shape
    n = w.shape[-2] if transposed else w.shape[-1]
    mp, bk, bn, splits = tiles
    w3 = w if w.ndim == 3 else w[None]
    xp = jnp.pad(x, ((0, mp * row_tiles - m), (0, 0)))
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    kernel = functools.partial(_kernel, bk=bk, bn=bn, blocks=k // bk, splits=splits, transposed=transposed)
    x_spec = pl.no_block_spec
    if not invariant and splits == 1:
        grid = (n // bn,)
        out_specs = pl.BlockSpec((mp, bn), lambda j: (0, j))
    elif not invariant:
        grid = (n // bn, splits)
        out_specs = pl.BlockSpec((1, mp, bn), lambda j, s: (s, 0, j))
    else:  # the split axis stays second (the kernel's program_id(1)); row tiles last
        grid = (n // bn, splits, row_tiles)
        x_spec = pl.BlockSpec((mp, k), lambda j, s, r: (r, 0))
        out_specs = (pl.BlockSpec((mp, bn), lambda j, s, r: (r, j)) if splits == 1
                     else pl.BlockSpec((1, mp, bn), lambda j, s, r: (s, r, j)))
    rows = mp * row_tiles
    out_shape = (jax.ShapeDtypeStruct((rows, n), out_dtype) if splits == 1
                 else jax.ShapeDtypeStruct((splits, rows, n), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.no_block_spec, x_spec, pl.no_block_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="linear",
    )(layer_arr, xp, w3)
    if splits > 1 and invariant:
        # The splits added in split order, one add at a time: a reduction over them may pair them in an
        # order that depends on the array's other dimensions (its rows).
        total = out[0]
        for part in range(1, splits):
            total = total + out[part]
        out = total.astype(out_dtype)
    elif splits > 1:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    return out[:m]


def linear_serves(m: int, k: int, n: int) -> bool:
    """Whether `linear` runs the kernel (pallas or interpret) for an [m, k] x [k, n] product."""
    return backend() != "reference" and linear_tiles(m, k, n) is not None


def _operands(x, w, layer, transposed, out_dtype):
    """(M, K, N, out dtype) of `linear`'s operands, after refusing mismatched ones (ValueError)."""
    kdim = -1 if transposed else -2
    if x.ndim != 2 or w.ndim not in (2, 3) or w.shape[kdim] != x.shape[1]:
        want = "[L, N, K] or [N, K]" if transposed else "[L, K, N] or [K, N]"
        raise ValueError(f"x must be [M, K] and w {want} with the same K, got {x.shape}, {w.shape}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError("a stacked weight [L, K, N] needs its layer, a [K, N] one none")
    (m, k), n = x.shape, w.shape[-2] if transposed else w.shape[-1]
    return m, k, n, jnp.dtype(out_dtype or x.dtype)


def linear(x, w, layer=None, *, tiles=None, transposed=False, out_dtype=None):
    """x [M, K] times layer `layer` of w [L, K, N] (or w [K, N], layer None): the kernel where
    `linear_serves`, else the reference. Returns [M, N] in `out_dtype` (default x's dtype).
    `transposed`: w is [L, N, K] or [N, K] (an output head) and the product x @ w.T. `tiles` (rows
    padded, K block, N block, K splits) replaces `linear_tiles`' choice: for measuring
    (bench/probes/linear.py)."""
    m, k, n, out_dtype = _operands(x, w, layer, transposed, out_dtype)
    if tiles is not None:
        mp, bk, bn, splits = tiles
        if mp < m or mp < 16 or mp & (mp - 1) or k % bk or n % bn or not 1 <= splits <= k // bk:
            raise ValueError(f"tiles {tiles} do not fit [{m}, {k}] x [{k}, {n}]: rows padded to a power of two "
                             ">= 16 and >= M, K and N multiples of their blocks, 1 <= splits <= K blocks")
    if not linear_serves(m, k, n):
        return linear_reference(x, w, layer, transposed=transposed, out_dtype=out_dtype)
    return _pallas(x, w, 0 if layer is None else layer, tiles or linear_tiles(m, k, n), transposed=transposed,
                   out_dtype=out_dtype, interpret=backend() == "interpret")


def invariant_tiles(k: int, n: int) -> tuple[int, int, int, int] | None:
    """`linear_invariant`'s (row tile, K block, N block, K splits) for [*, k] x [k, n]: functions of k and n
    only, never of the rows; None when k or n is not a multiple of 16 (Triton's smallest dot)."""
    bk = _largest_pow2_divisor(k, 16, 128)
    if bk is None or n % 16:
        return None
    bn = _largest_pow2_divisor(n, 16, BLOCK_N)
    return ROW_TILE, bk, bn, max(1, min(k // bk, MAX_SPLITS, TARGET_PROGRAMS // (n // bn)))


def linear_invariant(x, w, layer=None, *, transposed=False, out_dtype=None):
    """`linear` whose every row is computed the same way whatever M is (deterministic mode's products): rows in
    tiles of ROW_TILE, one program per (column block, K split, row tile), the splits added in a fixed order.
    Any M and any weight size (no `linear_serves` limits: those pick the faster path, this one must not
    depend on the call). The reference backend, or a k or n Triton cannot tile, gives `linear_reference`
    (XLA's dot, batch-invariance then up to XLA)."""
    m, k, n, out_dtype = _operands(x, w, layer, transposed, out_dtype)
    tiles = invariant_tiles(k, n)
    if backend() == "reference" or tiles is None:
        return linear_reference(x, w, layer, transposed=transposed, out_dtype=out_dtype)
    return _pallas(x, w, 0 if layer is None else layer, tiles, transposed=transposed, out_dtype=out_dtype,
                   interpret=backend() == "interpret", row_tiles=max(1, -(-m // ROW_TILE)))
