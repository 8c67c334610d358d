"""Log-probabilities of emitted tokens: computed on the device next to the tokens, packed into the
same int32 result (one device→host copy), unpacked on the host.

What is reported is the target's own distribution at the position a token was emitted from: the
log-softmax of the target's fp32 logits (before temperature, top-k/top-p and penalties, as vLLM's
default `raw_logprobs` and OpenAI's API report), for the emitted token and the `LOGPROB_TOP` most
likely tokens. A speculative round takes them from the verify forward's logits at the accepted
path's nodes, which are the logits target-only decoding computes at those positions, so the two
report the same numbers (to fp32 rounding of two forwards).

Packed layout, per emitted token: [logprob (f32 bits) | top ids (LOGPROB_TOP) | top logprobs (f32
bits, LOGPROB_TOP)] = `LOGPROB_COLUMNS` int32 columns; a result with W tokens per row appends W of
these blocks (`pack`), the host splits them off (`unpack`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jeagle.kernels.topk import top_k
from jeagle.parallel.sharding import whole_vocab

LOGPROB_TOP = 20  # OpenAI's largest top_logprobs; a request asks for any k <= this
LOGPROB_COLUMNS = 1 + 2 * LOGPROB_TOP
BLOCK_BYTES = 4 * LOGPROB_COLUMNS  # one token's packed block as bytes (`to_bytes`)


TOPK_BLOCK = 128  # vocabulary entries per block of `top_k_blocked`


def top_k_blocked(x, k: int):
    """`jax.lax.top_k(x, k)` over the last axis in two small steps: the k blocks of TOPK_BLOCK entries
    with the largest maxima hold the k largest entries (a block outside them has a maximum below k
    others), so a top-k of the block maxima, a gather of those blocks and a top-k of k·TOPK_BLOCK
    candidates give the same values (ties may pick other, equal entries). XLA's GPU top-k over a
    whole 49k vocabulary is a sort: at batch 48 it cost target-only decoding 22% of its throughput
    (bench/HISTORY.md, 2026-11-25). Both small top-ks go through `jeagle.kernels.topk.top_k` (the
    one-pass kernel where it applies: XLA lowered them to sorts of whole rows)."""
    v = x.shape[-1]
    nb = -(-v // TOPK_BLOCK)
    if nb <= 2 * k:
        return top_k(x, k)
    lead = x.shape[:-1]
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, nb * TOPK_BLOCK - v)], constant_values=-jnp.inf)
    blocks = xp.reshape(lead + (nb, TOPK_BLOCK))
    _, best = top_k(blocks.max(-1), k)  # [..., k] block ids
    cand = jnp.take_along_axis(blocks, best[..., None], -2).reshape(lead + (k * TOPK_BLOCK,))
    vals, j = top_k(cand, k)
    ids = jnp.take_along_axis(best, j // TOPK_BLOCK, -1) * TOPK_BLOCK + j % TOPK_BLOCK
    return vals, ids


def token_logprobs(logits, tokens):
    """logits [..., V], tokens [...] (negative: none) → packed int32 [..., LOGPROB_COLUMNS]."""
    x = whole_vocab(logits.astype(jnp.float32))
    top_v, top_i = top_k_blocked(x, LOGPROB_TOP)
    # log-sum-exp as jax.nn.logsumexp computes it, its max the top-k's first value (one pass fewer over
    # the [rows, V] logits than a max of its own)
    m = top_v[..., 0]
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    lse = jnp.log(jnp.sum(jnp.exp(x - m[..., None]), -1)) + m
    chosen = jnp.take_along_axis(x, jnp.maximum(tokens, 0)[..., None], -1)[..., 0] - lse
    top_lp = top_v - lse[..., None]
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    return jnp.concatenate([bits(chosen)[..., None], top_i.astype(jnp.int32), bits(top_lp)], -1)


PROMPT_CHUNK = 256  # prompt positions per lm_head chunk (their logits [B, chunk, V] live one chunk at a time)


def prompt_logprobs(hidden, head, tokens):
    """The prompt tokens' logprobs from a prefill: hidden [B, T, H] (final-normed), the lm_head [V, H]
    and tokens [B, T] → packed [B, T, LOGPROB_COLUMNS], where position p holds token p's logprob
    given the tokens before it (position 0: zeros). The logits are computed PROMPT_CHUNK positions
    at a time, so a long prompt never holds [B, T, V] at once."""
    b, t, _ = hidden.shape
    chunk = min(PROMPT_CHUNK, t)
    n = -(-t // chunk)
    nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, n * chunk - t + 1)))  # the token each position predicts
    hid = jnp.pad(hidden, ((0, 0), (0, n * chunk - t), (0, 0)))

    def one(i):
        x = jax.lax.dynamic_slice_in_dim(hid, i * chunk, chunk, 1)
        logits = jnp.einsum("bth,vh->btv", x, head, preferred_element_type=jnp.float32)
        return token_logprobs(logits, jax.lax.dynamic_slice_in_dim(nxt, i * chunk, chunk, 1))

    blocks = jax.lax.map(one, jnp.arange(n))  # [n, B, chunk, C]
    blocks = jnp.moveaxis(blocks, 0, 1).reshape(b, n * chunk, LOGPROB_COLUMNS)[:, : t - 1]
    return jnp.concatenate([jnp.zeros((b, 1, LOGPROB_COLUMNS), jnp.int32), blocks], 1)


def pack(result, logprobs):
    """`result` [B, C] with the packed logprobs [B, W, LOGPROB_COLUMNS] of its W tokens appended."""
    return jnp.concatenate([result, logprobs.reshape(logprobs.shape[0], -1)], 1)


class TokenLogprob:
    """One emitted token's log-probability and the most likely tokens at its position: a view of its
    packed block, read only when asked (a batch of 48 emits ~150 tokens per round: building them must
    cost the host next to nothing)."""
    __slots__ = ("_row",)

    def __init__(self, row: np.ndarray):
        self._row = row  # [LOGPROB_COLUMNS] int32, contiguous

    @property
    def logprob(self) -> float:
        return float(self._row[:1].view(np.float32)[0])

    @property
    def top_ids(self) -> np.ndarray:  # [LOGPROB_TOP] int32, most likely first
        return self._row[1:1 + LOGPROB_TOP]

    @property
    def top_logprobs(self) -> np.ndarray:  # [LOGPROB_TOP] float32
        return self._row[1 + LOGPROB_TOP:].view(np.float32)

    def top(self, k: int) -> list[tuple[int, float]]:
        return list(zip(self.top_ids[:k].tolist(), self.top_logprobs[:k].tolist()))  # Python ints and floats

    def __repr__(self) -> str:
        return f"TokenLogprob({self.logprob:.4f}, top={self.top(3)}...)"


def split(host: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A host result [..., C + width·LOGPROB_COLUMNS] → (the result [..., C], its logprob blocks
    [..., width, LOGPROB_COLUMNS])."""
    extra = width * LOGPROB_COLUMNS
    head, tail = host[..., :-extra], host[..., -extra:]
    return head, tail.reshape(tail.shape[:-1] + (width, LOGPROB_COLUMNS))


def unpack(blocks: np.ndarray) -> list[TokenLogprob]:
    """Packed blocks [W, LOGPROB_COLUMNS] (int32) → one TokenLogprob each (views, no copies)."""
    blocks = np.ascontiguousarray(blocks, np.int32)
    return [TokenLogprob(row) for row in blocks]


class LogprobRows:
    """One request's emitted tokens' packed blocks, as the int32 chunks [w, LOGPROB_COLUMNS] that
    arrived (`append`, one per delivery): what the engine thread keeps per token is a slice, not a
    TokenLogprob. `tokens()` builds the TokenLogprobs (views of one concatenated array) when a user
    reads them (`Output.logprobs`); `tail_bytes(n)` is the last n blocks as bytes (a served token
    event). Chunks are views of a decoder's host result or copies of it; nothing writes them."""
    __slots__ = ("_chunks", "_n", "_list")

    def __init__(self, blocks: np.ndarray | None = None):
        self._chunks: list[np.ndarray] = []
        self._n = 0
        self._list: list[TokenLogprob] | None = None  # `tokens()`'s, while no block was appended since
        if blocks is not None:
            self.append(blocks)

    @classmethod
    def of(cls, lps) -> "LogprobRows":
        """From TokenLogprobs (a list), packed blocks [w, LOGPROB_COLUMNS] or another LogprobRows."""
        if isinstance(lps, LogprobRows):
            return cls(lps.array())
        return cls(stack(lps) if isinstance(lps, list) else lps)

    def append(self, blocks) -> None:
        """Blocks [w, LOGPROB_COLUMNS] int32 (a list of TokenLogprobs is stacked first)."""
        if isinstance(blocks, list):
            blocks = stack(blocks)
        if len(blocks):
            self._chunks.append(blocks)
            self._n += len(blocks)
            self._list = None

    def __len__(self) -> int:
        return self._n

    def array(self) -> np.ndarray:
        """All blocks [n, LOGPROB_COLUMNS] int32, contiguous (the chunks are joined into one, once)."""
        if len(self._chunks) != 1 or not self._chunks[0].flags.c_contiguous:
            joined = (np.ascontiguousarray(np.concatenate(self._chunks), np.int32) if self._chunks
                      else np.zeros((0, LOGPROB_COLUMNS), np.int32))
            self._chunks = [joined] if len(joined) else []
            return joined
        return self._chunks[0]

    def tokens(self) -> list[TokenLogprob]:
        """One TokenLogprob per block, in order (the same list while nothing is appended)."""
        if self._list is None or len(self._list) != self._n:
            self._list = unpack(self.array())
        return self._list

    def tail_bytes(self, n: int) -> bytes:
        """The last n blocks as bytes (`to_bytes` of the last n TokenLogprobs)."""
        if n <= 0:
            return b""
        chunks = self._chunks
        if chunks and len(chunks[-1]) == n:  # the usual case: the last delivery's blocks
            return chunks[-1].tobytes()
        parts, need = [], n
        for c in reversed(chunks):
            parts.append(c[-need:].tobytes() if len(c) > need else c.tobytes())
            need -= min(need, len(c))
            if not need:
                break
        return b"".join(reversed(parts))

    def __eq__(self, other) -> bool:
        return isinstance(other, LogprobRows) and np.array_equal(self.array(), other.array())

    def __repr__(self) -> str:
        return f"LogprobRows({self._n} tokens)"


def to_bytes(lps: list[TokenLogprob]) -> bytes:
    """TokenLogprobs → their packed blocks as bytes (`from_bytes`'s inverse): what a served token event
    carries (~0.1 µs a token; it pickles as one copy, and `jeagle.serve.protocol` reads the numbers
    with `struct`, not one numpy call per token)."""
    return b"".join([lp._row.tobytes() for lp in lps])


def from_bytes(packed: bytes) -> list[TokenLogprob]:
    """`to_bytes`'s output → one TokenLogprob each (views of one read-only array)."""
    return unpack(np.frombuffer(packed, np.int32).reshape(-1, LOGPROB_COLUMNS))


def stack(lps: list[TokenLogprob]) -> np.ndarray:
    """TokenLogprobs → their packed blocks [W, LOGPROB_COLUMNS] in one array (`unpack`'s inverse): how
    they cross to another process in one piece instead of one pickled object per token."""
    if not lps:
        return np.zeros((0, LOGPROB_COLUMNS), np.int32)
    return np.stack([lp._row for lp in lps])
