"""Reference EAGLE draft heads built with the official / independent PyTorch implementations.

Nothing here re-implements a draft head: the modules are imported from the packages that define the
formats, so jeagle's Flax heads can be compared against code it shares nothing with.

* EAGLE-1/2: `eagle.model.cnets.Model` from `eagle-llm==1.2.1` (SafeAILab/EAGLE, the code the official
  `yuhuili/EAGLE-*` heads were trained and served with).
* EAGLE-3: `specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3` from `specforge==0.2.0`
  (the SGLang project's trainer; its draft module names are what SGLang's EAGLE-3 loader reads).

Both are installed with `pip install --no-deps eagle-llm==1.2.1 specforge==0.2.0` (their pinned
dependencies -- old accelerate/gradio/fschat for eagle-llm, sglang/datasets/... for specforge -- are
neither needed nor wanted).  Workarounds, each also noted where it is applied:

* eagle-llm's `EConfig` (a transformers-4 `PretrainedConfig`) does not work under transformers 5, so
  `cnets.Model` gets a `types.SimpleNamespace` config carrying exactly the attributes it reads.
* specforge decorates its RMSNorm / rotary / apply_rotary_pos_emb with `@torch.compile(dynamic=True)`;
  on CPU that would invoke Inductor (slow, needs a C compiler), so every call into it runs under
  `torch.compiler.set_stance("force_eager")` -- the same Python code, just not compiled.
* `specforge.data.preprocessing` (home of `process_token_dict_to_mappings`, which builds d2t/t2d)
  imports `datasets` at module level, which --no-deps does not install; a stub `datasets` module is put
  in `sys.modules` only for that import and removed again.

Only `tests/` imports this module; the packages are test dependencies only.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path

import numpy as np

RMS_EPS = 1e-5          # not the 1e-6 default of either package's RMSNorm, so a reader that ignores it fails
MAX_POS = 2048
EAGLE1_BUILTIN_ROPE_BASE = 10000.0   # eagle-llm 1.2.1's cnets hard-codes this (it never reads rope_theta)

# Exact keys of a saved EAGLE-1/2 head (`cnets.Model.state_dict()`; rotary buffers are non-persistent).
#   embed_tokens.weight                         [vocab, H]      only if save_embed=True
#   fc.weight                                   [H, 2H]         input = concat(embed(tok), feature)
#   fc.bias                                     [H]             only if bias=True (config "bias")
#   layers.{i}.input_layernorm.weight           [H]             only for i >= 1 (layer 0 has none)
#   layers.{i}.self_attn.q_proj.weight          [nh*hd, H]      no attention biases in this code
#   layers.{i}.self_attn.k_proj.weight          [nkv*hd, H]
#   layers.{i}.self_attn.v_proj.weight          [nkv*hd, H]
#   layers.{i}.self_attn.o_proj.weight          [H, nh*hd]
#   layers.{i}.post_attention_layernorm.weight  [H]
#   layers.{i}.mlp.gate_proj.weight             [I, H]
#   layers.{i}.mlp.up_proj.weight               [I, H]
#   layers.{i}.mlp.down_proj.weight             [H, I]
# No final norm, no lm_head: the target's lm_head (and final norm, which EAGLE-1 does NOT apply to the
# draft hidden) is used for logits.


def eagle1_keys(num_layers: int = 1, bias: bool = True, save_embed: bool = False) -> list[str]:
    keys = ["embed_tokens.weight"] if save_embed else []
    for i in range(num_layers):
        p = f"layers.{i}."
        if i != 0:
            keys.append(p + "input_layernorm.weight")
        keys += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        keys.append(p + "post_attention_layernorm.weight")
    keys.append("fc.weight")
    if bias:
        keys.append("fc.bias")
    return sorted(keys)


# Exact keys of a saved EAGLE-3 head (`LlamaForCausalLMEagle3.state_dict()`, SpecForge export / SGLang):
#   embed_tokens.weight                          [vocab, H]            only if save_embed=True
#   fc.weight                                    [H, 3*Ht]             no bias; input = low|mid|high
#   midlayer.hidden_norm.weight                  [H]                   norm of fc(aux) / recycled hidden
#   midlayer.input_layernorm.weight              [H]                   norm of embed(tok)
#   midlayer.self_attn.q_proj.weight             [nh*hd, 2H]           input = concat(in_ln(emb), hid_norm(h))
#   midlayer.self_attn.k_proj.weight             [nkv*hd, 2H]
#   midlayer.self_attn.v_proj.weight             [nkv*hd, 2H]
#   midlayer.self_attn.o_proj.weight             [H, nh*hd]
#   midlayer.post_attention_layernorm.weight     [H]
#   midlayer.mlp.gate_proj.weight / up_proj.weight [I, H], down_proj.weight [H, I]
#   norm.weight                                  [H]                   final norm before lm_head
#   lm_head.weight                               [draft_vocab, H]
#   d2t                                          int64 [draft_vocab]   target id = draft id + d2t[draft id]
#   t2d                                          bool  [vocab]         True for target ids in the draft vocab
# (specforge 0.2.0 also knows an optional config "fc_norm": true -> fc_norm.{0,1,2}.weight; not used here.)


def eagle3_keys(save_embed: bool = True) -> list[str]:
    keys = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.post_attention_layernorm.weight"]
    keys += [f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"]
    keys += [f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    if save_embed:
        keys.append("embed_tokens.weight")
    return sorted(keys)


def _randomize(model, seed: int, embed: "np.ndarray | None", extra_skip: tuple[str, ...] = ()) -> None:
    """Deterministic random weights of a useful scale; norms ~ 1 +- 0.1, biases ~ +-0.1 (not 0/1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in extra_skip:
                continue
            if name == "embed_tokens.weight":
                if embed is not None:
                    e = torch.as_tensor(np.asarray(embed, np.float32))
                    if tuple(e.shape) != tuple(p.shape):
                        raise ValueError(f"embed shape {tuple(e.shape)} != {tuple(p.shape)}")
                    p.copy_(e)
                else:
                    p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:  # [out, in] projection
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))


def _save_state(state: dict, out_dir: Path, fmt: str) -> Path:
    import torch

    if fmt == "bin":
        path = out_dir / "pytorch_model.bin"
        torch.save(state, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = out_dir / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    else:
        raise ValueError(f"fmt must be 'bin' or 'safetensors', got {fmt!r}")
    return path


# --------------------------------------------------------------------------------------------- EAGLE-1/2


class Eagle1Ref:
    """An official `eagle.model.cnets.Model` (fp32, eval) plus its KV cache between `step` calls.

    Attributes: model, out_dir, weights_path, config (the dict written to config.json), keys (saved
    state-dict keys), embed (np [vocab, H], the embedding the model uses, whether saved or not).
    """

    def __init__(self, model, out_dir: Path, weights_path: Path, config: dict, keys: list[str]):
        self.model = model
        self.out_dir = out_dir
        self.weights_path = weights_path
        self.config = config
        self.keys = keys
        self.embed = model.embed_tokens.weight.detach().numpy().copy()
        self._past = None

    @property
    def position(self) -> int:
        """Number of positions already in the KV cache (the next chunk starts here)."""
        return 0 if self._past is None else int(self._past[0][0].shape[2])

    def step(self, feature: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Run the official forward on the next chunk with its KV cache kept between calls: feature [1,T,H]
        float32 (target hidden states), tokens [1,T] int; returns the draft's output hidden states [1,T,H]
        (pre-norm, what EAGLE recycles as the next feature). First call: positions 0..T-1; later calls
        continue the positions.

        This is exactly how eagle-llm's `topK_genrate` drives it: `Model.forward(hidden_states,
        input_ids=..., past_key_values=<tuple of (k, v) per layer>, use_cache=True)` returns
        `(hidden, next_past)`; with past given, forward builds position_ids = past_len .. past_len+T-1 and a
        causal mask offset by past_len itself. The cache holds post-RoPE k/v of shape [1, nkv, S, hd].
        """
        import torch

        f = torch.as_tensor(np.asarray(feature, dtype=np.float32))
        t = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        if f.ndim != 3 or t.ndim != 2 or f.shape[:2] != t.shape:
            raise ValueError(f"feature {tuple(f.shape)} / tokens {tuple(t.shape)}: want [1,T,H] and [1,T]")
        with torch.no_grad():
            hidden, self._past = self.model(f, input_ids=t, past_key_values=self._past, use_cache=True)
        return hidden.numpy().copy()

    def reset(self) -> None:
        self._past = None


def _eagle1_namespace(cfg: dict):
    """The attributes `cnets.Model` / LlamaAttention / LlamaMLP / LlamaDecoderLayer read (workaround for
    EConfig breaking under transformers 5)."""
    return types.SimpleNamespace(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"], hidden_act=cfg["hidden_act"], pad_token_id=cfg["pad_token_id"],
        pretraining_tp=cfg["pretraining_tp"], rope_scaling=cfg["rope_scaling"], rope_theta=cfg["rope_theta"],
    )


def build_eagle1_model(cfg: dict):
    """A fresh `cnets.Model` for a config.json dict (as EaModel builds it: `Model(config, bias=con["bias"])`).

    eagle-llm 1.2.1 ignores `rope_theta` (its LlamaAttention._init_rope builds
    `LlamaRotaryEmbedding(head_dim, max_position_embeddings)`, base 10000). For a config whose rope_theta
    is not 10000 we replace each layer's rotary module with the same official class constructed with
    `base=rope_theta` (what later EAGLE code does for LLaMA-3 heads); for 10000 the model is untouched.
    """
    from eagle.model import cnets

    model = cnets.Model(_eagle1_namespace(cfg), bias=cfg.get("bias", True))
    theta = float(cfg.get("rope_theta", EAGLE1_BUILTIN_ROPE_BASE))
    if theta != EAGLE1_BUILTIN_ROPE_BASE:
        for layer in model.layers:
            attn = layer.self_attn
            attn.rotary_emb = cnets.LlamaRotaryEmbedding(
                attn.head_dim, max_position_embeddings=attn.max_position_embeddings, base=theta)
    return model.float().eval()


def make_eagle1(out_dir: Path, *, vocab_size=256, hidden_size=64, intermediate_size=160, num_heads=4,
                num_kv_heads=2, num_layers=1, bias=True, rope_theta=10000.0, seed=0,
                embed: "np.ndarray | None" = None, save_embed: bool = False, fmt: str = "bin") -> Eagle1Ref:
    """Random-init eagle.model.cnets.Model (EAGLE-1/2 head: fc(concat(embed(tok), feature)) 2H->H, decoder
    layer(s) whose first layer has no input_layernorm, no final norm), saved like the official heads.

    Files in out_dir:
      * `pytorch_model.bin` (fmt="bin": `torch.save` of the state dict, what eagle-llm's EaModel loads)
        or `model.safetensors` (fmt="safetensors").
      * `config.json`: {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias",
        "hidden_act": "silu", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta",
        "rope_scaling": null, "max_position_embeddings", "pretraining_tp": 1, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range", "tie_word_embeddings": false,
        "torch_dtype": "float32", "use_cache": true}.
    Saved keys (see `eagle1_keys`), e.g. for num_layers=2, bias=True, save_embed=True:
      embed_tokens.weight, fc.weight, fc.bias,
      layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}.weight,
      layers.1.{input_layernorm, self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
                post_attention_layernorm}.weight.
    `embed_tokens.weight` is written only if save_embed=True (then the file also loads into eagle-llm
    with its strict `load_state_dict`); otherwise the embedding comes from the target and is available
    as `ref.embed`.  If `embed` is given it is the embedding.
    """
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": bool(bias), "hidden_act": "silu",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "num_hidden_layers": num_layers, "vocab_size": vocab_size,
        "rms_norm_eps": RMS_EPS, "rope_theta": float(rope_theta), "rope_scaling": None,
        "max_position_embeddings": MAX_POS, "pretraining_tp": 1, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2, "initializer_range": 0.02, "tie_word_embeddings": False, "torch_dtype": "float32",
        "use_cache": True,
    }
    model = build_eagle1_model(cfg)
    _randomize(model, seed, embed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not save_embed:
        del state["embed_tokens.weight"]
    weights_path = _save_state(state, out_dir, fmt)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return Eagle1Ref(model, out_dir, weights_path, cfg, sorted(state))


# ------------------------------------------------------------------------------------------------ EAGLE-3


@contextlib.contextmanager
def eager():
    """No grad, and specforge's `@torch.compile` functions run as plain Python (see module docstring)."""
    import torch

    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        yield


def _specforge_token_mappings(counts: dict[int, int], draft_vocab_size: int, vocab_size: int):
    """specforge's own `process_token_dict_to_mappings` (d2t int64 offsets, t2d bool).

    Workaround: specforge.data.preprocessing imports `datasets` at module level (not installed with
    --no-deps, unused by this function), so a stub module stands in for that import only.
    """
    import io
    from collections import Counter

    stub = None
    if "datasets" not in sys.modules:
        try:
            import datasets  # noqa: F401
        except ImportError:
            stub = types.ModuleType("datasets")
            stub.Dataset = type("Dataset", (), {})
            sys.modules["datasets"] = stub
    try:
        from specforge.data.preprocessing import process_token_dict_to_mappings
    finally:
        if stub is not None and sys.modules.get("datasets") is stub:
            del sys.modules["datasets"]
    with contextlib.redirect_stdout(io.StringIO()):  # it prints frequency statistics
        return process_token_dict_to_mappings(Counter(counts), draft_vocab_size, vocab_size)


class Eagle3Ref:
    """A specforge `LlamaForCausalLMEagle3` (fp32, eval) with its d2t/t2d set.

    Attributes: model, out_dir, weights_path, config (the config.json dict as saved), keys (saved keys),
    embed (np [vocab, H]), d2t (np int64 [draft_vocab]), t2d (np bool [vocab]).
    """

    def __init__(self, model, out_dir: Path, weights_path: Path, config: dict, keys: list[str]):
        self.model = model
        self.out_dir = out_dir
        self.weights_path = weights_path
        self.config = config
        self.keys = keys
        self.embed = model.embed_tokens.weight.detach().numpy().copy()
        self.d2t = model.d2t.detach().numpy().copy()
        self.t2d = model.t2d.detach().numpy().copy()

    def forward(self, aux_hidden: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One draft forward over T tokens with a plain causal mask, positions 0..T-1: aux_hidden [1,T,3*Ht]
        (target low|mid|high states concatenated), tokens [1,T]; returns (output hidden [1,T,H] pre-norm --
        the residual output of the midlayer, which EAGLE-3 recycles -- and draft logits [1,T,draft_vocab]
        = lm_head(norm(hidden))).

        The top-level `LlamaForCausalLMEagle3.forward(hidden_states, inputs_embeds, ...)` returns only
        norm(midlayer output) (no pre-norm hidden, no logits), so this follows specforge's training step
        (`specforge/algorithms/eagle3/model.py`, first TTT step), calling the model's own methods in its
        order: `project_hidden_states` (fc) -> `prepare_decoder_attention_mask` (causal, past 0) ->
        `embed_input_ids` -> `backbone` (the midlayer, with `cache_hidden=[[], []]` as the sdpa trainer
        passes) -> `compute_logits` (lm_head(norm(.)) since config norm_output defaults to True).
        """
        import torch

        m = self.model
        aux = torch.as_tensor(np.asarray(aux_hidden, dtype=np.float32))
        ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
        if aux.ndim != 3 or ids.ndim != 2 or aux.shape[:2] != ids.shape:
            raise ValueError(f"aux_hidden {tuple(aux.shape)} / tokens {tuple(ids.shape)}")
        bsz, seq, _ = aux.shape
        with eager():
            h = m.project_hidden_states(aux)
            position_ids = torch.arange(seq, dtype=torch.long).unsqueeze(0).view(-1, seq)
            mask = m.prepare_decoder_attention_mask(
                attention_mask=torch.ones((bsz, seq), dtype=torch.bool), hidden_states=h,
                batch_size=bsz, seq_length=seq, past_key_values_length=0)
            emb = m.embed_input_ids(ids).to(h.dtype)
            out = m.backbone(input_embeds=emb, hidden_states=h, cache_hidden=[[], []], attention_mask=mask,
                             position_ids=position_ids, past_key_values=None, use_cache=True)
            logits = m.compute_logits(out)
        return out.numpy().copy(), logits.numpy().copy()

    def d2t_map(self, draft_ids: np.ndarray) -> np.ndarray:
        """Target ids for draft ids, via the saved d2t (as specforge/SGLang do: id + d2t[id])."""
        d = np.asarray(draft_ids, dtype=np.int64)
        return d + self.d2t[d]


def make_eagle3(out_dir: Path, *, vocab_size=256, draft_vocab_size=64, hidden_size=64, intermediate_size=160,
                num_heads=4, num_kv_heads=2, rope_theta=10000.0, seed=0, target_hidden_size=None, embed=None,
                save_embed: bool = True, fmt: str = "safetensors") -> Eagle3Ref:
    """Random-init specforge LlamaForCausalLMEagle3 with a random d2t/t2d, saved as SpecForge exports it.

    Built the way specforge builds drafts: a draft config.json (like specforge's configs/*-eagle3.json)
    read by `AutoDraftModelConfig.from_file` (transformers' LlamaConfig) -> `AutoDraftModel.from_config`.
    d2t/t2d come from specforge's `process_token_dict_to_mappings` on random token counts (the
    `draft_vocab_size` most frequent ids, sorted ascending: d2t[i] = used[i] - i, int64; t2d[v] = v in used,
    bool); strictly increasing target ids within [0, vocab).

    Saved like `specforge.export` does: fmt="safetensors" -> `model.save_pretrained(out_dir,
    state_dict=...)` (model.safetensors + config.json), then `apply_legacy_rope_scaling` (adds top-level
    rope_theta next to transformers 5's rope_parameters); fmt="bin" -> the same config.json plus
    `torch.save(state_dict)` as pytorch_model.bin (the layout of the original yuhuili/EAGLE3-* heads).
    With save_embed=False the embedding is dropped as the SGLang exporter does (`"embed" not in key`).

    config.json keys (transformers 5.23 LlamaConfig serialization): architectures
    ["LlamaForCausalLMEagle3"], model_type "llama", draft_vocab_size, target_hidden_size (only if given),
    vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim,
    num_hidden_layers (1), rms_norm_eps, rope_theta, rope_parameters {"rope_theta", "rope_type": "default"},
    max_position_embeddings, hidden_act "silu", attention_bias false, mlp_bias false, pretraining_tp 1,
    pad_token_id 0, bos_token_id, eos_token_id, tie_word_embeddings false, dtype "float32", use_cache,
    initializer_range, attention_dropout, transformers_version.  No `eagle_config` (specforge writes none).
    Saved keys: see `eagle3_keys` -- d2t, t2d, fc.weight, norm.weight, lm_head.weight,
    midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight,
    midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    (+ embed_tokens.weight if save_embed).
    """
    import torch
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "num_hidden_layers": 1, "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size, "rms_norm_eps": RMS_EPS, "rope_theta": float(rope_theta),
        "max_position_embeddings": MAX_POS, "pad_token_id": 0, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_cache": True,
    }
    if target_hidden_size is not None:
        draft_cfg["target_hidden_size"] = target_hidden_size
    src = out_dir / "draft_config.train.json"
    src.write_text(json.dumps(draft_cfg, indent=2))
    with contextlib.redirect_stdout(sys.stderr):  # from_file prints a note about tie_word_embeddings
        config = AutoDraftModelConfig.from_file(str(src))
    src.unlink()
    model = AutoDraftModel.from_config(config).float().eval()

    _randomize(model, seed, embed)
    rng = np.random.default_rng(seed + 1)
    freqs = rng.permutation(vocab_size) + 1  # distinct counts: the top draft_vocab_size ids are unambiguous
    d2t, t2d = _specforge_token_mappings({i: int(freqs[i]) for i in range(vocab_size)}, draft_vocab_size,
                                         vocab_size)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if not save_embed:
        state = {k: v for k, v in state.items() if "embed" not in k.lower()}
    keys = sorted(state)
    if fmt == "safetensors":
        # (transformers 5's save_pretrained empties the state_dict it is given: pass a copy)
        model.save_pretrained(str(out_dir), state_dict=dict(state))
        weights_path = out_dir / "model.safetensors"
    elif fmt == "bin":
        model.config.save_pretrained(str(out_dir))
        weights_path = _save_state(state, out_dir, "bin")
    else:
        raise ValueError(f"fmt must be 'bin' or 'safetensors', got {fmt!r}")
    apply_legacy_rope_scaling(str(out_dir))
    saved_cfg = json.loads((out_dir / "config.json").read_text())
    return Eagle3Ref(model, out_dir, weights_path, saved_cfg, keys)


def load_eagle3_official(path: Path):
    """Reload a saved head (config.json + model.safetensors / pytorch_model.bin) the way specforge's exporter
    materializes a draft (`specforge.export.checkpoint_io.materialize_draft`): `AutoDraftModelConfig.from_file`
    -> `AutoDraftModel.from_config` -> `load_state_dict(strict=False)`, where only embed_tokens.weight may be
    missing (then it stays random: set it from the target).  fp32, eval.

    Not `LlamaForCausalLMEagle3.from_pretrained`: under transformers 5.23 that initializes the model on the
    meta device, and the non-persistent rotary buffers (inv_freq, cos_cached, sin_cached), computed in
    __init__ and absent from the checkpoint, come back as uninitialized memory -> NaN outputs.
    """
    import torch
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    path = Path(path)
    with contextlib.redirect_stdout(sys.stderr):
        config = AutoDraftModelConfig.from_file(str(path / "config.json"))
    model = AutoDraftModel.from_config(config)
    weights = path / "model.safetensors"
    if weights.exists():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("embed" not in k for k in missing):
        raise ValueError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    return model.float().eval()
