"""The skinny-matmul kernel (jeagle/kernels/linear.py): interpreted on CPU and compiled with -m gpu,
against `x @ w[layer]` on random inputs. Cases: one row (a batch-1 decode step), a few rows (a tree
verify, draft steps) and the most rows the kernel takes; stacked [L, K, N] weights read at a traced
layer and plain [K, N] ones; K splits merged after the kernel (few column blocks) and none; layer
loops through the models (`project`), with the switch off giving XLA's dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jeagle.kernels.linear import MAX_ROWS, linear, linear_reference, linear_serves, linear_tiles
from jeagle.kernels.settings import KernelSettings, use
from tests.kernels.lowering import lower_for_h100

# (m, k, n): SmolLM2's q|k|v, output, gate|up and down projections, then small and odd-sized ones.
SHAPES = [(1, 576, 960), (8, 576, 576), (3, 576, 3072), (16, 1536, 576), (MAX_ROWS, 64, 48), (5, 32, 16)]


def operands(m, k, n, seed, dtype=jnp.float32, layers=3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(layers, k, n)) / np.sqrt(k), dtype)
    return x, w


def check(mode, m, k, n, seed, dtype=jnp.float32, tol=2e-5, max_rows=64):
    x, w = operands(m, k, n, seed, dtype)
    layer = jnp.int32(seed % w.shape[0])
    with use(KernelSettings(backend=mode, linear_max_rows=max_rows)):
        assert linear_serves(m, k, n)
        got = jax.jit(lambda *a: linear(*a))(x, w, layer)
        flat = jax.jit(lambda *a: linear(*a))(x, w[1])
    assert got.shape == (m, n) and got.dtype == dtype
    want = linear_reference(x, w, layer)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(flat, np.float32), np.asarray(linear_reference(x, w[1]), np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_interpreted_kernel_matches_reference(m, k, n):
    check("interpret", m, k, n, seed=m + k + n)


@pytest.mark.parametrize("m", [100, 128])
def test_interpreted_kernel_takes_a_batch16_verify_when_allowed(m):
    """JEAGLE_LINEAR_MAX_ROWS=128: a batch-16 (5,4,8) verify's 128 rows (SmolLM2's q|k|v shape) in the kernel."""
    check("interpret", m, 576, 960, seed=m, max_rows=128)


def test_tiles():
    mp, bk, bn, splits = linear_tiles(1, 576, 960)
    assert (mp, bk) == (16, 64) and 960 % bn == 0 and splits >= 2  # few column blocks: K is split too
    assert linear_tiles(48, 576, 960)[0] == 64
    assert linear_tiles(MAX_ROWS + 1, 576, 960) is None  # prefills: XLA's GEMMs
    assert linear_tiles(1, 4096, 4096) is None and linear_tiles(1, 576, 8192) is not None  # 8B-sized: XLA's dot
    assert linear_tiles(1, 40, 960) is None and linear_tiles(1, 576, 40) is None  # Triton's 16-wide dot
    with use(KernelSettings(backend="reference")):
        assert not linear_serves(1, 576, 960)
    with use(KernelSettings(linear_max_rows=128)):  # a batch-16 verify's 128 rows take the kernel
        assert linear_tiles(128, 576, 1728) == (128, 64, 32, 2) and linear_tiles(129, 576, 1728) is None
    assert linear_tiles(128, 576, 1728, max_rows=128)[0] == 128 and linear_tiles(128, 576, 1728) is None


def test_tiles_override_matches_reference():
    """Other tilings than `linear_tiles`' (what bench/probes/linear.py measures): narrow blocks, K split
    or not."""
    x, w = operands(3, 576, 960, 4)
    with use(KernelSettings(backend="interpret")):
        for tiles in [(16, 64, 16, 1), (16, 64, 64, 3), (32, 64, 32, 9)]:
            got = jax.jit(lambda x, w, t=tiles: linear(x, w, jnp.int32(1), tiles=t))(x, w)
            np.testing.assert_allclose(np.asarray(got), np.asarray(linear_reference(x, w, 1)), rtol=2e-5, atol=2e-5)
        with pytest.raises(ValueError, match="do not fit"):
            linear(x, w, 1, tiles=(16, 128, 32, 4))  # 576 is no multiple of 128


@pytest.mark.parametrize("m,k,n", [(1, 576, 8192), (4, 576, 8192), (16, 64, 48)])
def test_interpreted_transposed_weight_matches_reference(m, k, n):
    """An output head's [N, K] layout (the draft's logits at a draft step's rows), fp32 out from bf16."""
    rng = np.random.default_rng(m + n)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(n, k)) / np.sqrt(k), jnp.bfloat16)
    with use(KernelSettings(backend="interpret")):
        got = jax.jit(lambda x, w: linear(x, w, transposed=True, out_dtype=jnp.float32))(x, w)
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(linear_reference(x, w, transposed=True, out_dtype=jnp.float32)),
                               np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"\[N, K\] with the same K"):
        linear(x, w.T, transposed=True)


def test_draft_head_logits_route_through_the_kernel_and_its_switch(monkeypatch):
    """A draft step's logits (few rows) go through the kernel's transposed form; JEAGLE_LINEAR=0 takes
    them out; the logits agree."""
    import jeagle.models.common as common

    calls = []
    real = common.linear
    monkeypatch.setattr(common, "linear", lambda *a, **kw: calls.append(kw.get("transposed")) or real(*a, **kw))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 4, 64)), jnp.float32)  # [B, K, H]
    head = jnp.asarray(rng.normal(size=(256, 64)) / 8, jnp.float32)  # [Vd, H]
    out = {}
    for on in (True, False):
        calls.clear()
        with use(KernelSettings(backend="interpret", linear=on)):
            out[on] = np.asarray(jax.jit(common.head_logits)(x, head))
        assert calls == ([True] if on else [])
    assert out[True].shape == (2, 4, 256) and out[True].dtype == np.float32
    np.testing.assert_allclose(out[True], out[False], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,), (2, 4)])
def test_one_row_logits_padded_on_a_gpu_equal_the_dot(monkeypatch, lead):
    """`fp32_logits` pads one row to two where the backend is a GPU (a bf16 gemv with fp32 output
    converts the whole head to fp32 there); the row's logits are the dot's, any leading shape."""
    import jeagle.models.common as common

    rng = np.random.default_rng(len(lead))
    x = jnp.asarray(rng.normal(size=(*lead, 64)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(300, 64)) / 8, jnp.float32)
    want = np.einsum("...h,vh->...v", np.asarray(x), np.asarray(head))
    seen = []
    real = jnp.einsum
    monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(common.jnp, "einsum", lambda spec, a, *r, **kw: seen.append(a.shape) or real(spec, a, *r, **kw))
    got = np.asarray(common.fp32_logits(x, head))
    assert got.shape == (*lead, 300) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert seen == ([(2, 64)] if np.prod(lead) == 1 else [x.shape])


@pytest.mark.gpu
def test_one_row_bf16_logits_read_the_head_once_without_triton_gemm():
    """Compiled as the prefill and round executables are (XLA's Triton GEMM fusions off), one row's
    bf16 logits with fp32 output convert no head-sized array to fp32 and equal an fp32 reference."""
    from jeagle.models.common import fp32_logits

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 1024)), jnp.bfloat16)
    head = jnp.asarray(rng.normal(size=(32768, 1024)) / 32, jnp.bfloat16)
    options = {"xla_gpu_enable_triton_gemm": False}
    plain = jax.jit(lambda x, h: jnp.einsum("th,vh->tv", x, h, preferred_element_type=jnp.float32))
    assert "f32[32768,1024]" in plain.lower(x, head).compile(compiler_options=options).as_text()  # the premise
    compiled = jax.jit(fp32_logits).lower(x, head).compile(compiler_options=options)
    assert "f32[32768,1024]" not in compiled.as_text()
    want = np.asarray(x, np.float32) @ np.asarray(head, np.float32).T
    np.testing.assert_allclose(np.asarray(compiled(x, head)), want, rtol=2e-2, atol=2e-2)


def test_refuses_mismatched_operands():
    x, w = operands(2, 32, 16, 0)
    with pytest.raises(ValueError, match="same K"):
        linear(x[:, :16], w)
    with pytest.raises(ValueError, match="needs its layer"):
        linear(x, w)
    with pytest.raises(ValueError, match="needs its layer"):
        linear(x, w[0], 0)


def test_models_route_through_the_kernel_and_its_switch(monkeypatch):
    """A target's decode-sized forward runs its four matmuls a layer through the `linear` kernel, and
    the settings' switch (JEAGLE_LINEAR=0) takes them out; the logits agree."""
    import jeagle.models.common as common
    from jeagle.models.common import AttnInputs
    from tests.spec_models import bigram_target, target_config

    calls = []
    monkeypatch.setattr(common, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    model = bigram_target(target_config())
    cfg = model.cfg
    pool = jnp.zeros((cfg.num_layers, 40, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    attn = AttnInputs(positions=jnp.asarray([[3]], jnp.int32), write_slots=jnp.asarray([[4]], jnp.int32),
                      kv_slots=jnp.asarray([[1, 2, 3, 4]], jnp.int32), kv_len=jnp.asarray([4], jnp.int32),
                      extra_slots=jnp.asarray([[4]], jnp.int32), extra_mask=jnp.ones((1, 1, 1), bool))
    tokens = jnp.asarray([[7]], jnp.int32)
    out = {}
    for on in (True, False):
        calls.clear()
        with use(KernelSettings(backend="interpret", linear=on)):
            out[on] = np.asarray(jax.jit(lambda t, a, k, v: model(t, a, k, v).logits)(tokens, attn, pool, pool))
        # A layer loop traces its body once: four matmuls, each reading the whole [L, K, N] stack.
        assert len(calls) == (4 if on else 0) and all(len(s) == 3 and s[0] == cfg.num_layers for s in calls)
    np.testing.assert_allclose(out[True], out[False], rtol=2e-5, atol=2e-5)


def test_lowers_for_h100():
    with use(KernelSettings(backend="pallas")):
        for m, k, n in [(1, 576, 960), (8, 576, 576), (48, 1536, 576)]:
            x, w = operands(m, k, n, 0, jnp.bfloat16)
            lower_for_h100(lambda *a: linear(*a), x, w, jnp.int32(1))
    with use(KernelSettings(backend="pallas", linear_max_rows=128)):
        x, w = operands(128, 576, 1728, 0, jnp.bfloat16)
        lower_for_h100(lambda *a: linear(*a), x, w, jnp.int32(1))
    with use(KernelSettings(backend="pallas")):
        x, w = operands(4, 576, 8192, 0, jnp.bfloat16, layers=1)
        lower_for_h100(lambda x, w: linear(x, w, transposed=True, out_dtype=jnp.float32), x, w[0].T)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_compiled_kernel_matches_reference(m, k, n):
    check("pallas", m, k, n, seed=m + n, dtype=jnp.float32, tol=2e-2)  # TF32 dots in the kernel and in XLA
    check("pallas", m, k, n, seed=m + n + 1, dtype=jnp.bfloat16, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(128, 576, 1728), (128, 1536, 576), (96, 576, 3072)])
def test_compiled_kernel_takes_verify_rows_when_allowed(m, k, n):
    check("pallas", m, k, n, seed=m + n, dtype=jnp.bfloat16, tol=3e-2, max_rows=128)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64])
def test_compiled_transposed_weight_matches_reference(m):
    x, w = operands(m, 576, 8192, m, jnp.bfloat16, layers=1)
    wt = w[0].T  # [N, K]
    with use(KernelSettings(backend="pallas")):
        got = jax.jit(lambda x, w: linear(x, w, transposed=True, out_dtype=jnp.float32))(x, wt)
    want = jnp.dot(x.astype(jnp.float32), wt.astype(jnp.float32).T)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
