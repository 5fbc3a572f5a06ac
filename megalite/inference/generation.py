"""Autoregressive generation on a model of any TP/PP layout, with or without a KV cache.

Every rank of a model replica runs the same loop. Per step the new tokens go through the pipeline
(with a cache only the tokens not yet seen; without, the whole sequence so far), the last stage picks
the next token of each sequence (greedy or a draw from a seeded generator), and the choice is
broadcast over TP (so all TP ranks hold the same tokens whatever the sampler) and then back over PP
(so the first stage can embed it). Every rank therefore sees the same tokens and stops together.

Prompts of different lengths are batched without padding masks (Megatron's way): decoding starts after
the shortest prompt, and a sequence still inside its prompt takes its prompt token instead of the
sampled one. Causal attention makes this equal to generating each prompt alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megalite.inference.kv_cache import KVCache
from megalite.inference.pipeline import from_last_stage, pipeline_forward
from megalite.inference.sampling import SamplingParams, sample
from megalite.parallel.groups import Group, ProcessGroups


class GenerationError(ValueError):
    """Prompts or lengths the model cannot generate for; the message names the limit."""


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # each prompt followed by its generated tokens (ending at the stop token, if hit)
    prompt_lengths: list[int]

    @property
    def new_tokens(self) -> list[list[int]]:
        return [t[n:] for t, n in zip(self.tokens, self.prompt_lengths)]


def _model_device(chunks: list[nn.Module]) -> torch.device:
    return next(chunks[0].parameters()).device


def check_lengths(cfg, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
    """Learned absolute positions stop at --max-position-embeddings; RoPE has no table to run out of."""
    if max_new_tokens < 0:
        raise GenerationError(f"the number of tokens to generate must be >= 0, got {max_new_tokens}")
    if min(prompt_lengths, default=1) < 1:
        raise GenerationError("every prompt needs at least one token (use the end-of-document token to "
                              "generate unconditionally)")
    longest = max(prompt_lengths, default=0) + max_new_tokens
    if cfg.position_embedding_type == "learned_absolute" and longest > cfg.max_position_embeddings:
        raise GenerationError(f"prompt ({max(prompt_lengths)} tokens) + {max_new_tokens} new tokens = {longest} "
                              f"positions exceed the model's --max-position-embeddings "
                              f"({cfg.max_position_embeddings}); shorten the prompt or generate fewer tokens")


@torch.no_grad()
def generate(chunks: list[nn.Module], pg: ProcessGroups, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             params: SamplingParams = SamplingParams(greedy=True), *, seed: int = 0, use_cache: bool = True,
             stop_token: int | None = None, pad_token: int = 0) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens after each prompt (fewer where ``stop_token`` comes first).

    Call on every rank of the model replica with the same arguments; every rank returns the result.
    ``seed`` fixes the samples: the same prompts, parameters and seed give the same tokens."""
    for c in chunks:
        c.eval()
    cfg = chunks[0].cfg
    lengths = [len(p) for p in prompts]
    check_lengths(cfg, lengths, max_new_tokens)
    dev = _model_device(chunks)
    b = len(prompts)
    ends = [n + max_new_tokens for n in lengths]  # each sequence's final length (without a stop)
    total = max(ends)
    tokens = torch.full((b, total), pad_token, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=dev)
    in_prompt = torch.zeros(b, total, dtype=torch.bool, device=dev)
    for i, n in enumerate(lengths):
        in_prompt[i, :n] = True
    ends_t = torch.as_tensor(ends, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)  # stopped early
    stopped_at = list(ends)
    generator = None
    if pg.is_last_stage and not params.is_greedy:
        generator = torch.Generator(device=dev).manual_seed(seed)
    cache = KVCache(total) if use_cache else None
    vocab = chunks[-1].vocab_size

    for t in range(min(lengths), total):  # choose the token at position t
        start = cache.offset if cache is not None else 0
        out = pipeline_forward(chunks, pg, tokens[:, start:t], kv_cache=cache)
        if cache is not None:
            cache.advance(t - start)
        chosen = None
        if pg.is_last_stage:
            chosen = sample(out[:, -1, :vocab], params, generator)
            pg.broadcast(chosen, Group.TP, src_index=0)
        chosen = from_last_stage(chosen, pg, (b,), torch.long, dev)
        # Prompt positions keep the prompt; finished sequences and positions past their end get padding.
        past_end = (t >= ends_t) | done
        chosen = torch.where(in_prompt[:, t], tokens[:, t], torch.where(past_end, pad_token, chosen))
        tokens[:, t] = chosen
        if stop_token is not None:
            hit = (~in_prompt[:, t]) & (~past_end) & (chosen == stop_token)
            for i in hit.nonzero().flatten().tolist():
                stopped_at[i] = t + 1
            done |= hit
        if bool(((t + 1 >= ends_t) | done).all()):
            break
    rows = tokens.tolist()
    return GenerationResult([rows[i][: stopped_at[i]] for i in range(b)], lengths)
