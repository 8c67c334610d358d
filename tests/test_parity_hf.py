"""Hugging Face parity: tiny random Llama (llama3 RoPE), Qwen2 (qkv bias) and Qwen3 (q/k norm) models,
converted from safetensors, give HF's fp32 logits on a ragged batch and the same greedy continuations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoints_conv.hf import convert_hf
from jeagle.loading.checkpoint import load_model
from jeagle.engine import EngineConfig, target_only
from jeagle.sampling import SamplingParams
from tests.hf_models import make_hf_model
from tests.util import max_rel_err, ragged_forward

PROMPTS = [[5, 17, 200, 3, 9, 44, 101, 7, 250, 12, 66], [1, 2, 3], [99, 98, 97, 96, 95, 94, 93]]


@pytest.fixture(scope="module", params=[("llama", False), ("qwen2", True), ("qwen3", False)],
                ids=["llama3-untied", "qwen2-tied", "qwen3"])
def converted(request, tmp_path_factory):
    arch, tie = request.param
    src = tmp_path_factory.mktemp(f"hf_{arch}")
    # Llama is saved sharded (index.json + several files) to cover that reader.
    hf = make_hf_model(arch, src, tie=tie, max_shard_size="200KB" if arch == "llama" else None)
    out = convert_hf(src, tmp_path_factory.mktemp(f"jx_{arch}"), dtype="float32", progress=False)
    return arch, hf, load_model(out)


def test_sharded_checkpoint_was_written(tmp_path):
    make_hf_model("llama", tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("unroll", [False, True], ids=["loop", "unrolled"])
def test_logits_match_hf_fp32(converted, unroll):
    _, hf, model = converted
    ours, _ = ragged_forward(model, PROMPTS, unroll=unroll)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float().numpy()
        assert max_rel_err(ours[i, : len(p)], ref) <= 1e-4


def test_greedy_continuations_match_hf(converted):
    _, hf, model = converted
    engine = target_only(model, EngineConfig(max_batch_size=4, max_context=128))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32))
    for p, o in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref
        assert o.finish_reason == "length"


def test_aux_hidden_states_are_residual_stream_entering_layers(converted):
    _, hf, model = converted
    p = PROMPTS[0]
    _, out = ragged_forward(model, [p], aux_layers=(2, 0, 1))
    with torch.no_grad():
        hs = hf(torch.tensor([p]), output_hidden_states=True).hidden_states  # hs[i] enters layer i
    h = model.cfg.hidden_size
    aux = np.asarray(out.aux_hidden[0])
    for slot, layer in enumerate((2, 0, 1)):  # concatenated in the order asked for
        assert max_rel_err(aux[:, slot * h : (slot + 1) * h], hs[layer][0].numpy()) <= 1e-4
    # The final post-norm hidden is HF's last hidden state.
    assert max_rel_err(np.asarray(out.hidden[0]), hs[-1][0].numpy()) <= 1e-4
