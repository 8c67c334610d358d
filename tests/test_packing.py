"""A step's host inputs packed into one int32 vector and unpacked inside the trace (runtime/packing.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.runtime.packing import Layout


def tree(rng):
    return {"tokens": rng.integers(-5, 1000, (3, 7)).astype(np.int32),
            "temperature": rng.random(3).astype(np.float32) * 2,
            "seed": rng.integers(0, 2**32, 3, dtype=np.uint64).astype(np.uint32),
            "nested": (np.full((2, 2), -1, np.int32), np.array([np.inf, -0.0, 1e-30], np.float32))}


def abstract(t):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)


def test_pack_unpack_round_trip_is_bit_exact():
    host = tree(np.random.default_rng(0))
    layout = Layout.of(abstract(host))
    words = layout.pack(host)
    assert words.dtype == np.int32 and words.shape == (21 + 3 + 3 + 4 + 3,) and layout.abstract.shape == words.shape
    back = jax.jit(layout.unpack)(jnp.asarray(words))
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(host)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.int32), want.view(np.int32))


def test_wrap_passes_the_unpacked_inputs_last():
    host = tree(np.random.default_rng(1))
    layout = Layout.of(abstract(host))

    def step(scale, inputs):
        return inputs["tokens"].sum() * scale + inputs["temperature"].sum()

    fn = jax.jit(layout.wrap(step))
    np.testing.assert_allclose(fn(2.0, layout.pack(host)), step(2.0, host), rtol=1e-6)


def test_pack_refuses_inputs_unlike_the_layout():
    host = tree(np.random.default_rng(2))
    layout = Layout.of(abstract(host))
    with pytest.raises(ValueError, match="where the executable takes"):
        layout.pack({**host, "tokens": host["tokens"][:, :6]})
    with pytest.raises(ValueError, match="where the executable takes"):
        layout.pack({**host, "temperature": host["temperature"].astype(np.float64)})
    with pytest.raises(ValueError, match="structure"):
        layout.pack({k: v for k, v in host.items() if k != "seed"})
    with pytest.raises(ValueError, match="4-byte"):
        Layout.of({"mask": jax.ShapeDtypeStruct((4,), jnp.bool_)})
