"""The one switch between Pallas kernels and their pure-jnp references.

`JEAGLE_KERNELS` = `pallas` (compiled; the default on a GPU), `interpret` (the Pallas kernels run by
the Pallas interpreter: how CPU tests exercise them), or `reference` (pure jnp; the default
elsewhere). The engine calls kernels only through the public functions of this package, which ask
`backend()`, so the reference path always stays runnable.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

BACKENDS = ("pallas", "interpret", "reference")


def backend() -> str:
    choice = os.environ.get("JEAGLE_KERNELS")
    if choice is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if choice not in BACKENDS:
        raise ValueError(f"JEAGLE_KERNELS={choice!r}; expected one of {BACKENDS}")
    return choice


def int32_inputs(what: str, *xs):
    """The inputs as int32, after refusing any that is not an integer array (ValueError names `what`)."""
    for x in xs:
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{what} must be integer arrays, got {x.dtype}")
    return tuple(x.astype(jnp.int32) for x in xs)


def dispatch(reference, pallas, *args, **static):
    """Run `reference(*args, *static.values())` or `pallas(*args, **static, interpret=...)` as the switch
    says; every public kernel function ends here, after validating its inputs."""
    mode = backend()
    if mode == "reference":
        return reference(*args, *static.values())
    return pallas(*args, *static.values(), interpret=mode == "interpret")
