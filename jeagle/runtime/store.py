"""Compiled code kept across starts: JAX's persistent compilation cache and the executable store."""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

log = logging.getLogger("jeagle.runtime")


def enable_compile_cache(path) -> None:
    """Persist XLA compilations under `path` (JAX's persistent compilation cache): a later start-up
    with the same shapes, code and JAX version loads executables instead of compiling them. Every
    compilation is cached, however short."""
    from pathlib import Path

    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def code_fingerprint() -> str:
    """A hash of everything that decides the compiled code besides an executable's key and argument
    shapes: jeagle's source, the JAX/jaxlib versions, the device kind and driver, XLA_FLAGS, and JAX's
    matmul precision and x64 settings. (The model, draft, tier, bucket, unrolling and kernel settings
    are in each executable's key: `jeagle.runtime.executables`.)"""
    import hashlib
    from pathlib import Path

    import jaxlib

    import jeagle

    h = hashlib.sha256()
    root = Path(jeagle.__file__).parent
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    dev = jax.devices()[0]
    for part in (jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
                 getattr(dev.client, "platform_version", ""), os.environ.get("XLA_FLAGS", ""),
                 str(jax.config.jax_default_matmul_precision), str(jax.config.jax_enable_x64)):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()


class ExecutableStore:
    """Compiled executables on disk, so a warm start skips tracing, lowering and compiling.

    JAX's persistent compilation cache (`enable_compile_cache`) saves the XLA compile but still traces
    and lowers every executable to compute its key: about 0.3-1 s per round executable for SmolLM2,
    which for dozens of buckets is most of a cached start-up. This store keys each executable by
    `code_fingerprint()` (one folder per fingerprint) plus its step key (`executables.py`) and the
    shapes, dtypes and tree structure of its arguments, and saves it with `jax.experimental.serialize_executable`.

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

    def path(self, key, args):
        import hashlib

        leaves, tree = jax.tree.flatten(args)
        # Arrays and jax.ShapeDtypeStruct (an abstract engine's state) sign alike.
        sig = [(tuple(getattr(x, "shape", np.shape(x))), str(getattr(x, "dtype", np.asarray(x).dtype)))
               for x in leaves]
        h = hashlib.sha256(repr((key, str(tree), sig)).encode()).hexdigest()[:32]
        return self.dir / f"{key.label}-{h}.jexe"

    def has(self, key, args) -> bool:
        return self.path(key, args).exists()

    def load(self, key, args):
        """The stored executable for (key, argument signature), or None."""
        import pickle

        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.path(key, args)
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

    def save(self, key, args, exe) -> None:
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
        path = self.path(key, args)
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
