"""The one switch between Pallas kernels and their pure-jnp references.

`JEAGLE_KERNELS` = `pallas` (compiled; the default on a GPU), `interpret` (the Pallas kernels run by
the Pallas interpreter: how CPU tests exercise them), or `reference` (pure jnp; the default
elsewhere). The engine calls kernels only through the public functions of this package, which ask
`backend()`, so the reference path always stays runnable.
"""

from __future__ import annotations

import os

import jax

BACKENDS = ("pallas", "interpret", "reference")


def backend() -> str:
    choice = os.environ.get("JEAGLE_KERNELS")
    if choice is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if choice not in BACKENDS:
        raise ValueError(f"JEAGLE_KERNELS={choice!r}; expected one of {BACKENDS}")
    return choice
