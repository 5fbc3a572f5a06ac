"""Hugging Face checkpoints in and out: one adapter per architecture, the converter core, the file readers."""
