"""Skinny matmuls: a few rows of activations times one layer of a stacked weight, read in place.

`linear(x, w, layer)` = `x @ w[layer]` for x [M, K] and w [L, K, N] (or [K, N]), accumulated in fp32
and returned in x's dtype, for the small M of decode steps, speculative rounds and draft steps.

Why a kernel: XLA compiles these badly inside the layer loop (bench/HISTORY.md, session 23). At
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

__all__ = ["linear", "linear_reference", "linear_serves", "linear_tiles", "MAX_ROWS"]

MAX_ROWS = 64  # rows (M) up to which `linear_serves`: beyond, XLA's GEMMs (prefills)
ROW_TILE = 64  # rows per program; more rows (MAX_ROWS raised) take a grid axis of row tiles
TARGET_PROGRAMS = 132  # aim for about one program per SM of an H100 (column blocks x K splits)


def linear_reference(x, w, layer=None):
    """x [M, K] @ (w[layer] if w is [L, K, N] else w [K, N]), fp32 accumulation, in x's dtype."""
    wl = w if w.ndim == 2 else w[layer]
    return jnp.dot(x, wl, preferred_element_type=jnp.float32).astype(x.dtype)


def _largest_pow2_divisor(n: int, lo: int, hi: int) -> int | None:
    b = hi
    while b >= lo:
        if n % b == 0:
            return b
        b //= 2
    return None


# How `linear_tiles` picks tiles: (vector form for one row, preferred N block, target programs, most K
# splits). "dot32", the default, measured fastest on the H100 in a SmolLM2 decode step at batch 1 / 16 /
# 48 (0.990 / 0.955 / 1.228 ms against XLA's dot 1.090 / 1.122 / 1.469) and a batch-1 round; the vector
# form for one row (products summed over K instead of a 16-row dot) measured slower in the step
# (1.154 ms at batch 1), as did 16-wide column blocks (bench/HISTORY.md, session 23). The others stay
# for bench/profile_decode.py's A/B (`--linear-rule`).
RULES = {
    "dot32": (False, 32, 132, 8),
    "vec32": (True, 32, 132, 8),
    "dot16": (False, 16, 132, 4),
}
RULE = "dot32"


def linear_tiles(m: int, k: int, n: int, rule: str | None = None) -> tuple[int, int, int, int] | None:
    """(rows padded, K block, N block, K splits) for an [m, k] x [k, n] product, or None when the kernel
    does not take it (m over MAX_ROWS, or k / n not multiples of 16, Triton's smallest dot). Column
    blocks as wide as the rule prefers; K split until there are about `target` programs (each split
    writes fp32 partial sums, merged after the kernel)."""
    vector, bn_pref, target, most = RULES[rule or RULE]
    if m < 1 or m > MAX_ROWS:
        return None
    vec = vector and m == 1
    bk = _largest_pow2_divisor(k, 16, 256 if vec else 128)
    if bk is None or n % 16:
        return None
    mp = 1 if vec else max(16, pl.next_power_of_2(m))
    bn = _largest_pow2_divisor(n, 16, bn_pref)
    row_tiles = max(1, mp // ROW_TILE)
    splits = max(1, min(k // bk, most, target // (n // bn * row_tiles)))
    return mp, bk, bn, splits


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, bk, bn, blocks, splits, vector, mt):
    j = pl.program_id(0)
    r0 = pl.multiple_of(pl.program_id(2 if splits > 1 else 1) * mt, mt) if x_ref.shape[0] > mt else 0
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
        wb = w_ref[layer, pl.ds(k0, bk), pl.ds(col, bn)]  # [BK, BN] of this layer, read in place
        if vector:  # one row: products summed over K (a 16-row dot would be 15/16 padding)
            xb = x_ref[0, pl.ds(k0, bk)]  # [BK]
            return acc + jnp.sum(xb.astype(jnp.float32)[:, None] * wb.astype(jnp.float32), axis=0)[None, :]
        xb = x_ref[pl.ds(r0, mt), pl.ds(k0, bk)]  # [MT, BK]: this program's rows
        return acc + jax.lax.dot_general(xb, wb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    zero = jnp.zeros((mt, bn), jnp.float32) + (layer * 0).astype(jnp.float32)  # a typed loop carry
    acc = jax.lax.fori_loop(first, last, body, zero)
    if splits == 1:
        o_ref[:, :] = acc.astype(o_ref.dtype)
    else:
        o_ref[0, :, :] = acc


def _pallas(x, w, layer, *, interpret, tiles=None):
    m, k = x.shape
    n = w.shape[-1]
    mp, bk, bn, splits = tiles or linear_tiles(m, k, n)
    w3 = w if w.ndim == 3 else w[None]
    xp = jnp.pad(x, ((0, mp - m), (0, 0)))
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    mt = min(mp, ROW_TILE)
    kernel = functools.partial(_kernel, bk=bk, bn=bn, blocks=k // bk, splits=splits, vector=mp == 1, mt=mt)
    row_axis = (mp // mt,) if mp > mt else ()
    if splits == 1:
        grid = (n // bn, *row_axis)
        out_specs = pl.BlockSpec((mt, bn), lambda j, *r: (r[0] if r else 0, j))
        out_shape = jax.ShapeDtypeStruct((mp, n), x.dtype)
    else:
        grid = (n // bn, splits, *row_axis)
        out_specs = pl.BlockSpec((1, mt, bn), lambda j, s, *r: (s, r[0] if r else 0, j))
        out_shape = jax.ShapeDtypeStruct((splits, mp, n), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.no_block_spec, pl.no_block_spec, pl.no_block_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="linear",
    )(layer_arr, xp, w3)
    if splits > 1:
        out = jnp.sum(out, axis=0).astype(x.dtype)
    return out[:m]


def linear_serves(m: int, k: int, n: int) -> bool:
    """Whether `linear` runs the kernel (pallas or interpret) for an [m, k] x [k, n] product."""
    return backend() != "reference" and linear_tiles(m, k, n) is not None


def linear(x, w, layer=None):
    """x [M, K] times layer `layer` of w [L, K, N] (or w [K, N], layer None): the kernel where
    `linear_serves`, else the reference. Returns [M, N] in x's dtype."""
    if x.ndim != 2 or w.ndim not in (2, 3) or w.shape[-2] != x.shape[1]:
        raise ValueError(f"x must be [M, K] and w [L, K, N] or [K, N] with the same K, got {x.shape}, {w.shape}")
    if (w.ndim == 3) != (layer is not None):
        raise ValueError("a stacked weight [L, K, N] needs its layer, a [K, N] one none")
    if not linear_serves(x.shape[0], x.shape[1], w.shape[-1]):
        return linear_reference(x, w, layer)
    return _pallas(x, w, 0 if layer is None else layer, interpret=backend() == "interpret")
