"""The one switch between Pallas kernels and their pure-jnp references.

The backend of the current `KernelSettings` (jeagle/kernels/settings.py; `JEAGLE_KERNELS` through
`KernelSettings.from_env`): `pallas` (compiled; the default on a GPU), `interpret` (the Pallas kernels
run by the Pallas interpreter: how CPU tests exercise them), or `reference` (pure jnp; the default
elsewhere). The engine calls kernels only through the public functions of this package, which ask
`backend()` while they are traced, so the reference path always stays runnable.
"""

from __future__ import annotations

import jax.numpy as jnp

from jeagle.kernels.settings import BACKENDS, current

__all__ = ["BACKENDS", "backend", "dispatch", "int32_inputs"]


def backend() -> str:
    """The backend of the settings in use (`settings.use`), resolved for this platform."""
    return current().resolved()


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
