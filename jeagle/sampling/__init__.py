"""Sampling parameters and the on-device sampler (greedy, temperature, top-k, top-p, seeded).

Each row draws with the key `fold_in(key(seed), position)`, so a request's sampled tokens depend only
on its seed and the positions, never on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jeagle.sampling.logprobs import LOGPROB_TOP
from jeagle.sampling.penalties import MAX_LOGIT_BIAS
from jeagle.parallel.sharding import whole_vocab


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # None = drawn at random per request
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Log-probabilities of the emitted tokens (jeagle/sampling/logprobs.py): None = off, k = each token's
    # logprob and the k most likely tokens at its position (0 <= k <= LOGPROB_TOP).
    logprobs: int | None = None
    prompt_logprobs: bool = False  # also the prompt tokens' logprobs (top `logprobs`), from the prefill
    # Penalties (jeagle/sampling/penalties.py): neutral by default.
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI's
    presence_penalty: float = 0.0  # [-2, 2], OpenAI's
    repetition_penalty: float = 1.0  # > 0 (1: off), over prompt and output tokens
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) held back until this many new tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    # Structured output: a compiled `jeagle.sampling.grammar.Grammar` (JSON schema, regex, EBNF) the tokens must follow.
    grammar: object | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= LOGPROB_TOP:
            raise ValueError(f"logprobs must be in [0, {LOGPROB_TOP}] (None: off), got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (the top count)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        for tok, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias for token {tok} must be in [-100, 100], got {bias}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (decode steps then run the penalty executables)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row: seed [B] uint32, positions [B] int32."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def sample(logits, seeds, positions, temperature, top_k, top_p, *, all_greedy: bool) -> jax.Array:
    """logits [B, V] fp32 → tokens [B] int32. Rows with temperature 0 take the argmax."""
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy_tok
    v = logits.shape[-1]
    x = whole_vocab(logits / jnp.maximum(temperature, 1e-6)[:, None])  # whole rows under a tp mesh
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    sorted_x = jnp.where(keep, sorted_x, -jnp.inf)
    probs = whole_vocab(jax.nn.softmax(sorted_x, axis=-1))
    # top-p keeps the smallest prefix whose mass reaches p: a token stays if the mass before it < p.
    before = jnp.cumsum(probs, axis=-1) - probs
    sorted_x = jnp.where((before < top_p[:, None]) | (rank == 0), sorted_x, -jnp.inf)
    keys = row_keys(seeds, positions)
    choice = jax.vmap(jax.random.categorical)(keys, sorted_x)
    tok = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature <= 0, greedy_tok, tok)
