"""Host-side runtime pieces of the decode loop: the verify_done wait (seed 001) and host-blocked timing.

verify_done. After a speculative round is dispatched, its verify results (the [B, S+3] accept array)
are the handle the next host step may wait on before it schedules the next round:

    sync      (default) a hard wait: the host blocks until the round's results are ready
              (`jax.block_until_ready`), as SGLang's `verify_done.synchronize()`.
    dataflow  the next device computation depends on the round only through its device-resident
              outputs (rows, cache), which JAX orders on the device; the host does not block. Chosen
              with `--verify-done-wait dataflow` or `JEAGLE_VERIFY_DONE_STREAM_WAIT=1` (SGLang's
              `SGLANG_SPEC_V2_VERIFY_DONE_STREAM_WAIT`). The handle must still be live device arrays
              (not deleted or donated); if that check, or anything else, fails, the error is logged
              and the host falls back to the hard wait (which, for a deleted buffer, raises JAX's
              own error rather than carrying on with a result that no longer exists).

The pending handle is consumed once: a second wait without a new round does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

import jax
import numpy as np

log = logging.getLogger("jeagle.runtime")

VERIFY_DONE_MODES = ("sync", "dataflow")
STREAM_WAIT_ENV = "JEAGLE_VERIFY_DONE_STREAM_WAIT"


def verify_done_mode(flag: str | None = None) -> str:
    """The wait mode: the flag if given, else `dataflow` when JEAGLE_VERIFY_DONE_STREAM_WAIT is true."""
    if flag is not None:
        if flag not in VERIFY_DONE_MODES:
            raise ValueError(f"--verify-done-wait {flag!r}: expected one of {VERIFY_DONE_MODES}")
        return flag
    env = os.environ.get(STREAM_WAIT_ENV, "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return "sync"
    if env in ("1", "true", "yes", "on"):
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

    def __init__(self, mode: str = "sync", *, block: Callable[[Any], Any] = jax.block_until_ready,
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


def latency_stats(seconds: list[float]) -> dict[str, float] | None:
    """mean / p50 / p99 in milliseconds, or None for no samples."""
    if not seconds:
        return None
    ms = np.asarray(seconds) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def extra_compiler_options() -> dict:
    """XLA options for every jeagle executable from `JEAGLE_XLA_OPTIONS` (a JSON object, e.g.
    '{"xla_gpu_autotune_level": 0}'): for measuring an option without editing code. They are part of
    the executable store's fingerprint, like every compiler option."""
    text = os.environ.get("JEAGLE_XLA_OPTIONS", "").strip()
    if not text:
        return {}
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"JEAGLE_XLA_OPTIONS is not JSON: {e}") from e
    if not isinstance(opts, dict):
        raise ValueError("JEAGLE_XLA_OPTIONS must be a JSON object of XLA option names to values")
    return opts


def enable_compile_cache(path) -> None:
    """Persist XLA compilations under `path` (JAX's persistent compilation cache): a later start-up
    with the same shapes, code and JAX version loads executables instead of compiling them. Every
    compilation is cached, however short."""
    from pathlib import Path

    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def code_fingerprint(description: str) -> str:
    """A hash of everything that decides the compiled code besides argument shapes: jeagle's source
    (package and kernels), the JAX/jaxlib versions, the device kind and driver, the kernel backend
    and paged-attention split, XLA_FLAGS, JAX's matmul precision and x64 settings, and `description`
    (the engine's static configuration: model, draft and tier configs, layer unrolling, ...)."""
    import hashlib
    from pathlib import Path

    import jaxlib

    import jeagle
    import jeagle.kernels
    from jeagle.kernels.backend import backend
    from jeagle.kernels.paged_attention import SPLITS_ENV

    h = hashlib.sha256()
    for pkg in (jeagle, jeagle.kernels):
        root = Path(pkg.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    dev = jax.devices()[0]
    for part in (jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
                 getattr(dev.client, "platform_version", ""), backend(), os.environ.get("XLA_FLAGS", ""),
                 os.environ.get(SPLITS_ENV, ""),
                 str(jax.config.jax_default_matmul_precision), str(jax.config.jax_enable_x64), description):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()


class ExecutableStore:
    """Compiled executables on disk, so a warm start skips tracing, lowering and compiling.

    JAX's persistent compilation cache (`enable_compile_cache`) saves the XLA compile but still traces
    and lowers every executable to compute its key: about 0.3-1 s per round executable for SmolLM2,
    which for dozens of buckets is most of a cached start-up. This store keys each executable by
    `code_fingerprint(...)` (one folder per fingerprint) plus its engine key and the shapes, dtypes and
    tree structure of its arguments, and saves it with `jax.experimental.serialize_executable`.

    Loading runs pickle on files from `root`: point it only at a folder you own (as with any cache of
    executable code). A file that fails to load is logged and recompiled, never fatal.
    """

    def __init__(self, root, fingerprint: str):
        from pathlib import Path

        self.root, self.fingerprint = str(root), fingerprint
        self.dir = Path(root) / fingerprint[:24]
        self.loaded = 0
        self.saved = 0
        self._cpu_warned = False

    def _path(self, key: tuple, args):
        import hashlib

        leaves, tree = jax.tree.flatten(args)
        # Arrays and jax.ShapeDtypeStruct (an abstract engine's state) sign alike.
        sig = [(tuple(getattr(x, "shape", np.shape(x))), str(getattr(x, "dtype", np.asarray(x).dtype)))
               for x in leaves]
        h = hashlib.sha256(repr((key, str(tree), sig)).encode()).hexdigest()[:32]
        return self.dir / f"{'-'.join(str(k) for k in key)}-{h}.jexe"

    def has(self, key: tuple, args) -> bool:
        return self._path(key, args).exists()

    def load(self, key: tuple, args):
        """The stored executable for (key, argument signature), or None."""
        import pickle

        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key, args)
        if not path.exists():
            return None
        try:
            exe = deserialize_and_load(*pickle.loads(path.read_bytes()))
        except Exception as e:  # noqa: BLE001 - a stale or damaged entry is recompiled
            log.warning("could not load the stored executable %s (%s: %s); compiling it", path.name,
                        type(e).__name__, e)
            return None
        self.loaded += 1
        return exe

    def save(self, key: tuple, args, exe) -> None:
        import pickle

        from jax.experimental.serialize_executable import serialize

        if jax.default_backend() == "cpu" and jax.config.jax_compilation_cache_dir:
            # On XLA:CPU an executable the persistent compilation cache handed back serializes without
            # its compiled functions: loaded later it fails at run time ("Function ... not found").
            if not self._cpu_warned:
                log.warning("executable store: not saving on CPU while JAX's compilation cache is on "
                            "(XLA:CPU cannot serialize a cache-loaded executable); the cache still applies")
                self._cpu_warned = True
            return
        path = self._path(key, args)
        try:
            data = pickle.dumps(serialize(exe))
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except Exception as e:  # noqa: BLE001 - not every executable serializes; it still runs
            log.warning("could not store executable %s (%s: %s)", path.name, type(e).__name__, e)
            return
        self.saved += 1
