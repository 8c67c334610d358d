"""The real model: SmolLM2-135M-Instruct's GGUF converted by jeagle vs transformers loading the same
GGUF (`gguf_file=`): fp32 logits and greedy continuations."""

from __future__ import annotations

import pytest
import torch

from jeagle.loading.checkpoint import load_model
from jeagle.engine import EngineConfig, target_only
from jeagle.sampling import SamplingParams
from jeagle.loading.tokenizer import Tokenizer
from tests.util import max_rel_err, ragged_forward

PROMPTS = ["What is the capital of France?", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(smollm2_dir_fp32):
    return load_model(smollm2_dir_fp32), Tokenizer.from_dir(smollm2_dir_fp32)


def test_config_read_from_gguf(ours):
    model, tok = ours
    cfg = model.cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)


def test_fp32_logits_match_transformers(ours, hf_model):
    model, tok = ours
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    logits, _ = ragged_forward(model, ids)
    for i, p in enumerate(ids):
        with torch.no_grad():
            ref = hf_model(torch.tensor([p])).logits[0].numpy()
        assert max_rel_err(logits[i, : len(p)], ref) <= 1e-3


def test_greedy_32_tokens_match_transformers(ours, hf_model):
    model, tok = ours
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    engine = target_only(model, EngineConfig(max_batch_size=3, max_context=256))
    outs = engine.generate(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for p, o in zip(ids, outs):
        with torch.no_grad():
            # An explicit mask: the prompt holds <|im_end|> (id 2), which HF would take for padding.
            ref = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, eos_token_id=None,
                                    pad_token_id=2)[0, len(p):].tolist()
        assert o.token_ids == ref
    assert "Paris" in tok.decode(outs[0].token_ids)
