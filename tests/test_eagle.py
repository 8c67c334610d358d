"""EAGLE heads: jeagle's Flax heads, converted from PyTorch checkpoints, against the official EAGLE
code (`eagle-llm`, EAGLE-1/2) and SpecForge's EAGLE-3 model; export/import round trip; mismatch errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from flax import nnx

from checkpoints_conv.eagle import convert_eagle, export_eagle
from checkpoints_conv.hf import convert_hf
from jeagle.loading.checkpoint import CheckpointError, load_draft, load_model
from jeagle.config import ConfigError
from tests.eagle_refs import make_eagle1, make_eagle3
from tests.hf_models import TINY, make_hf_model
from tests.util import DraftRunner, max_rel_err

H, V = TINY["hidden_size"], TINY["vocab_size"]
HEAD = dict(vocab_size=V, hidden_size=H, intermediate_size=160, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    src = tmp_path_factory.mktemp("target_hf")
    make_hf_model("llama", src)
    out = convert_hf(src, tmp_path_factory.mktemp("target"), dtype="float32", progress=False)
    return out, load_model(out)


def embed_of(target):
    return np.asarray(target[1].embed[...])


def run_chunks(ref_step, ours: DraftRunner, chunks, feature_dim, rng):
    """Compare hidden states chunk by chunk, each chunk continuing the cache."""
    for t in chunks:
        feature = rng.standard_normal((1, t, feature_dim)).astype(np.float32)
        tokens = rng.integers(0, V, (1, t))
        want = ref_step(feature, tokens)
        got, _ = ours.step(feature, tokens)
        assert max_rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("layers,bias,fmt,save_embed", [(1, True, "bin", False), (2, False, "safetensors", True)],
                         ids=["1layer-bias-bin", "2layers-nobias-safetensors-embed"])
def test_eagle1_matches_official_code_over_cached_steps(target, tmp_path, layers, bias, fmt, save_embed):
    ref = make_eagle1(tmp_path / "head", **HEAD, num_layers=layers, bias=bias, embed=embed_of(target),
                      save_embed=save_embed, fmt=fmt, seed=3)
    out = convert_eagle(tmp_path / "head", tmp_path / "conv", target=target[0], dtype="float32")
    head = load_draft(out, target=target[1].cfg)
    assert head.cfg.kind == "eagle1" and head.cfg.num_layers == layers and head.cfg.fc_bias == bias
    run_chunks(ref.step, DraftRunner(head, target[1]), [6, 3, 1, 1], H, np.random.default_rng(0))


def test_eagle1_logits_use_the_target_head(target, tmp_path):
    make_eagle1(tmp_path / "head", **HEAD, embed=embed_of(target))
    head = load_draft(convert_eagle(tmp_path / "head", tmp_path / "conv", target=target[0], dtype="float32"))
    hidden, logits = DraftRunner(head, target[1]).step(np.ones((1, 2, H), np.float32), np.array([[4, 5]]))
    lm_head = np.asarray(target[1].lm_head[...])
    assert max_rel_err(logits, hidden @ lm_head.T) <= 1e-5


def test_eagle3_matches_specforge(target, tmp_path):
    ref = make_eagle3(tmp_path / "head", **HEAD, draft_vocab_size=64, target_hidden_size=H, embed=embed_of(target),
                      seed=5)
    out = convert_eagle(tmp_path / "head", tmp_path / "conv", target=target[0], dtype="float32")
    head = load_draft(out, target=target[1].cfg)
    cfg = head.cfg
    assert cfg.kind == "eagle3" and cfg.draft_vocab_size == 64 and cfg.target_hidden_size == H
    rng = np.random.default_rng(1)
    aux = rng.standard_normal((1, 9, 3 * H)).astype(np.float32)
    tokens = rng.integers(0, V, (1, 9))
    want_hidden, want_logits = ref.forward(aux, tokens)
    got_hidden, got_logits = DraftRunner(head, target[1]).step(aux, tokens)
    assert max_rel_err(got_hidden, want_hidden) <= 1e-4
    assert max_rel_err(got_logits, want_logits) <= 1e-4
    ids = np.arange(64)
    assert np.array_equal(np.asarray(head.draft_to_target(ids)), ref.d2t_map(ids))


def test_eagle3_recycled_feature_skips_fc(target, tmp_path):
    """After the first step the draft feeds its own H-wide hidden back: no fc on it."""
    make_eagle3(tmp_path / "head", **HEAD, draft_vocab_size=64, target_hidden_size=H, embed=embed_of(target))
    head = load_draft(convert_eagle(tmp_path / "head", tmp_path / "conv", target=target[0], dtype="float32"))
    runner = DraftRunner(head, target[1])
    rng = np.random.default_rng(2)
    h1, _ = runner.step(rng.standard_normal((1, 4, 3 * H)).astype(np.float32), rng.integers(0, V, (1, 4)))
    h2, logits = runner.step(h1[:, -1:], rng.integers(0, V, (1, 1)))
    assert h2.shape == (1, 1, H) and logits.shape == (1, 1, 64) and np.isfinite(h2).all()


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_export_then_import_is_identical(target, tmp_path, kind):
    if kind == "eagle1":
        make_eagle1(tmp_path / "head", **HEAD, num_layers=2, embed=embed_of(target))
    else:
        make_eagle3(tmp_path / "head", **HEAD, draft_vocab_size=64, target_hidden_size=H, embed=embed_of(target))
    first = convert_eagle(tmp_path / "head", tmp_path / "a", target=target[0], dtype="float32")
    export_eagle(first, tmp_path / "exported")
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["architectures"] == (["LlamaForCausalLMEagle3"] if kind == "eagle3" else ["LlamaForCausalLM"])
    second = convert_eagle(tmp_path / "exported", tmp_path / "b", target=target[0], dtype="float32")
    a = nnx.to_pure_dict(nnx.state(load_draft(first)))
    b = nnx.to_pure_dict(nnx.state(load_draft(second)))
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    assert load_draft(first).cfg == load_draft(second).cfg.replace(name=load_draft(first).cfg.name)


def test_aux_layer_conventions(target, tmp_path):
    make_eagle3(tmp_path / "head", **HEAD, draft_vocab_size=64, target_hidden_size=H, embed=embed_of(target))
    cfg_file = tmp_path / "head" / "config.json"
    base = json.loads(cfg_file.read_text())
    base.pop("eagle_config", None)
    base.pop("eagle_aux_hidden_state_layer_ids", None)
    cases = [({}, (2, 1, 0)),  # default {2, L//2, L-3} for the 3-layer target
             ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}}, (1, 1, 2)),  # SGLang: i + 1
             ({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, (0, 1, 2))]  # vLLM: as-is
    for n, (extra, want) in enumerate(cases):
        cfg_file.write_text(json.dumps({**base, **extra}))
        out = convert_eagle(tmp_path / "head", tmp_path / f"c{n}", target=target[0], dtype="float32")
        assert load_draft(out).cfg.aux_layer_ids == want
    cfg_file.write_text(json.dumps({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}))
    with pytest.raises(ConfigError, match=r"aux layers \[1, 2, 3\]: \[3\] outside the target's 3 layers"):
        convert_eagle(tmp_path / "head", tmp_path / "bad", target=target[0], dtype="float32")


def test_mismatches_are_clear_errors(target, tmp_path):
    # hidden size
    make_eagle1(tmp_path / "small", **{**HEAD, "hidden_size": 32, "intermediate_size": 64})
    with pytest.raises(ConfigError, match="draft hidden_size 32 != target hidden_size 64"):
        convert_eagle(tmp_path / "small", tmp_path / "o1", target=target[0])
    # vocabulary
    make_eagle1(tmp_path / "vocab", **{**HEAD, "vocab_size": 300})
    with pytest.raises(ConfigError, match="draft vocab_size 300 != target vocab_size 256"):
        convert_eagle(tmp_path / "vocab", tmp_path / "o2", target=target[0])
    # an embedding that is not the target's
    make_eagle1(tmp_path / "emb", **HEAD, save_embed=True)
    with pytest.raises(CheckpointError, match="embed_tokens differs from the target's embedding"):
        convert_eagle(tmp_path / "emb", tmp_path / "o3", target=target[0])
    # EAGLE-3 fc width vs the target's hidden size
    make_eagle3(tmp_path / "e3", **HEAD, draft_vocab_size=64, target_hidden_size=32, embed=embed_of(target))
    with pytest.raises(ConfigError, match="draft fc expects target hidden size 32"):
        convert_eagle(tmp_path / "e3", tmp_path / "o4", target=target[0])
    # architecture label vs weights, unknown architecture, bias flag vs weights
    make_eagle1(tmp_path / "lab", **HEAD, embed=embed_of(target), bias=True)
    cfg = json.loads((tmp_path / "lab" / "config.json").read_text())
    for patch, msg in [({"architectures": ["LlamaForCausalLMEagle3"]}, "says LlamaForCausalLMEagle3"),
                       ({"architectures": ["MixtralForCausalLM"]}, "unsupported draft architecture"),
                       ({"bias": False}, "says bias=False but fc.bias is present")]:
        (tmp_path / "lab" / "config.json").write_text(json.dumps({**cfg, **patch}))
        with pytest.raises(ConfigError, match=msg):
            convert_eagle(tmp_path / "lab", tmp_path / "o5", target=target[0])
    # not a head at all / missing files
    shutil.rmtree(tmp_path / "lab")
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="neither pytorch_model.bin nor model.safetensors"):
        convert_eagle(tmp_path / "lab", tmp_path / "o6", target=target[0])
    with pytest.raises(CheckpointError, match="is not a converted jeagle draft"):
        load_draft(target[0])


def test_qkv_biases_of_qwen2_style_heads(target, tmp_path):
    """Heads trained on Qwen2 carry q/k/v biases: give the official module biased projections and
    compare, so bias handling is checked against the official forward too."""
    import torch

    from tests.eagle_refs import _save_state

    ref = make_eagle1(tmp_path / "head", **HEAD, embed=embed_of(target))
    torch.manual_seed(7)
    attn = ref.model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(0.1 * torch.randn(old.out_features))
        setattr(attn, name, new)
    state = {k: v.detach().clone() for k, v in ref.model.state_dict().items() if k != "embed_tokens.weight"}
    ref.weights_path.unlink()
    _save_state(state, tmp_path / "head", "bin")
    head = load_draft(convert_eagle(tmp_path / "head", tmp_path / "conv", target=target[0], dtype="float32"))
    assert head.cfg.qkv_bias
    ref.reset()
    run_chunks(ref.step, DraftRunner(head, target[1]), [5, 2], H, np.random.default_rng(4))


def test_draft_runs_under_jit_with_donated_pools(target, tmp_path):
    """The same conventions as the target: split once, plain jax.jit, pools donated and returned."""
    import jax
    import jax.numpy as jnp

    from jeagle.runtime.kv_cache import init_pools
    from jeagle.models.common import AttnInputs

    make_eagle3(tmp_path / "head", **HEAD, draft_vocab_size=64, target_hidden_size=H, embed=embed_of(target))
    head = load_draft(convert_eagle(tmp_path / "head", tmp_path / "conv", target=target[0], dtype="float32"))
    graphdef, state = nnx.split(head)
    k, v = init_pools(head.cfg, num_slots=17)

    def draft_step(state, tokens, feature, attn, k, v, embed):
        return nnx.merge(graphdef, state)(tokens, feature, attn, k, v, embed=embed)

    rng = np.random.default_rng(3)
    tokens, aux = rng.integers(0, V, (2, 4)), rng.standard_normal((2, 4, 3 * H)).astype(np.float32)
    slots = jnp.arange(1, 9, dtype=jnp.int32).reshape(2, 4)
    attn = AttnInputs(positions=jnp.tile(jnp.arange(4, dtype=jnp.int32), (2, 1)), write_slots=slots,
                      kv_slots=slots, kv_len=jnp.array([4, 3], jnp.int32))
    embed = target[1].embed[...]
    jitted = jax.jit(draft_step, donate_argnums=(4, 5))(state, tokens, aux, attn, k, v, embed)
    k2, v2 = init_pools(head.cfg, num_slots=17)
    eager = head(jnp.asarray(tokens), jnp.asarray(aux), attn, k2, v2, embed=embed)
    assert max_rel_err(jitted.hidden, eager.hidden) <= 1e-5
    assert max_rel_err(jitted.k, eager.k) <= 1e-5
