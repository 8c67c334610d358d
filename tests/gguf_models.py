"""A tiny llama-architecture GGUF written the way llama.cpp writes one (q/k rows permuted into the
interleaved RoPE layout), with every tensor type jeagle must dequantise, from a random HF model."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Every 2-D tensor's inner dimension is a multiple of 256, so K-quants fit.
TINY_256 = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False)

# (canonical HF suffix, GGUF suffix, type per layer)
LAYER_TENSORS = [
    ("self_attn.q_proj.weight", "attn_q.weight", ("Q8_0", "Q5_1")),
    ("self_attn.k_proj.weight", "attn_k.weight", ("Q4_0", "BF16")),
    ("self_attn.v_proj.weight", "attn_v.weight", ("Q4_1", "Q6_K")),
    ("self_attn.o_proj.weight", "attn_output.weight", ("Q5_0", "Q4_K")),
    ("mlp.gate_proj.weight", "ffn_gate.weight", ("Q4_K", "Q8_0")),
    ("mlp.up_proj.weight", "ffn_up.weight", ("Q6_K", "F32")),
    ("mlp.down_proj.weight", "ffn_down.weight", ("F16", "Q4_1")),
    ("input_layernorm.weight", "attn_norm.weight", ("F32", "F32")),
    ("post_attention_layernorm.weight", "ffn_norm.weight", ("F32", "F32")),
]


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation (rotate-half → interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random but well-scaled Q4_K / Q6_K blocks (gguf-py cannot quantise K-quants)."""
    n_blocks = cols // 256
    if qtype == "Q4_K":  # d f16, dmin f16, 12 B scales, 128 B quants
        blk = rng.integers(0, 256, (rows, n_blocks, 144), dtype=np.uint8)
        blk[..., 0:2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
        blk[..., 2:4] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    else:  # Q6_K: 128 B low bits, 64 B high bits, 16 int8 scales, d f16
        blk = rng.integers(0, 256, (rows, n_blocks, 210), dtype=np.uint8)
        blk[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blk.reshape(rows, n_blocks * blk.shape[-1])


def encode_tensor(x: np.ndarray, qtype: str, rng):
    """(data, raw_dtype) for GGUFWriter.add_tensor; K-quants get random blocks (returned dequantised too)."""
    import gguf
    from gguf.quants import quantize

    q = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return x.astype(np.float32), None
    if qtype == "F16":
        return x.astype(np.float16), None
    if qtype in ("Q4_K", "Q6_K"):
        return _random_k_blocks(qtype, *x.shape, rng), q
    return quantize(x.astype(np.float32), q), q


def write_tiny_gguf(hf_model, path: Path, *, seed: int = 0, override_type: dict[str, str] | None = None) -> Path:
    """Write `hf_model` (a tiny LlamaForCausalLM of TINY_256) as a llama-arch GGUF. K-quant tensors
    hold random blocks, so the file (not the HF model) is the ground truth for parity tests."""
    import gguf

    rng = np.random.default_rng(seed)
    cfg = hf_model.config
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    # A byte-level vocabulary of the 256 single bytes (no merges): enough for a working tokenizer.
    from checkpoints_conv.gguf_tokenizer import _bytes_to_unicode as bytes_to_unicode

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([bytes_to_unicode()[b] for b in range(256)])
    w.add_token_types([1] * 256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    override = override_type or {}
    tensors = [("model.embed_tokens.weight", "token_embd.weight", "Q8_0"),
               ("model.norm.weight", "output_norm.weight", "F32"),
               ("lm_head.weight", "output.weight", "Q6_K")]
    for i in range(cfg.num_hidden_layers):
        for hf_suffix, gguf_suffix, types in LAYER_TENSORS:
            tensors.append((f"model.layers.{i}.{hf_suffix}", f"blk.{i}.{gguf_suffix}", types[i % 2]))
    for hf_name, gguf_name, qtype in tensors:
        qtype = override.get(gguf_name, qtype)
        x = sd[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            x = permute_rows(x, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            x = permute_rows(x, cfg.num_key_value_heads)
        if qtype == "IQ4_NL":  # a type jeagle refuses: 18-byte blocks of 32 values
            data, raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // 32 * 18), dtype=np.uint8), \
                gguf.GGMLQuantizationType.IQ4_NL
        else:
            data, raw = encode_tensor(x, qtype, rng)
        if raw is None:
            w.add_tensor(gguf_name, data)
        else:
            w.add_tensor(gguf_name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
