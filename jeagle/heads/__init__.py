"""EAGLE heads trained by jeagle and shipped with it (safetensors + config + model card per folder).

`smollm2-135m-instruct-eagle3/`: the default draft of the default target (SmolLM2-135M-Instruct):
`python -m jeagle.generate` with no options runs EAGLE-3 with it. Its README.md says how it was trained.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_HEAD = "smollm2-135m-instruct-eagle3"


def default_head_dir() -> Path:
    """The shipped head for the default target."""
    return Path(__file__).resolve().parent / DEFAULT_HEAD
