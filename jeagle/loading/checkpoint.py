"""jeagle's converted checkpoint directory: save and load.

    OUT_DIR/config.json             ModelConfig (format "jeagle-target-v1")
    OUT_DIR/model.safetensors       the parameter dict (names in models/llama.py), in cfg.dtype
    OUT_DIR/tokenizer.json          fast tokenizer
    OUT_DIR/tokenizer_config.json   special tokens and chat template

A draft head is the same with a DraftConfig (format "jeagle-draft-v1"), the form a trained head ships
in (jeagle/heads/). Directories converted before 2026-11-26 hold an orbax checkpoint in `params/`
instead; they still load (orbax is imported only then: it costs a start ~0.2-0.3 s of imports).

Every converter ends in `save_checkpoint`, which checks each tensor's shape against the model the
config describes, so a converter bug or a config/weight mismatch fails at conversion, not at run time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jeagle.config import DraftConfig, ModelConfig
from jeagle.models.eagle import EagleHead, abstract_draft
from jeagle.models.llama import Llama, abstract_model

FORMAT = "jeagle-target-v1"
DRAFT_FORMAT = "jeagle-draft-v1"
SAFETENSORS = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; the message names the file."""


def is_converted(path, fmt: str = FORMAT) -> bool:
    path = Path(path)
    cfg = path / "config.json"
    if not (cfg.is_file() and ((path / "params").is_dir() or (path / SAFETENSORS).is_file())):
        return False
    try:
        return json.loads(cfg.read_text()).get("format") == fmt
    except (json.JSONDecodeError, OSError):
        return False


def _abstract(cfg):
    return abstract_draft(cfg) if isinstance(cfg, DraftConfig) else abstract_model(cfg)


def expected_shapes(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    _, state = nnx.split(_abstract(cfg))
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in nnx.to_pure_dict(state).items()}


def check_params(cfg, params: dict[str, np.ndarray], source: str) -> None:
    _check_shapes({k: shape for k, (shape, _) in expected_shapes(cfg).items()},
                  {k: tuple(v.shape) for k, v in params.items()}, source)


def _check_shapes(want: dict[str, tuple], got: dict[str, tuple], source) -> None:
    """Raise CheckpointError naming the first difference between the tensors' names and shapes."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise CheckpointError(f"{source}: tensors do not match the config: missing {missing}, unexpected {extra}")
    for name, shape in want.items():
        if tuple(got[name]) != tuple(shape):
            raise CheckpointError(f"{source}: {name} has shape {tuple(got[name])}, the config implies {tuple(shape)}")


def save_checkpoint(out_dir, cfg, params: dict[str, np.ndarray], *, source: str = "", metadata=None) -> Path:
    """Write config + model.safetensors (floating point tensors cast to cfg.dtype, integer buffers
    int32) for a target (ModelConfig) or a draft head (DraftConfig), replacing an older checkpoint in
    the directory (an orbax `params/` included). Tokenizer files are the caller's."""
    import ml_dtypes
    from safetensors.numpy import save_file

    out_dir = Path(out_dir).absolute()
    check_params(cfg, params, source or str(out_dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    want = expected_shapes(cfg)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(np_dtype.get(want[k][1], want[k][1])))
               for k, v in params.items()}
    tmp = out_dir / f"{SAFETENSORS}.tmp"
    save_file(tensors, str(tmp), metadata={"format": cfg.FORMAT, **(metadata or {})})
    tmp.replace(out_dir / SAFETENSORS)
    if (out_dir / "params").exists():
        shutil.rmtree(out_dir / "params")
    cfg.save(out_dir / "config.json")
    return out_dir


def load_config(path) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not a jeagle checkpoint: {cfg_file} is missing")
    if is_converted(path, DRAFT_FORMAT):
        raise CheckpointError(f"{path} is a draft head, not a target model")
    return ModelConfig.load(cfg_file)


def load_model(path, *, dtype: str | None = None) -> Llama:
    """Load a converted target checkpoint onto the default device, optionally in another dtype."""
    path = Path(path).absolute()
    cfg = load_config(path)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    return _restore(path, cfg)


def load_draft(path, *, target: ModelConfig | None = None, dtype: str | None = None) -> EagleHead:
    """Load a converted EAGLE head; with `target`, check that it can run on that target."""
    path = Path(path).absolute()
    cfg_file = path / "config.json"
    if not is_converted(path, DRAFT_FORMAT):
        raise CheckpointError(f"{path} is not a converted jeagle draft (python -m checkpoints_conv eagle ...)")
    cfg = DraftConfig.load(cfg_file)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.replace(dtype=dtype)
    if target is not None:
        cfg.check_target(target)
    return _restore(path, cfg)


def _read_orbax(path: Path) -> dict:
    import orbax.checkpoint as ocp

    try:
        return ocp.StandardCheckpointer().restore(path / "params")
    except Exception as e:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"cannot read the parameters in {path / 'params'}: {e}") from e


def _read_safetensors(source: Path, target: dict) -> dict:
    """Each tensor read and put on the device in the target's dtype one at a time (host memory: one
    tensor, not the model)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    try:
        with safe_open(str(source), framework="numpy") as f:
            _check_shapes({k: t.shape for k, t in target.items()},
                          {k: f.get_slice(k).get_shape() for k in f.keys()}, source)
            for name, t in target.items():
                out[name] = jnp.asarray(f.get_tensor(name), dtype=t.dtype)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read the parameters in {source}: {e}") from e
    return out


def _restore(path: Path, cfg):
    graphdef, state = nnx.split(_abstract(cfg))
    target = nnx.to_pure_dict(state)
    if (path / SAFETENSORS).is_file():
        restored = _read_safetensors(path / SAFETENSORS, target)
    elif (path / "params").is_dir():
        restored = _read_orbax(path)
        check_params(cfg, restored, str(path / "params"))
        restored = jax.tree.map(lambda x, t: jnp.asarray(x, dtype=t.dtype), restored, target)
    else:
        raise CheckpointError(f"{path} is not a jeagle checkpoint: neither {path / SAFETENSORS} nor {path / 'params'}")
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
