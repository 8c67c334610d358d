"""Training EAGLE draft heads in JAX (`python -m jeagle.train_draft`)."""
