"""EAGLE-3's reduced draft vocabulary, chosen by token frequency in the training data.

The draft predicts over `draft_vocab_size` target tokens only: the most frequent response tokens (the
loss covers responses), the target's end-of-sequence tokens always among them. Draft id i stands for
target id `d2t[i] + i` (the offset convention of EAGLE-3 checkpoints); `t2d` marks the target ids
that have a draft id. Draft ids are assigned in increasing target-id order.
"""

from __future__ import annotations

import numpy as np


def draft_vocab(data, vocab_size: int, draft_vocab_size: int, *, always=()) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [Vd] int32 offsets, t2d [V] bool) from the response-token counts of `data` (a DraftData)."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocabulary size {draft_vocab_size} must be in 1..{vocab_size}")
    counts = np.bincount(data.response_tokens().astype(np.int64), minlength=vocab_size)[:vocab_size]
    forced = [t for t in always if 0 <= t < vocab_size][:draft_vocab_size]
    counts[forced] = counts.max() + 1
    # Most frequent first; ties (unseen tokens included) by id, so the choice is deterministic.
    order = np.lexsort((np.arange(vocab_size), -counts))
    used = np.sort(order[:draft_vocab_size])
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int32)
    t2d = np.zeros(vocab_size, bool)
    t2d[used] = True
    return d2t, t2d


def coverage(data, t2d: np.ndarray) -> float:
    """Share of response tokens the draft vocabulary can express."""
    ids = data.response_tokens().astype(np.int64)
    return float(t2d[ids].sum()) / max(len(ids), 1)


def remap_lm_head(lm_head: np.ndarray, old_d2t: np.ndarray, new_d2t: np.ndarray) -> np.ndarray:
    """A trained EAGLE-3 head's output rows for another draft vocabulary: a token in both keeps its
    trained row, a new one starts at zero (logit 0). Not from the target's own head row, as a fresh head
    starts: next to trained rows those win the argmax far too often (the shipped SmolLM2 head with 1,000
    of its 8,192 tokens swapped for others: accept length 1.00 with target rows, 1.31 with target rows at
    half the trained rows' norm, 1.74 with zero rows, 2.31 unswapped; CPU, 6 MT-bench prompts,
    bench/probes/vocab_swap.py), while a
    zero row grows from the training data's gradient like a zero-initialised output layer."""
    old_used = np.arange(len(old_d2t)) + np.asarray(old_d2t)
    new_used = np.arange(len(new_d2t)) + np.asarray(new_d2t)
    out = np.zeros((len(new_used), lm_head.shape[1]), np.float32)
    row_of = {int(t): i for i, t in enumerate(old_used)}
    for j, t in enumerate(new_used):
        i = row_of.get(int(t))
        if i is not None:
            out[j] = lm_head[i]
    return out
