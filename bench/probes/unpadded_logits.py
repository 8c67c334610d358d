"""Run a bench script with the one-row logits product as before `4e04004` (no padding to two rows):
the A/B of `fp32_logits` in one call. `python bench/probes/unpadded_logits.py SCRIPT ARGS...`"""
import runpy
import sys
from pathlib import Path

import jax.numpy as jnp

import jeagle.models.common as C
import jeagle.models.llama as L


def einsum_logits(x, head):
    return jnp.einsum("...h,vh->...v", x, head, preferred_element_type=jnp.float32)


L.fp32_logits = C.fp32_logits = einsum_logits
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))  # as `python SCRIPT` would have it
runpy.run_path(sys.argv[0], run_name="__main__")
