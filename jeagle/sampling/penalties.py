"""Sampling penalties on the device: repetition, frequency and presence penalties, `min_tokens` and
`logit_bias`, applied to the target's logits before the argmax or the sampler, the same way in
target-only decoding and in a speculative round's verify (so speculation stays lossless with them).

Per row (`PenaltyRows`, part of each decoder's device state):
    counts [R, V]      how often each token was emitted (the request's output so far, every emitted
                       token included: the newest, whose KV is not written yet, too)
    seen   [R, V]      the prompt's tokens (the repetition penalty covers prompt and output)
    frequency, presence, repetition [R]; min_tokens, prompt_len [R]; stop_ids [R, MAX_STOP] (what
    min_tokens holds back: EOS unless ignore_eos, and stop token ids); bias_ids / bias_values [R, MAX_LOGIT_BIAS]

At a position whose fed token sits at position p, a request has emitted g = p - prompt_len + 1
tokens; its logits there become, in this order (vLLM's and SGLang's definitions):
    repetition r: for tokens in the prompt or the output, logit / r if logit > 0 else logit · r
    frequency f, presence q: logit - f · count - q · [count > 0]
    logit_bias: logit + bias
    min_tokens m: stop tokens at -inf while g < m

The draft drafts under the same penalties (the row's counts, without the beam's own path: a guess,
never a correctness matter) so that it proposes what the penalized target will accept.
A speculative tree node also counts the draft tokens on its path (root excluded: it is emitted
already): the counts target-only decoding would have there if that path were accepted. Every
prefill writes its rows (the params, zero counts, the prompt's tokens) and applies them to the first
token; decode steps and rounds apply them and update the counts only in the executables compiled
`penalties=True`, which a batch runs when any of its requests has a penalty (`wants_penalties`):
for the others every parameter is neutral and the logits are unchanged bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

MAX_STOP = 8  # stop token ids per request the device checks (the round's finish check too)
MAX_LOGIT_BIAS = 300  # entries of logit_bias per request (OpenAI's limit)


@jax.tree_util.register_dataclass
@dataclass
class PenaltyRows:
    counts: jax.Array  # [R, V] int32
    seen: jax.Array  # [R, V] bool
    frequency: jax.Array  # [R] f32
    presence: jax.Array  # [R] f32
    repetition: jax.Array  # [R] f32
    min_tokens: jax.Array  # [R] int32
    prompt_len: jax.Array  # [R] int32
    stop_ids: jax.Array  # [R, MAX_STOP] int32, -1 padded
    bias_ids: jax.Array  # [R, MAX_LOGIT_BIAS] int32, -1 padded
    bias_values: jax.Array  # [R, MAX_LOGIT_BIAS] f32


@jax.tree_util.register_dataclass
@dataclass
class PenaltyInputs:
    """A prefill's per-row penalty parameters [B] (`penalty_inputs`)."""
    frequency: jax.Array
    presence: jax.Array
    repetition: jax.Array
    min_tokens: jax.Array
    stop_ids: jax.Array  # [B, MAX_STOP]
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS]
    bias_values: jax.Array  # [B, MAX_LOGIT_BIAS]
    prompt_len: jax.Array  # [B] the prompt's length: tokens at later positions (a resumed request's) are output


def init_penalty_rows(num_rows: int, vocab: int) -> PenaltyRows:
    r = num_rows
    return PenaltyRows(counts=jnp.zeros((r, vocab), jnp.int32), seen=jnp.zeros((r, vocab), bool),
                       frequency=jnp.zeros((r,), jnp.float32), presence=jnp.zeros((r,), jnp.float32),
                       repetition=jnp.ones((r,), jnp.float32), min_tokens=jnp.zeros((r,), jnp.int32),
                       prompt_len=jnp.zeros((r,), jnp.int32), stop_ids=jnp.full((r, MAX_STOP), -1, jnp.int32),
                       bias_ids=jnp.full((r, MAX_LOGIT_BIAS), -1, jnp.int32),
                       bias_values=jnp.zeros((r, MAX_LOGIT_BIAS), jnp.float32))


def penalty_shapes(b: int) -> PenaltyInputs:
    s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))  # noqa: E731
    return PenaltyInputs(s((b,), jnp.float32), s((b,), jnp.float32), s((b,), jnp.float32), s((b,)),
                         s((b, MAX_STOP)), s((b, MAX_LOGIT_BIAS)), s((b, MAX_LOGIT_BIAS), jnp.float32), s((b,)))


def penalty_inputs(reqs, b: int) -> PenaltyInputs:
    """The prefill inputs of `reqs`, padded to b rows with neutral values."""
    n = len(reqs)
    out = PenaltyInputs(frequency=np.zeros(b, np.float32), presence=np.zeros(b, np.float32),
                        repetition=np.ones(b, np.float32), min_tokens=np.zeros(b, np.int32),
                        stop_ids=np.full((b, MAX_STOP), -1, np.int32),
                        bias_ids=np.full((b, MAX_LOGIT_BIAS), -1, np.int32),
                        bias_values=np.zeros((b, MAX_LOGIT_BIAS), np.float32), prompt_len=np.zeros(b, np.int32))
    for i, r in enumerate(reqs[:n]):
        p = r.params
        out.prompt_len[i] = len(r.prompt)
        out.frequency[i], out.presence[i], out.repetition[i] = p.frequency_penalty, p.presence_penalty, \
            p.repetition_penalty
        out.min_tokens[i] = p.min_tokens
        if p.min_tokens:
            stops = sorted(r.eos)
            out.stop_ids[i, :len(stops)] = stops  # checked against MAX_STOP when the request was made
        for j, (tok, bias) in enumerate(p.logit_bias):
            out.bias_ids[i, j], out.bias_values[i, j] = tok, bias
    return out


def wants_penalties(reqs) -> bool:
    """Whether a decode step or round runs the executables that apply penalties."""
    return any(r.params.penalized for r in reqs)


def prefill_rows(rows: PenaltyRows, row_ids, x: PenaltyInputs, tokens, lengths, positions) -> PenaltyRows:
    """The rows of a prefill's requests: their params, their prompts' tokens seen, and as counts the
    tokens past the prompt (a request resumed after a retraction prefills its output so far too).
    tokens [B, T] sit at `positions` [B, T]; a prefill that starts past position 0 (a cached prefix)
    only runs for requests without penalties, whose rows are neutral anyway."""
    b, t = tokens.shape
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    prompt = positions < x.prompt_len[:, None]
    seen = jnp.zeros((b, rows.seen.shape[1]), bool).at[jnp.arange(b)[:, None], tokens].max(valid & prompt)
    counts = jnp.zeros((b, rows.counts.shape[1]), jnp.int32).at[jnp.arange(b)[:, None], tokens].add(
        (valid & ~prompt).astype(jnp.int32))
    new = PenaltyRows(counts=counts, seen=seen, frequency=x.frequency,
                      presence=x.presence, repetition=x.repetition, min_tokens=x.min_tokens, prompt_len=x.prompt_len,
                      stop_ids=x.stop_ids, bias_ids=x.bias_ids, bias_values=x.bias_values)
    return jax.tree.map(lambda old, v: old.at[row_ids].set(v), rows, new)


def gather(rows: PenaltyRows, row_ids) -> PenaltyRows:
    return jax.tree.map(lambda a: a[row_ids], rows)


def apply(logits, g: PenaltyRows, generated, extra_counts=None, vocab_ids=None):
    """Penalized logits. logits [B, ..., V] fp32; g: the batch's rows (`gather`); generated [B, ...]:
    tokens emitted before each position; extra_counts [B, ..., V] (int): tokens to count besides the
    row's (a tree node's path); vocab_ids [V'] (target ids): logits over another vocabulary, entry i
    standing for target token vocab_ids[i] (an EAGLE-3 head's draft vocabulary)."""
    x = logits.astype(jnp.float32)
    lead = x.ndim - 2  # the axes between the batch and the vocabulary
    per_row = lambda a: a.reshape(a.shape[:1] + (1,) * lead + a.shape[1:])  # noqa: E731  [B, (1,)..., ...]
    pick = (lambda a: a) if vocab_ids is None else (lambda a: a[:, vocab_ids])  # noqa: E731
    counts = per_row(pick(g.counts))
    if extra_counts is not None:
        counts = counts + extra_counts
    out = counts > 0
    rep = per_row(g.repetition)[..., None]
    x = jnp.where(per_row(pick(g.seen)) | out, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - per_row(g.frequency)[..., None] * counts - per_row(g.presence)[..., None] * out
    b, v = g.counts.shape
    bias = jnp.zeros((b, v), jnp.float32).at[jnp.arange(b)[:, None], jnp.maximum(g.bias_ids, 0)].add(
        jnp.where(g.bias_ids >= 0, g.bias_values, 0.0))
    x = x + per_row(pick(bias))
    stop = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], jnp.maximum(g.stop_ids, 0)].max(g.stop_ids >= 0)
    hold = (generated < per_row(g.min_tokens))[..., None]
    return jnp.where(hold & per_row(pick(stop)), -jnp.inf, x)


def add_tokens(rows: PenaltyRows, row_ids, tokens) -> PenaltyRows:
    """Count the emitted `tokens` [B, W] (-1: none) in the rows `row_ids`."""
    b, w = tokens.shape
    counts = rows.counts.at[jnp.broadcast_to(row_ids[:, None], (b, w)), jnp.maximum(tokens, 0)].add(
        (tokens >= 0).astype(jnp.int32))
    return PenaltyRows(counts, rows.seen, rows.frequency, rows.presence, rows.repetition, rows.min_tokens,
                       rows.prompt_len, rows.stop_ids, rows.bias_ids, rows.bias_values)


def path_counts(tokens, mask, vocab: int):
    """Each tree node's path tokens as counts [B, N, V]: node n counts the tokens of its ancestors and
    itself (mask [B, N, N], n's row), the root (node 0) excluded."""
    b, n = tokens.shape
    m = (mask.astype(bool) & (jnp.arange(n) > 0)[None, None, :]).astype(jnp.int32)  # [B, N(node), N(ancestor)]
    bi = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, n, n))
    ni = jnp.broadcast_to(jnp.arange(n)[None, :, None], (b, n, n))
    ti = jnp.broadcast_to(tokens[:, None, :], (b, n, n))
    return jnp.zeros((b, n, vocab), jnp.int32).at[bi, ni, ti].add(m)
