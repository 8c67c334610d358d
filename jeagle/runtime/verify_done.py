"""The verify_done wait (seed 001): what the host waits on after a speculative round.

verify_done. After a speculative round is dispatched, its verify results (the [B, S+3] accept array)
are the handle the next host step may wait on before it schedules the next round:

    dataflow  (default) the next device computation depends on the round only through its
              device-resident outputs (rows, cache), which JAX orders on the device; the host does
              not block. In JAX the next round's inputs are the last round's outputs, so the
              CUDA-stream hazard that made SGLang keep `synchronize()` as its default does not exist.
              The handle must still be live device arrays
              (not deleted or donated); if that check, or anything else, fails, the error is logged
              and the host falls back to the hard wait (which, for a deleted buffer, raises JAX's
              own error rather than carrying on with a result that no longer exists).
    sync      a hard wait: the host blocks until the round's results are ready
              (`jax.block_until_ready`), as SGLang's `verify_done.synchronize()`. Chosen with
              `--verify-done-wait sync` or `JEAGLE_VERIFY_DONE_STREAM_WAIT=0` (SGLang's
              `SGLANG_SPEC_V2_VERIFY_DONE_STREAM_WAIT`).

The pending handle is consumed once: a second wait without a new round does nothing.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import jax

log = logging.getLogger("jeagle.runtime")

VERIFY_DONE_MODES = ("sync", "dataflow")
STREAM_WAIT_ENV = "JEAGLE_VERIFY_DONE_STREAM_WAIT"


def verify_done_mode(flag: str | None = None) -> str:
    """The wait mode: the flag if given, else `sync` when JEAGLE_VERIFY_DONE_STREAM_WAIT is false,
    else `dataflow`."""
    if flag is not None:
        if flag not in VERIFY_DONE_MODES:
            raise ValueError(f"--verify-done-wait {flag!r}: expected one of {VERIFY_DONE_MODES}")
        return flag
    env = os.environ.get(STREAM_WAIT_ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return "sync"
    if env in ("", "1", "true", "yes", "on"):
        return "dataflow"
    raise ValueError(f"{STREAM_WAIT_ENV}={env!r}: expected 1/true/yes or 0/false/no")


def _check_live(arrays) -> None:
    """Dataflow needs the handle to be live device arrays the device orders by itself."""
    for x in jax.tree.leaves(arrays):
        if not isinstance(x, jax.Array):
            raise TypeError(f"verify_done handle holds a {type(x).__name__}, not a device array")
        if x.is_deleted():
            raise RuntimeError("verify_done handle was deleted (donated) before the wait")


class VerifyDone:
    """The pending verify results of the last round and the wait on them; see the module docstring."""

    def __init__(self, mode: str = "dataflow", *, block: Callable[[Any], Any] = jax.block_until_ready,
                 check: Callable[[Any], None] = _check_live):
        if mode not in VERIFY_DONE_MODES:
            raise ValueError(f"verify_done mode {mode!r}: expected one of {VERIFY_DONE_MODES}")
        self.mode = mode
        self._block, self._check = block, check
        self._pending = None
        self.fallbacks = 0

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def record(self, arrays) -> None:
        self._pending = arrays

    def wait(self) -> float:
        """Wait as the mode says; returns the seconds the host was blocked."""
        arrays, self._pending = self._pending, None  # consumed once, whatever happens below
        if arrays is None:
            return 0.0
        t0 = time.perf_counter()
        if self.mode == "dataflow":
            try:
                self._check(arrays)
                return time.perf_counter() - t0
            except Exception:
                self.fallbacks += 1
                log.exception("verify_done: the dataflow wait failed; falling back to the hard wait")
        self._block(arrays)
        return time.perf_counter() - t0
