"""jeagle: lossless EAGLE speculative decoding in JAX."""

__version__ = "0.1.0"
