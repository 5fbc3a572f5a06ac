"""Optimizer: AdamW param groups, global-norm clipping, learning-rate schedule."""
