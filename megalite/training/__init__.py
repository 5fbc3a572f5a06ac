"""The training loop, evaluation, logging and start-up."""
