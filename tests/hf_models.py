"""Tiny random-weight Hugging Face models (Llama with llama3 RoPE scaling, Qwen2, Qwen3), saved to disk."""

from __future__ import annotations

from pathlib import Path

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def make_hf_model(arch: str, out: Path, *, seed: int = 0, tie: bool = False, max_shard_size: str | None = None):
    """Build a random `arch` model ("llama", "qwen2", "qwen3"), save it to `out`, return the torch model."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = tf.LlamaConfig(**TINY, tie_word_embeddings=tie, rope_theta=50000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=tie, rope_theta=1e6)
        model = tf.Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=tie)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init leaves biases and norms at 0/1; perturb them so the parity test exercises them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.config.eos_token_id = None
    model = model.eval()
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    return model
