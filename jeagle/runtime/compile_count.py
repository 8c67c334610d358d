"""JAX's own count of XLA compilations in this process, and the engine's reading of it after a warm-up.

`Engine.num_compiled` counts the executables the engine keeps by step key; a compilation outside them (an
eager jnp op on a new shape, a `jax.jit` of the host code's, a library's) never shows there, yet on a
request's path it costs as much. JAX reports every backend compile of any jit to its monitoring
listeners (`jax._src.dispatch.BACKEND_COMPILE_EVENT`, persistent-cache hits included), so counting those
events sees them all.
"""

from __future__ import annotations

import threading

import jax

# `jax._src.dispatch.BACKEND_COMPILE_EVENT`, spelled out: a private module may move, the event's name is
# what the listeners receive.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()  # warm-up compiles on a thread pool: the listener runs on many threads
_count = 0
_installed = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _count += 1


def install() -> None:
    """Register the listener (once per process: JAX keeps every listener registered, and each would count)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _installed = True


def count() -> int:
    """The backend compilations in this process since the listener was installed (here, at the first call)."""
    install()
    with _lock:
        return _count


class CompilationsAfterWarmup:
    """The engine's part: JAX's count at the end of its last warm-up (`_warmed_up`)."""
    _compiles_at_warmup: int | None = None

    def _warmed_up(self, result):
        """Mark the end of a warm-up (JAX's count now); returns `result`, the warm-up's own return value."""
        self._compiles_at_warmup = count()
        return result

    @property
    def xla_compilations_after_warmup(self) -> int | None:
        """XLA compilations since the last warm-up ended (None: no warm-up ran); 0 when every request since
        was served by executables the warm-up built. The count is the process's, not this engine's: in a
        process with several engines (tests, benchmarks) it counts theirs too, and any other jit's."""
        if self._compiles_at_warmup is None:
            return None
        return count() - self._compiles_at_warmup
