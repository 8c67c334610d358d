"""Smoke tests of the reference EAGLE heads in tests/eagle_refs.py (built with eagle-llm / specforge)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("eagle.model.cnets", reason="pip install --no-deps eagle-llm==1.2.1")
pytest.importorskip("specforge.modeling.draft.llama3_eagle", reason="pip install --no-deps specforge==0.2.0")

from tests import eagle_refs as er  # noqa: E402


def _load_state(path):
    import torch

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _inputs(rng, t, width, vocab):
    return (rng.standard_normal((1, t, width)).astype(np.float32),
            rng.integers(0, vocab, size=(1, t)).astype(np.int64))


@pytest.mark.parametrize("fmt,save_embed,num_layers,bias", [("bin", False, 1, True), ("safetensors", True, 2, False)])
def test_eagle1_files_keys_config(tmp_path, fmt, save_embed, num_layers, bias):
    ref = er.make_eagle1(tmp_path, fmt=fmt, save_embed=save_embed, num_layers=num_layers, bias=bias)
    weights = tmp_path / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    assert ref.weights_path == weights and weights.exists()
    state = _load_state(weights)
    assert sorted(state) == ref.keys == er.eagle1_keys(num_layers, bias, save_embed)
    assert "layers.0.input_layernorm.weight" not in state
    assert state["fc.weight"].shape == (64, 128)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for k in ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "bias",
              "hidden_act"):
        assert k in cfg, k
    assert cfg["num_hidden_layers"] == num_layers and cfg["bias"] == bias
    # perturbed away from 1 / 0
    assert not np.allclose(state["layers.0.post_attention_layernorm.weight"].numpy(), 1.0)
    if bias:
        assert np.abs(state["fc.bias"].numpy()).max() > 1e-3


def test_eagle1_cache_chunks_match_one_call(tmp_path):
    ref = er.make_eagle1(tmp_path, num_layers=2)
    rng = np.random.default_rng(0)
    feat, tok = _inputs(rng, 9, 64, 256)
    full = ref.step(feat, tok)
    assert full.shape == (1, 9, 64) and full.dtype == np.float32
    ref.reset()
    parts = [ref.step(feat[:, :5], tok[:, :5]), ref.step(feat[:, 5:8], tok[:, 5:8]), ref.step(feat[:, 8:], tok[:, 8:])]
    assert ref.position == 9
    np.testing.assert_allclose(np.concatenate(parts, 1), full, rtol=1e-5, atol=1e-5)
    ref.reset()
    np.testing.assert_allclose(ref.step(feat, tok), full, rtol=1e-6, atol=1e-6)


def test_eagle1_saved_file_reloads_into_official_model(tmp_path):
    """The saved pytorch_model.bin loads with eagle-llm's strict load_state_dict and reproduces the output."""
    import torch

    ref = er.make_eagle1(tmp_path, save_embed=True, fmt="bin", rope_theta=50000.0, seed=3)
    fresh = er.build_eagle1_model(json.loads((tmp_path / "config.json").read_text()))
    fresh.load_state_dict(torch.load(tmp_path / "pytorch_model.bin", map_location="cpu"), strict=True)
    assert float(fresh.layers[0].self_attn.rotary_emb.base) == 50000.0
    rng = np.random.default_rng(1)
    feat, tok = _inputs(rng, 6, 64, 256)
    with torch.no_grad():
        out = fresh(torch.as_tensor(feat), input_ids=torch.as_tensor(tok))
    np.testing.assert_allclose(out.numpy(), ref.step(feat, tok), rtol=1e-6, atol=1e-6)


def test_eagle1_embed_argument(tmp_path):
    emb = np.random.default_rng(5).standard_normal((256, 64)).astype(np.float32)
    ref = er.make_eagle1(tmp_path, embed=emb)
    np.testing.assert_array_equal(ref.embed, emb)
    assert "embed_tokens.weight" not in _load_state(ref.weights_path)


@pytest.mark.parametrize("fmt,save_embed,target_hidden", [("safetensors", True, None), ("bin", False, 48)])
def test_eagle3_files_keys_config(tmp_path, fmt, save_embed, target_hidden):
    ref = er.make_eagle3(tmp_path, fmt=fmt, save_embed=save_embed, target_hidden_size=target_hidden)
    weights = tmp_path / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    assert ref.weights_path == weights and weights.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["config.json", weights.name])
    state = _load_state(weights)
    assert sorted(state) == ref.keys == er.eagle3_keys(save_embed)
    ht = target_hidden or 64
    assert state["fc.weight"].shape == (64, 3 * ht)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert state["lm_head.weight"].shape == (64, 64)
    d2t, t2d = state["d2t"].numpy(), state["t2d"].numpy()
    assert d2t.dtype == np.int64 and d2t.shape == (64,) and t2d.dtype == np.bool_ and t2d.shape == (256,)
    target_ids = np.arange(64) + d2t
    assert np.all(np.diff(target_ids) > 0) and target_ids[0] >= 0 and target_ids[-1] < 256
    np.testing.assert_array_equal(np.flatnonzero(t2d), target_ids)
    np.testing.assert_array_equal(ref.d2t_map(np.arange(64)), target_ids)
    assert np.any(d2t != 0)
    from specforge.core.compact_teacher import validate_vocab_mapping_consistency

    validate_vocab_mapping_consistency(state["t2d"], state["d2t"])
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    assert cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == er.RMS_EPS
    assert cfg.get("target_hidden_size") == target_hidden
    assert not np.allclose(state["midlayer.hidden_norm.weight"].numpy(), 1.0)


def test_eagle3_forward_logits_and_official_paths(tmp_path):
    import torch

    ref = er.make_eagle3(tmp_path, target_hidden_size=48, rope_theta=20000.0)
    rng = np.random.default_rng(2)
    aux, tok = _inputs(rng, 7, 3 * 48, 256)
    hidden, logits = ref.forward(aux, tok)
    assert hidden.shape == (1, 7, 64) and logits.shape == (1, 7, 64)
    m = ref.model
    # logits == lm_head(norm(hidden)), by hand
    h = torch.as_tensor(hidden)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + er.RMS_EPS) * m.norm.weight
    np.testing.assert_allclose(logits, (normed @ m.lm_head.weight.T).detach().numpy(), rtol=1e-5, atol=1e-5)
    # specforge's own top-level forward (sdpa path, no cache_hidden) returns norm(hidden)
    with er.eager():
        emb = m.embed_tokens(torch.as_tensor(tok))
        top = m(hidden_states=torch.as_tensor(aux), inputs_embeds=emb)
    np.testing.assert_allclose(top.numpy(), normed.detach().numpy(), rtol=1e-5, atol=1e-5)
    # causal: a prefix gives the same outputs
    h4, l4 = ref.forward(aux[:, :4], tok[:, :4])
    np.testing.assert_allclose(h4, hidden[:, :4], rtol=1e-5, atol=1e-5)
    # the saved directory reloads the way specforge materializes a draft and reproduces the forward
    reloaded = er.load_eagle3_official(tmp_path)
    assert reloaded.midlayer.self_attn.rotary_emb.base == 20000.0
    again = er.Eagle3Ref(reloaded, tmp_path, ref.weights_path, ref.config, ref.keys)
    np.testing.assert_array_equal(again.d2t, ref.d2t)
    h2, l2 = again.forward(aux, tok)
    np.testing.assert_allclose(h2, hidden, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l2, logits, rtol=1e-6, atol=1e-6)
