"""GGUF conversion on a tiny llama-arch file holding every required tensor type (F32, F16, BF16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K) with llama.cpp's q/k permutation, against transformers' own
GGUF loader (an independent dequantiser and un-permutation)."""

from __future__ import annotations

import pytest
import torch

from checkpoints_conv.gguf import convert_gguf, open_gguf
from jeagle.loading.checkpoint import CheckpointError, load_model
from tests.gguf_models import LAYER_TENSORS, TINY_256, write_tiny_gguf
from tests.util import max_rel_err, ragged_forward


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY_256)).eval()
    d = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(hf, d / "tiny.gguf")


def test_file_holds_every_required_type(tiny_gguf):
    types = {t.tensor_type.name for t in open_gguf(tiny_gguf).tensors}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"} <= types
    assert {t for _, _, ts in LAYER_TENSORS for t in ts} <= types


def test_logits_match_transformers_gguf_loader(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                              dtype=torch.float32).eval()
    model = load_model(convert_gguf(tiny_gguf, tmp_path / "jx", dtype="float32", progress=False))
    prompts = [list(range(3, 60, 3)), [7, 8, 9, 250]]
    ours, _ = ragged_forward(model, prompts)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].numpy()
        assert max_rel_err(ours[i, : len(p)], ref) <= 1e-4


def test_unsupported_tensor_type_is_named(tmp_path):
    import transformers as tf

    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY_256)).eval()
    path = write_tiny_gguf(hf, tmp_path / "iq.gguf", override_type={"blk.1.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(CheckpointError, match=r"blk\.1\.ffn_up\.weight has GGUF type IQ4_NL.*supported: F32"):
        convert_gguf(path, tmp_path / "out", progress=False)
