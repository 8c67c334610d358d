"""Conversions cached under `JEAGLE_CACHE` (default `~/.cache/jeagle`): each source converted once.

A Hugging Face model dir or a .gguf file given as a target is converted on first use into
`models/` and reused afterwards; `jeagle.loading.fetch` uses the same cache, lock and atomic write for the
default model it fetches and for EAGLE heads. A file lock per entry makes concurrent processes (two
pytest workers, two servers) wait for one conversion instead of writing it twice. `jeagle.loading.checkpoint`
(JAX) is imported inside the functions: `jeagle.errors` imports `jeagle.loading.fetch`, which imports this,
and a CLI's `--help` stays fast.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("JEAGLE_CACHE", Path.home() / ".cache" / "jeagle")).expanduser()


def log(msg: str) -> None:
    print(f"[jeagle] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def cache_lock(name: str):
    """An exclusive lock shared by every process using this cache, held while `name` is fetched or
    converted: a second process waits, then finds the finished result instead of writing it twice."""
    path = cache_dir() / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def source_key(path: Path) -> str:
    """A cache key for a source checkpoint: its absolute path, size and mtime (no full hash: GBs)."""
    st = path.stat()
    return hashlib.sha256(f"{path.absolute()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def convert_once(src: Path, out: Path, convert, dtype: str, quiet: bool) -> Path:
    """Convert `src` into the cache dir `out` unless a finished conversion is already there."""
    from jeagle.loading.checkpoint import is_converted

    if is_converted(out):
        return out
    with cache_lock(out.name):
        if not is_converted(out):  # else another process converted it while we waited
            if not quiet:
                log(f"converting {src} to {out} (once)")
            atomically(out, lambda tmp: convert(src, tmp, dtype=dtype, progress=not quiet))
    return out


def atomically(out: Path, write) -> None:
    """`write(tmp)` into a sibling directory, then rename it to `out`: a reader never sees a
    half-written checkpoint (its config.json is written before its tokenizer files)."""
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        shutil.rmtree(out, ignore_errors=True)  # an unfinished earlier attempt
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converted_target(spec: str, *, dtype: str = "bfloat16", quiet: bool = False) -> Path:
    """A converted target dir for the path `spec`: a converted dir as it is, a Hugging Face model dir
    or a .gguf file converted on first use into the cache."""
    from jeagle.loading.checkpoint import CheckpointError, is_converted

    src = Path(spec).expanduser()
    if not src.exists():
        raise CheckpointError(f"--target {spec}: no such file or directory")
    if src.is_dir() and is_converted(src):
        return src
    if src.is_dir() and (src / "config.json").is_file():
        from checkpoints_conv.hf import convert_hf

        weights = [src / "model.safetensors.index.json", src / "model.safetensors"]
        key = source_key(next((w for w in weights if w.exists()), src / "config.json"))
        return convert_once(src, cache_dir() / "models" / f"hf-{src.name}-{dtype}-{key}", convert_hf, dtype, quiet)
    if src.is_file() and src.suffix == ".gguf":
        from checkpoints_conv.gguf import convert_gguf

        out = cache_dir() / "models" / f"gguf-{src.stem}-{dtype}-{source_key(src)}"
        return convert_once(src, out, convert_gguf, dtype, quiet)
    raise CheckpointError(f"--target {spec}: not a jeagle checkpoint, a Hugging Face model dir (config.json) "
                          "or a .gguf file")
