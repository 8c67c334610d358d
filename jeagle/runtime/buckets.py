"""The one place for buckets: the padded batch sizes and lengths executables are compiled for, how a
batch is planned onto them, and how its inputs are padded and its results trimmed.

    batch         decode / round batch sizes (SGLang's capture list by default)
    prefill_batch the batch sizes of prefill (a subset: a prefill is one call per admitted group)
    prefill_len   prompt-length buckets (`prefill_length_buckets`: x4 steps up to 1,024, then x2)
    kv            prefix-length buckets of decode / round (one, the context, when the paged-attention
                  kernel serves every attention; else powers of 2)
    contexts      what a prefill after a prefix-cache hit attends over (one, the context, when the
                  kernel's causal form serves prefills; else the prompt-length buckets)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


def pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo·factor, lo·factor², ... below hi, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(out)


# Prompt-length buckets grow x4 up to here, then x2: a prefill's padded positions cost compute (and
# attention over them, quadratically: a 1,300-token prefill of SmolLM2 spends 13-15 ms on an H100,
# about half of it in the attention's masked softmax; bench/HISTORY.md, 2026-11-26), which for long
# prompts outweighs the compile time of one more bucket. The context of a prefill after a prefix-cache
# hit uses the same table. (Not timed against x4 buckets.)
PREFILL_X4_UNTIL = 1024


def prefill_length_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, lo·4, lo·16, ... while below PREFILL_X4_UNTIL, then doubling, then hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 4 if b < PREFILL_X4_UNTIL else 2
    out.append(hi)
    return tuple(out)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def default_batch_buckets(max_batch: int) -> tuple[int, ...]:
    """SGLang's capture list (1..8, 10..32 step 2, 40..64 step 4, 72..256 step 8, then step 16)."""
    sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
    sizes += list(range(272, max(max_batch, 256) + 16, 16))
    out = [s for s in sizes if s < max_batch] + [max_batch]
    return tuple(sorted(set(out)))


def batch_buckets(max_reqs: int, config) -> tuple[int, ...]:
    """The batch buckets: --buckets as given, exact sizes with --disable-padding, else SGLang's list
    capped by --max-bucket; the largest always covers max_batch_size."""
    if config.disable_padding:
        return tuple(range(1, max_reqs + 1))
    if config.batch_buckets:
        out = tuple(sorted(set(config.batch_buckets)))
        if out[0] < 1:
            raise ValueError(f"batch buckets must be >= 1, got {out}")
        if out[-1] < max_reqs:
            raise ValueError(f"largest batch bucket {out[-1]} < max running requests {max_reqs}")
        return out
    out = default_batch_buckets(max_reqs)
    if config.max_bucket is not None:
        if config.max_bucket < 1:
            raise ValueError(f"--max-bucket must be >= 1, got {config.max_bucket}")
        out = tuple(b for b in out if b <= config.max_bucket)
        if not out or out[-1] < max_reqs:
            raise ValueError(f"--max-bucket {config.max_bucket} < max running requests {max_reqs}: a full batch "
                             "would have no bucket")
    return out


def prefill_batch_buckets(buckets: tuple[int, ...], config) -> tuple[int, ...]:
    """Batch buckets of the prefill executables. A prefill is one call per admitted group, not a step
    repeated every few milliseconds, so padding costs little there and compiling a prefill for each
    of SGLang's ~20 decode buckets (times every length bucket) would dominate start-up: the default
    keeps the decode buckets nearest 1, 4, 16, 64, ... and the largest. `--buckets` and
    `--disable-padding` apply to prefill as given."""
    if config.batch_buckets or config.disable_padding:
        return buckets
    keep = {buckets[-1]}
    target = 1
    while target < buckets[-1]:
        keep.add(pick_bucket(buckets, target))
        target *= 4
    return tuple(sorted(keep))


def kv_buckets(max_ctx: int, config, head_dims) -> tuple[int, ...]:
    """Prefix-length buckets of the decode/round executables. With the paged-attention kernel serving
    every attention of the step (`jeagle/kernels/paged_attention.py` reads each request's own length)
    one bucket, the whole context, serves all lengths; the pure-jnp reference gathers a static prefix,
    so it gets powers of two from `min_kv_bucket`."""
    from jeagle.kernels.paged_attention import kernel_serves
    from jeagle.kernels.settings import use

    with use(config.kernels):
        served = all(kernel_serves(d) for d in head_dims)
    if served:
        return (max_ctx,)
    return pow2_buckets(min(config.min_kv_bucket, max_ctx), max_ctx)


@dataclass(frozen=True)
class Buckets:
    """Every bucket table of one engine, and the plans made from them."""
    batch: tuple[int, ...]
    prefill_batch: tuple[int, ...]
    prefill_len: tuple[int, ...]
    kv: tuple[int, ...]
    max_ctx: int
    max_prefill_tokens: int
    contexts: tuple[int, ...] | None = None  # None: prefill_len

    def __post_init__(self):
        if self.contexts is None:
            object.__setattr__(self, "contexts", self.prefill_len)

    @classmethod
    def for_engine(cls, config, max_reqs: int, max_ctx: int, head_dims) -> "Buckets":
        batch = batch_buckets(max_reqs, config)
        prefill_len = prefill_length_buckets(min(config.min_prefill_bucket, max_ctx), max_ctx)
        kv = kv_buckets(max_ctx, config, head_dims)
        # The kernel's causal form reads each row to its own length: one context serves every prefill
        # after a cache hit (models/common.py `attention_sublayer`), as one prefix bucket serves decode.
        paged = len(kv) == 1 and config.kernels.prefill_attention == "paged"
        return cls(batch=batch, prefill_batch=prefill_batch_buckets(batch, config), prefill_len=prefill_len,
                   kv=kv, max_ctx=max_ctx, max_prefill_tokens=config.max_prefill_tokens,
                   contexts=(max_ctx,) if paged else prefill_len)

    def prefill(self, n: int, longest: int) -> tuple[int, int]:
        """(batch, length) bucket of a prefill of n prompts, the longest `longest` tokens."""
        return pick_bucket(self.prefill_batch, n), pick_bucket(self.prefill_len, longest)

    def prefill_fits(self, n: int, longest: int) -> bool:
        """Whether a prefill group of n prompts stays within max_prefill_tokens once padded (a group of
        one always fits: a long lone prompt still runs)."""
        b, t = self.prefill(n, longest)
        return n == 1 or b * t <= self.max_prefill_tokens

    def decode(self, n: int, longest_prefix: int, current: int = 0, shrink_ratio: float = 1.0) -> tuple[int, int]:
        """(batch, prefix) bucket of a decode step / round over n rows whose prefixes reach at most
        `longest_prefix` positions. A batch running at bucket `current` keeps it while its rows fill more
        than 1/shrink_ratio of it (`EngineConfig.bucket_shrink_ratio`; 1: always the smallest that fits)."""
        b = pick_bucket(self.batch, n)
        if b < current and n * shrink_ratio > current:
            b = current
        return b, pick_bucket(self.kv, min(longest_prefix, self.max_ctx))

    def context(self, longest_total: int) -> int:
        """The context bucket of a prefill whose rows continue cached prefixes, the longest reaching
        `longest_total` positions (`contexts`: `runtime/steps.py` `prefill_attn`)."""
        return pick_bucket(self.contexts, min(longest_total, self.max_ctx))

    def warmup_plan(self, batch_sizes=None, prefill_lengths=None, kv_lengths=None, prefix=(False,)):
        """(prefill (b, t, context) triples, decode (b, kv) pairs) covering the given sizes (None:
        every bucket). Prefill keeps b x t <= max_prefill_tokens, except the smallest batch bucket (any
        t: a lone long prompt); context 0 (no cached prefix), and with True in `prefix` also every
        context bucket covering t up to the longest prompt's (prefills after a prefix-cache hit)."""
        def covering(table, sizes):
            return sorted(set(table if sizes is None else (pick_bucket(table, n) for n in sizes)))

        lengths = covering(self.prefill_len, prefill_lengths)
        pairs = [(b, t) for b in covering(self.prefill_batch, batch_sizes) for t in lengths
                 if b == self.prefill_batch[0] or b * t <= self.max_prefill_tokens]
        prefill = [(b, t, 0) for b, t in pairs] if False in prefix else []
        if True in prefix:
            def contexts(t):  # the context buckets of prefills of length bucket t, up to the longest prompt's
                return sorted({pick_bucket(self.contexts, n) for n in self.prefill_len if t <= n <= lengths[-1]})
            prefill += [(b, t, c) for b, t in pairs for c in contexts(t)]
        decode = [(b, kv) for b in covering(self.batch, batch_sizes) for kv in covering(self.kv, kv_lengths)]
        return prefill, decode


def pad(values, size: int, fill, dtype) -> np.ndarray:
    """values[0..n) followed by `fill` up to `size` (a batch padded to its bucket). `values` may be rows
    of a 2-D array (an empty one keeps its row shape); `fill` then fills whole rows."""
    values = np.asarray(values, dtype) if len(values) else np.zeros((0, *np.shape(values)[1:]), dtype)
    out = np.full((size,) + values.shape[1:], fill, dtype)
    out[: len(values)] = values
    return out


def unpad(host: np.ndarray, n: int) -> np.ndarray:
    """The first n rows of a padded batch's result: the requests', not the padding's."""
    return host[:n]
