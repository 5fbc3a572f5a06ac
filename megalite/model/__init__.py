"""The GPT model: embedding -> transformer layers -> final norm -> output layer and loss."""

from megalite.model.gpt import GPTModel

__all__ = ["GPTModel"]
