"""megalite: a readable Megatron-style pretraining framework for GPT models."""

__version__ = "0.1.0"
