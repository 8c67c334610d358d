"""Lower a Pallas kernel for an H100 on a machine without one, to catch constructs the Triton
lowering rejects before a GPU run. JAX asks the local device for its compute capability; this swaps
in the H100's (a private JAX hook: if it moves, the check skips rather than fails)."""

from __future__ import annotations

import contextlib

import jax
import pytest


@contextlib.contextmanager
def pretend_h100():
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration as registration
    except ImportError as e:  # pragma: no cover - depends on JAX internals
        pytest.skip(f"JAX's Triton lowering hooks moved: {e}")
    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    saved = registration.gpu_info_lib.get_gpu_info
    registration.gpu_info_lib.get_gpu_info = lambda: info
    try:
        yield
    finally:
        registration.gpu_info_lib.get_gpu_info = saved


def lower_for_h100(fn, *args) -> str:
    """The StableHLO text of `fn(*args)` lowered for CUDA; asserts it holds a Triton custom call."""
    with pretend_h100():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text, "no Triton kernel in the lowered module"
    return text
