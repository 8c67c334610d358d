"""A step's host inputs as one buffer: one host-to-device copy per dispatch instead of one per array.

A prefill takes ~20 small arrays from the host (tokens, lengths, slot lists, sampling and penalty
parameters, a token mask). Passed as they are, each is its own transfer and its own executable
argument, and together they cost more host time than the small prefill they feed: 1.80 ms to
dispatch a 64-token prefill with its 19 NumPy inputs, 1.25 ms with the same inputs already on the
device (H100, bench/probes/prefill_dispatch.py, removed after commit `b436043`; bench/HISTORY.md,
2026-11-26). Here every input leaf (all 4-byte: int32, uint32, float32) is written into one int32
vector on the host, and the executable slices and bitcasts it back inside its own trace, where those
slices fuse into their consumers.

    layout = Layout.of(abstract_inputs)          # at build time, from the step key's shapes
    fn = layout.wrap(step)                       # step(params, state, inputs) -> fn(params, state, words)
    exe(params, state, layout.pack(inputs))      # at dispatch

`Layout.of` fixes the order (the pytree's leaves), shapes and offsets; `pack` checks that the host's
inputs match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)


@dataclass(frozen=True)
class Layout:
    treedef: object
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    words: int

    @classmethod
    def of(cls, abstract) -> "Layout":
        leaves, treedef = jax.tree.flatten(abstract)
        shapes, dtypes, offsets, n = [], [], [], 0
        for leaf in leaves:
            dt = np.dtype(leaf.dtype)
            if dt.itemsize != _WORD.itemsize:
                raise ValueError(f"packed inputs must be 4-byte arrays, got {dt} of shape {leaf.shape}")
            shapes.append(tuple(leaf.shape))
            dtypes.append(dt)
            offsets.append(n)
            n += int(np.prod(leaf.shape, dtype=np.int64))
        return cls(treedef, tuple(shapes), tuple(dtypes), tuple(offsets), n)

    @property
    def abstract(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.words,), jnp.int32)

    def pack(self, inputs) -> np.ndarray:
        """The host inputs (the same pytree as the abstract ones) as one int32 vector."""
        leaves, treedef = jax.tree.flatten(inputs)
        if treedef != self.treedef:
            raise ValueError(f"inputs of structure {treedef}, the executable's is {self.treedef}")
        out = np.empty((self.words,), np.int32)
        for x, shape, dt, off in zip(leaves, self.shapes, self.dtypes, self.offsets):
            x = np.asarray(x)
            if x.shape != shape or x.dtype != dt:
                raise ValueError(f"input {x.dtype}{list(x.shape)} where the executable takes {dt}{list(shape)}")
            out[off: off + x.size] = x.reshape(-1).view(np.int32)
        return out

    def unpack(self, words: jax.Array):
        """Inside a trace: the pytree of inputs back from the vector (slices, reshapes, bitcasts)."""
        leaves = []
        for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets):
            size = int(np.prod(shape, dtype=np.int64))
            x = jax.lax.slice(words, (off,), (off + size,)).reshape(shape)
            leaves.append(x if dt == _WORD else jax.lax.bitcast_convert_type(x, dt))
        return jax.tree.unflatten(self.treedef, leaves)

    def wrap(self, step):
        """`step(*args, inputs)` as a function of `(*args, words)`."""
        def packed(*args):
            *rest, words = args
            return step(*rest, self.unpack(words))

        packed.__name__ = getattr(step, "__name__", getattr(getattr(step, "func", None), "__name__", "packed"))
        return packed
