"""Kernel settings: which path the kernels take, the paged-attention split, and XLA options.

One frozen, hashable value, read from the environment once by an entry point (`from_env`) and made
current while a step is traced (`use`). The kernels read `current()`, never the environment, so a
trace depends only on values that are part of the executable's key:

    with use(config.kernels):
        lowered = jax.jit(step).lower(...)

Outside any `use`, `current()` is `KernelSettings()`: the platform's default backend, the `auto` split,
no options — whatever the environment says.

The eight environment variables `from_env` reads (and nothing else in jeagle does):

    JEAGLE_KERNELS                  pallas | interpret | reference  (unset: pallas on a GPU, else reference)
    JEAGLE_PAGED_ATTENTION_SPLITS   auto (or unset) | 1 (no split) | a count >= 1
    JEAGLE_PREFILL_ATTENTION        paged (or unset) | gathered
    JEAGLE_LINEAR                   0: the layers' matmuls through XLA's dot, never the `linear` kernel
    JEAGLE_LINEAR_MAX_ROWS          the most rows (M) the `linear` kernel takes (default 64; 16-128)
    JEAGLE_TOPK                     0: the draft's and the logprobs' top-ks through XLA's ops, never the `topk` kernel
    JEAGLE_TRITON_GEMM              1: keep XLA's own Triton GEMM fusions in the speculative executables
    JEAGLE_XLA_OPTIONS              a JSON object of XLA option names to values, for every executable
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import jax

BACKENDS = ("pallas", "interpret", "reference")

KERNELS_ENV = "JEAGLE_KERNELS"
SPLITS_ENV = "JEAGLE_PAGED_ATTENTION_SPLITS"
TRITON_GEMM_ENV = "JEAGLE_TRITON_GEMM"
PREFILL_ATTENTION_ENV = "JEAGLE_PREFILL_ATTENTION"
PREFILL_ATTENTION = ("paged", "gathered")
LINEAR_ENV = "JEAGLE_LINEAR"
LINEAR_MAX_ROWS_ENV = "JEAGLE_LINEAR_MAX_ROWS"
TOPK_ENV = "JEAGLE_TOPK"
XLA_OPTIONS_ENV = "JEAGLE_XLA_OPTIONS"


@dataclass(frozen=True)
class KernelSettings:
    backend: str | None = None  # None: "pallas" on a GPU, else "reference"; else one of BACKENDS
    # Paged attention's split prefixes (flash-decoding's split-K): "auto" (the default: split while
    # requests x KV heads leave the GPU's SMs idle; a batch-1 SmolLM2 round 1.85 -> 1.57 ms, an 8B one
    # 8.38 -> 8.01 ms on the H100, bench/HISTORY.md, 2026-11-25), None or 1 (off), or a count.
    paged_attention_splits: str | int | None = "auto"
    triton_gemm: bool = False  # True: XLA's own Triton GEMM fusions stay on in speculative executables
    # Extra XLA options for every executable, as sorted (name, value) pairs so the settings stay hashable.
    xla_options: tuple[tuple[str, object], ...] = ()
    # Deterministic mode (`--deterministic`): the target's forward computes each token's logits the same
    # way whatever the batch and the tokens per call (jeagle/models/deterministic.py); on a GPU every
    # executable compiles with cuBLAS matmuls and no autotuning.
    deterministic: bool = False
    # A prefill's attention where the paged-attention kernel serves (models/common.py
    # `attention_sublayer`): "paged" (its causal form over the pool, reading each row's own length) or
    # "gathered" (the prefix gathered to a dense copy, then jnp attention: XLA's GEMMs and softmax).
    prefill_attention: str = "paged"
    # The decoder layers' matmuls of few rows (decode steps, rounds, draft steps) through the skinny-matmul
    # kernel (jeagle/kernels/linear.py), which reads the stacked weights in place; False: XLA's dot.
    linear: bool = True
    # The most rows a product may have to go through that kernel; more go to XLA's GEMMs (cuBLAS, each on a
    # dynamic-slice fusion of the stacked weight: per-call host work for every one, bench/HISTORY.md, 2026-11-27).
    # 64: a batch-16 draft step's 64 rows take the kernel, its 128-row verify XLA's GEMMs. At most 128: the
    # kernel holds all rows in one tile, and 512 rows asked for 408 KiB of shared memory (the H200 has 227).
    # 128 measured a batch-16 round 2 % shorter on the H200 (host_profile --real: 1.620 vs 1.657 ms, the
    # call's host time 0.74 vs 0.96 ms, the device's 1.45 vs 1.43 ms) and MT-bench tokens/s within noise
    # (bench/HISTORY.md, 2026-11-28), so the default stays 64.
    linear_max_rows: int = 64
    # The draft's softmax + top-K (speculative/round.py `draft_topk`) and the logprobs' top-ks
    # (jeagle/sampling/logprobs.py `top_k_blocked`) through the one-pass kernel (jeagle/kernels/topk.py); False: XLA's.
    topk: bool = True
    # XLA's dynamic-slice fusions on a GPU: a GEMM on one layer's slice of the stacked weights reads it in
    # place (less device time). False: XLA copies the slice first; each round call then costs the host about
    # a fifth less (no per-call prepare and re-record of those thunks; 1.5-1.6 -> 1.2-1.3 ms at batch 32): the server's default, whose host sets
    # the pace (`--slice-fusion`, bench/HISTORY.md, 2026-11-27).
    slice_fusion: bool = True

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"kernel backend {self.backend!r}; expected one of {BACKENDS} or None")
        s = self.paged_attention_splits
        if s == 1 and not isinstance(s, bool):  # one run is no split: one value for one behaviour
            object.__setattr__(self, "paged_attention_splits", None)
        elif not (s is None or s == "auto" or (isinstance(s, int) and not isinstance(s, bool) and s >= 1)):
            raise ValueError(f"paged_attention_splits={s!r}: expected None, 'auto' or a count >= 1")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be a bool, got {self.deterministic!r}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention={self.prefill_attention!r}; expected one of {PREFILL_ATTENTION}")
        if not isinstance(self.linear, bool):
            raise ValueError(f"linear must be a bool, got {self.linear!r}")
        if (not isinstance(self.linear_max_rows, int) or isinstance(self.linear_max_rows, bool)
                or not 16 <= self.linear_max_rows <= 128):
            raise ValueError(f"linear_max_rows={self.linear_max_rows!r}: expected a count of rows in 16..128")
        if not isinstance(self.topk, bool):
            raise ValueError(f"topk must be a bool, got {self.topk!r}")
        if not isinstance(self.slice_fusion, bool):
            raise ValueError(f"slice_fusion must be a bool, got {self.slice_fusion!r}")
        if not isinstance(self.triton_gemm, bool):
            raise ValueError(f"triton_gemm must be a bool, got {self.triton_gemm!r}")
        if isinstance(self.xla_options, Mapping):  # a dict is accepted and stored as sorted pairs
            object.__setattr__(self, "xla_options", tuple(sorted(self.xla_options.items())))
        opts = self.xla_options
        if not isinstance(opts, tuple) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                  for p in opts):
            raise ValueError(f"xla_options must be (name, value) pairs, got {opts!r}")
        for name, value in opts:
            if not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"xla_options[{name!r}] = {value!r}: XLA options take a bool, number or string")
        if len({name for name, _ in opts}) != len(opts):
            raise ValueError(f"xla_options names an option twice: {opts!r}")

    def resolved(self) -> str:
        """The concrete backend: `backend`, or the platform's default when None."""
        if self.backend is not None:
            return self.backend
        return "pallas" if jax.default_backend() == "gpu" else "reference"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelSettings:
        """The settings the environment asks for (the module docstring lists the variables)."""
        backend = environ.get(KERNELS_ENV)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"{KERNELS_ENV}={backend!r}; expected one of {BACKENDS}")
        prefill = (environ.get(PREFILL_ATTENTION_ENV) or "paged").strip().lower() or "paged"
        if prefill not in PREFILL_ATTENTION:
            raise ValueError(f"{PREFILL_ATTENTION_ENV}={prefill!r}; expected one of {PREFILL_ATTENTION}")
        return cls(backend=backend, paged_attention_splits=_splits_from_env(environ.get(SPLITS_ENV)),
                   triton_gemm=environ.get(TRITON_GEMM_ENV) == "1", prefill_attention=prefill,
                   linear=_flag_from_env(LINEAR_ENV, environ.get(LINEAR_ENV), default=True),
                   linear_max_rows=_rows_from_env(environ.get(LINEAR_MAX_ROWS_ENV)),
                   topk=_flag_from_env(TOPK_ENV, environ.get(TOPK_ENV), default=True),
                   xla_options=_xla_options_from_env(environ.get(XLA_OPTIONS_ENV)))


def _flag_from_env(name: str, text: str | None, *, default: bool) -> bool:
    choice = (text or "").strip().lower()
    if not choice:
        return default
    if choice in ("1", "true", "on"):
        return True
    if choice in ("0", "false", "off"):
        return False
    raise ValueError(f"{name}={text!r}: expected 1 or 0")


def _rows_from_env(text: str | None) -> int:
    choice = (text or "").strip()
    if not choice:
        return KernelSettings.linear_max_rows
    try:
        n = int(choice)
    except ValueError:
        raise ValueError(f"{LINEAR_MAX_ROWS_ENV}={text!r}: expected a count of rows in 16..128") from None
    if not 16 <= n <= 128:
        raise ValueError(f"{LINEAR_MAX_ROWS_ENV}={text!r}: expected a count of rows in 16..128")
    return n


def _splits_from_env(text: str | None) -> str | int | None:
    choice = (text or "auto").strip().lower() or "auto"
    if choice == "auto":
        return "auto"
    try:
        n = int(choice)
    except ValueError:
        raise ValueError(f"{SPLITS_ENV}={choice!r}: expected auto or a count >= 1") from None
    if n < 1:
        raise ValueError(f"{SPLITS_ENV}={choice!r}: expected auto or a count >= 1")
    return None if n == 1 else n


def _xla_options_from_env(text: str | None) -> tuple[tuple[str, object], ...]:
    text = (text or "").strip()
    if not text:
        return ()
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{XLA_OPTIONS_ENV} is not JSON: {e}") from e
    if not isinstance(opts, dict):
        raise ValueError(f"{XLA_OPTIONS_ENV} must be a JSON object of XLA option names to values")
    return tuple(sorted(opts.items()))


_CURRENT: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar("jeagle_kernel_settings")
_DEFAULT = KernelSettings()


def current() -> KernelSettings:
    """The settings of the trace in progress: the innermost `use`, else `KernelSettings()`."""
    return _CURRENT.get(_DEFAULT)


@contextlib.contextmanager
def use(settings: KernelSettings) -> Iterator[KernelSettings]:
    """Make `settings` current for the block (nests; per thread and per asyncio task)."""
    if not isinstance(settings, KernelSettings):
        raise TypeError(f"use() takes a KernelSettings, got {type(settings).__name__}")
    token = _CURRENT.set(settings)
    try:
        yield settings
    finally:
        _CURRENT.reset(token)
