"""Bad input gets a clear error that names the problem: missing or corrupt files, unsupported
architectures, and the CLI reports them as one line with exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from checkpoints_conv.gguf import convert_gguf
from checkpoints_conv.hf import convert_hf
from jeagle.loading.checkpoint import CheckpointError, load_model
from jeagle.config import ConfigError
from jeagle.loading.fetch import resolve_target
from tests.hf_models import make_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model("qwen2", d)
    return d


def test_missing_files(tmp_path, hf_dir):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        convert_hf(tmp_path, tmp_path / "out")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(tmp_path)
    no_weights = tmp_path / "noweights"
    no_weights.mkdir()
    shutil.copy(hf_dir / "config.json", no_weights)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        convert_hf(no_weights, tmp_path / "out")
    with pytest.raises(CheckpointError, match="no such file"):
        resolve_target(str(tmp_path / "missing"))


def test_corrupt_files(tmp_path, hf_dir):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    (broken / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        convert_hf(broken, tmp_path / "out")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        convert_hf(broken, tmp_path / "out")
    # A converted checkpoint whose parameter files are damaged.
    good = convert_hf(hf_dir, tmp_path / "conv", dtype="float32", progress=False)
    (good / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="cannot read the parameters in .*model.safetensors"):
        load_model(good)


def test_unsupported_architecture(tmp_path, hf_dir):
    other = tmp_path / "gpt2"
    shutil.copytree(hf_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture: model_type='gpt2'"):
        convert_hf(other, tmp_path / "out")
    cfg["model_type"], cfg["rope_scaling"] = "llama", {"rope_type": "yarn", "factor": 4.0}
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported rope scaling type 'yarn'"):
        convert_hf(other, tmp_path / "out")


def test_weights_that_do_not_match_the_config(tmp_path, hf_dir):
    lying = tmp_path / "lying"
    shutil.copytree(hf_dir, lying)
    cfg = json.loads((lying / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (lying / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \(3, 160, 64\), the config implies \(3, 320, 64\)"):
        convert_hf(lying, tmp_path / "out")


def test_cli_reports_errors_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "jeagle.generate", "hi", "--target", str(tmp_path / "missing.gguf")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: --target") and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "checkpoints_conv", "gguf", str(tmp_path / "x.gguf"),
                           str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_checkpoint_formats(tmp_path, hf_dir):
    """Conversion writes one model.safetensors; a directory converted before (an orbax `params/`)
    loads to the same parameters; loading a safetensors checkpoint imports no orbax."""
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx

    conv = convert_hf(hf_dir, tmp_path / "conv", dtype="float32", progress=False)
    assert (conv / "model.safetensors").is_file() and not (conv / "params").exists()
    new = nnx.to_pure_dict(nnx.split(load_model(conv))[1])
    old = tmp_path / "old"
    shutil.copytree(conv, old)
    (old / "model.safetensors").unlink()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(old / "params", {k: np.asarray(v) for k, v in new.items()})
    ckptr.wait_until_finished()
    back = nnx.to_pure_dict(nnx.split(load_model(old))[1])
    assert set(back) == set(new) and all(np.array_equal(np.asarray(back[k]), np.asarray(new[k])) for k in new)
    # Converting again over the old directory replaces its orbax parameters.
    convert_hf(hf_dir, old, dtype="float32", progress=False)
    assert (old / "model.safetensors").is_file() and not (old / "params").exists()
    code = ("import sys; from jeagle.loading.checkpoint import load_model; import jeagle.engine, jeagle.generate; "
            f"load_model({str(conv)!r}); print(sorted(m for m in sys.modules if m.startswith('orbax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "[]", out.stdout
