"""The training loop, evaluation and logging."""
