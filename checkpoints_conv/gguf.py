"""GGUF (llama.cpp) Llama / Qwen2 / Qwen3 → jeagle, dequantising with the `gguf` package.

llama.cpp's converter permutes the q and k rows of Llama-architecture models into the interleaved
RoPE layout (pairs (2i, 2i+1) rotate together); jeagle uses HF's rotate-half layout (pairs
(i, i + D/2)), so those rows are un-permuted here. Qwen2/Qwen3 GGUFs are written without the
permutation and are taken as they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from checkpoints_conv.common import assemble_target
from jeagle.loading.checkpoint import CheckpointError, save_checkpoint
from jeagle.config import ConfigError, ModelConfig, RopeScaling, parse_rope_scaling

# Tensor types we dequantise (through gguf.quants); anything else is refused by name.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# canonical name → GGUF name
GGUF_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "o_bias": "attn_output.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "down": "ffn_down.weight",
}


def gguf_name(canonical: str) -> str:
    if canonical in GGUF_NAMES:
        return GGUF_NAMES[canonical]
    layer, name = canonical.split(".", 1)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[name]}"


def open_gguf(path: Path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable GGUF file: {e}") from e


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: interleaved pairs → rotate-half halves, per head."""
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(reader, path: Path, dtype: str) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ConfigError(f"{path}: unsupported architecture {arch!r}; jeagle supports {sorted(GGUF_ARCHS)}")

    def key(name, default=None, required=True):
        v = field(reader, f"{arch}.{name}", default)
        if v is None and required:
            raise CheckpointError(f"{path}: metadata {arch}.{name} is missing")
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = key("vocab_size", None, required=False) or (len(tokens) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    if vocab is None:
        vocab = next(t.shape[1] for t in reader.tensors if t.name == "token_embd.weight")
    scaling = None
    if field(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
        scaling = parse_rope_scaling({
            "rope_type": field(reader, f"{arch}.rope.scaling.type"),
            "factor": field(reader, f"{arch}.rope.scaling.factor", 1.0),
        })
    if "rope_freqs.weight" in names:
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = RopeScaling(kind="freq_factors", freq_factors=tuple(float(x) for x in np.asarray(t.data).ravel()))
    eos = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        arch=GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads, required=False) or hidden // heads),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        dtype=dtype,
        name=path.stem,
    )


def dequantize_tensor(t, path: Path) -> np.ndarray:
    import gguf.quants

    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise CheckpointError(f"{path}: tensor {t.name} has GGUF type {qtype}, which jeagle does not "
                              f"dequantise (supported: {', '.join(SUPPORTED_TYPES)})")
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    # GGUF lists dims fastest-first; numpy's row-major shape is the reverse.
    return np.asarray(x, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


def convert_gguf(src, out, *, dtype: str = "bfloat16", progress: bool = True) -> Path:
    src, out = Path(src), Path(out)
    reader = open_gguf(src)
    cfg = read_gguf_config(reader, src, dtype)
    tensors = {t.name: t for t in reader.tensors}
    bar = tqdm(total=len(tensors), desc="dequantising", unit="t", disable=not progress, file=sys.stderr)
    permute = cfg.arch == "llama"

    def get(canonical: str):
        name = gguf_name(canonical)
        t = tensors.get(name)
        if t is None:
            return None
        x = dequantize_tensor(t, src)
        bar.update(1)
        if permute and canonical.endswith(".q"):
            x = unpermute_rows(x, cfg.num_heads)
        elif permute and canonical.endswith(".k"):
            x = unpermute_rows(x, cfg.num_kv_heads)
        return x

    params = assemble_target(cfg, get, source=str(src))
    bar.close()
    save_checkpoint(out, cfg, params, source=str(src))
    from checkpoints_conv.gguf_tokenizer import save_tokenizer, tokenizer_from_gguf

    tok, tok_cfg = tokenizer_from_gguf(reader)
    save_tokenizer(tok, tok_cfg, out)
    return out
