"""`--target` resolution: a Hugging Face dir or a .gguf file is converted once into the cache, then reused."""

from __future__ import annotations

import torch

from jeagle.loading.checkpoint import is_converted
from jeagle.loading.fetch import resolve_target
from tests.gguf_models import TINY_256, write_tiny_gguf
from tests.hf_models import make_hf_model


def test_hf_dir_and_gguf_are_converted_once(tmp_path, monkeypatch):
    import transformers as tf

    monkeypatch.setenv("JEAGLE_CACHE", str(tmp_path / "cache"))
    make_hf_model("qwen2", tmp_path / "hf")
    torch.manual_seed(0)
    gguf = write_tiny_gguf(tf.LlamaForCausalLM(tf.LlamaConfig(**TINY_256)).eval(), tmp_path / "tiny.gguf")
    for src in (tmp_path / "hf", gguf):
        out = resolve_target(str(src), dtype="float32", quiet=True)
        assert is_converted(out) and out.parent == tmp_path / "cache" / "models"
        stamp = (out / "config.json").stat().st_mtime_ns
        assert resolve_target(str(src), dtype="float32", quiet=True) == out
        assert (out / "config.json").stat().st_mtime_ns == stamp  # reused, not converted again
        assert resolve_target(str(out)) == out  # a converted dir is used as it is
