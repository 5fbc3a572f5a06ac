"""What the pipeline runs for a GPT: one micro-batch through one chunk, and the shape passed between stages."""

from __future__ import annotations

import torch
from torch import nn

from megalite.model.gpt import GPTModel
from megalite.model.mtp import AddToGradient, Shifts, mtp_loss


def lm_forward_step(chunk: nn.Module, mb: dict[str, torch.Tensor], hidden: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch through one chunk: hidden states out, or the mean token loss on the last stage.

    With context parallelism the micro-batch holds this rank's part of each sequence (``sequence_index``)
    and ``num_tokens``, the loss-mask count of the whole sequences: the result is this part's share of
    the sequences' mean (the shares of the CP ranks sum to it); with --calculate-per-token-loss
    ``num_tokens`` is the global batch's mean count per micro-batch (LossScaling.normalised). The pipeline's
    LossScaling makes it the micro-batch loss (docs/design.md §3.9). A count of 0 (every label masked)
    gives 0, not NaN: the loss sum is then 0 too. Packed documents (``make_microbatch``): ``position_ids``
    restart per document and ``documents`` bound the attention."""
    assert isinstance(chunk, GPTModel)
    tokens = mb["tokens"] if chunk.pre_process else None
    where = {"sequence_index": mb.get("sequence_index"), "position_ids": mb.get("position_ids"),
             "documents": mb.get("documents")}
    if not chunk.post_process:
        return chunk(tokens, hidden=hidden, **where)
    shifts = None
    if chunk.mtp is not None and torch.is_grad_enabled() and "sequence_index" in mb and chunk.pg.cp_size > 1:
        # context parallelism: the MTP shifts run along the whole sequences (one CP all-gather of the ids)
        shifts = Shifts(mb["tokens"], mb["labels"], mb["loss_mask"], chunk.pg, mb["sequence_index"])
    per_token = chunk(tokens, labels=mb["labels"], hidden=hidden, mtp_tokens=mb["tokens"], mtp_shifts=shifts,
                      **where)
    mask = mb["loss_mask"]
    count = mb["num_tokens"] if "num_tokens" in mb else mask.sum()
    loss = (per_token.float() * mask).sum() / (count + (count == 0))
    if chunk.mtp_per_token is None:
        return loss
    # --mtp-num-layers: the depths' losses join the gradient, not the value (model/mtp.py); with
    # --calculate-per-token-loss every depth divides by "num_tokens", else by its own shifted mask's count (of the
    # whole sequences with context parallelism: this rank's share)
    per_token_count = mb.get("num_tokens") if mb.get("per_token_loss", shifts is None) else None
    term, logged = mtp_loss(chunk.mtp_per_token, mask, per_token_count, chunk.cfg.mtp_loss_scaling_factor, shifts)
    chunk.mtp_per_token = None
    if chunk.training:
        chunk.mtp_losses.add(logged)
    return AddToGradient.apply(loss, term)


def hidden_shape(chunk: GPTModel, tokens: torch.Tensor, tp_size: int) -> tuple[int, int, int]:
    """[s, b, h] of the hidden states between stages for ``tokens`` [b, s] (s / tp with sequence parallelism)."""
    b, s = tokens.shape
    return (s // (tp_size if chunk.ctx.sequence_parallel else 1), b, chunk.cfg.hidden_size)
