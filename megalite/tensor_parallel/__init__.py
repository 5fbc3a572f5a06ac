"""Tensor parallelism: communication mappings, parallel layers, vocab-parallel loss, RNG, init."""
