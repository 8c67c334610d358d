"""Pallas GPU kernels of jeagle, each beside its pure-jnp reference.

Installed as `jeagle.kernels` (see pyproject.toml): always import it under that name.
"""
