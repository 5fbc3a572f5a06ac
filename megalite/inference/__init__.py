"""Inference on megalite checkpoints at any TP/PP layout: generation with a KV cache, and zero-shot
evaluation (perplexity, LAMBADA). ``tools/generate.py`` and ``tasks/main.py`` are the command lines."""

from megalite.inference.evaluation import evaluate_lambada, evaluate_perplexity
from megalite.inference.generation import GenerationResult, generate
from megalite.inference.kv_cache import KVCache
from megalite.inference.sampling import SamplingParams

__all__ = ["GenerationResult", "KVCache", "SamplingParams", "evaluate_lambada", "evaluate_perplexity", "generate"]
