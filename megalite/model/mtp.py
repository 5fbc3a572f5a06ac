"""Multi-token prediction (--mtp-num-layers D, megatron-core's MultiTokenPredictionBlock): D sequential modules on
the last pipeline stage, module k (1-based) predicting the token k + 1 ahead of each position.

Module k takes the previous depth's hidden states h (k = 1: the main model's output after its final norm) and
the embedding e of the tokens shifted k ahead (the last k positions see token id 0, as Megatron-LM's roll fills
them), and computes  h_k = final_norm(layer(eh_proj([enorm(e); hnorm(h)])))  with one transformer layer of the
main model's last layer's kind (dense or MoE, MLA or not). The shared output head turns h_k into logits whose
labels are the main labels shifted k ahead, masked by the loss mask shifted alike (zeros past the end). Packed
documents are not treated apart: as Megatron-LM's non-packed path, the shift runs across document ends, which
the loss mask (--eod-mask-loss) and the attention's document bounds already cover. With context parallelism the
shifts are those of the whole sequence (``Shifts``: the CP ranks' token ids, labels and loss mask gathered, as
Megatron-LM rolls them across the CP ranks' chunks), and each depth's loss is this rank's share of its mean.

Parameter names (every layout): ``mtp.{k-1}.enorm.weight``, ``.hnorm.weight``, ``.eh_proj.weight`` [h, 2h]
(the input is [embedding; hidden], Megatron's order), ``.layer.*`` (a transformer layer's names), and
``.final_norm.weight``. Without the embedding on the last stage (PP > 1) the tied output layer's copy serves
as the lookup table, or, with untied output weights, ``mtp_embedding.weight``: another copy of the word
embedding, tied to the first stage's like the output layer's copy (gradients summed over the embedding group).
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.config.model import ModelConfig
from megalite.context_parallel.zigzag import natural_order
from megalite.model.norm import Norm
from megalite.model.transformer import TransformerLayer
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.layers import ColumnParallelLinear
from megalite.tensor_parallel.mappings import gather_from_tp, reduce_from_tp, scatter_to_sp
from megalite.tensor_parallel.random import hidden_dropout
from megalite.tensor_parallel.recompute import recompute
from megalite.tensor_parallel.weight_grad import embedding


def shift_left(t: torch.Tensor, k: int = 1) -> torch.Tensor:
    """``t`` [b, s] moved k positions left along the sequence, the last k filled with 0 (Megatron's roll_tensor)."""
    if k == 0:
        return t
    out = torch.zeros_like(t)
    out[:, :-k] = t[:, k:]
    return out


class Shifts:
    """A micro-batch's token ids, labels and loss mask shifted k ahead along the whole sequences. Under context
    parallelism a rank holds only its zigzag chunks, whose shifted tokens sit in other chunks: the CP ranks'
    parts (small; exact in fp64) are gathered once, put in sequence order, shifted there and cut back to this
    rank's positions (``sequence_index``)."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None, pg=None,
                 sequence_index: torch.Tensor | None = None) -> None:
        self.mask_dtype = None if loss_mask is None else loss_mask.dtype
        parts = [tokens, labels] + ([] if loss_mask is None else [loss_mask])
        full = torch.stack([t.to(torch.float64) for t in parts])  # [2 or 3, b, s]
        self.index = None
        if pg is not None and pg.cp_size > 1:
            from megalite.parallel.groups import Group

            s_local = tokens.shape[1]
            full = pg.all_gather(full, Group.CP, dim=-1)  # the ranks' parts in rank order
            full = full.index_select(-1, natural_order(s_local, pg.cp_size, full.device))
            self.index = sequence_index.to(full.device)
        self.full = full

    def _take(self, row: int, k: int) -> torch.Tensor:
        t = shift_left(self.full[row], k)
        return t if self.index is None else t.index_select(-1, self.index)

    def tokens(self, k: int) -> torch.Tensor:
        return self._take(0, k).long()

    def labels(self, k: int) -> torch.Tensor:
        return self._take(1, k).long()

    def mask(self, k: int) -> torch.Tensor:
        """This rank's part of the loss mask shifted k ahead."""
        return self._take(2, k).to(self.mask_dtype)

    def count(self, k: int) -> torch.Tensor:
        """The loss mask shifted k ahead, summed over the whole sequences (every CP rank's part)."""
        return shift_left(self.full[2], k).sum().float()


def vocab_lookup(ids: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig, ctx: BuildContext) -> torch.Tensor:
    """The word embedding of ``ids`` [b, s] from this rank's vocab rows ``weight`` (the embedding's or a copy of
    it), as the first stage's Embedding computes it (multiplier, sequence-parallel split, dropout). -> [s, b, h]"""
    pg = ctx.pg
    ids = ids.t()
    if pg.tp_size > 1:
        start = pg.tp_rank * weight.shape[0]
        outside = (ids < start) | (ids >= start + weight.shape[0])
        out = embedding((ids - start).masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
    else:
        out = embedding(ids, weight)
    x = reduce_from_tp(out, pg)
    if cfg.embedding_multiplier != 1.0:
        x = x * x.new_tensor(cfg.embedding_multiplier)
    if ctx.sequence_parallel:
        x = scatter_to_sp(x, pg)
    return x


class MTPLayer(nn.Module):
    """One depth: enorm, hnorm, eh_proj, a transformer layer and its own final norm."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, depth: int) -> None:
        """``depth``: 0-based; the layer is built as the main model's last layer (its kind, window and CP comm
        type); an MoE layer reports its metrics as layer num_layers + depth."""
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.enorm, self.hnorm = Norm(cfg, ctx), Norm(cfg, ctx)
        h = cfg.hidden_size
        self.eh_proj = ColumnParallelLinear(2 * h, h, ctx, bias=False)
        self.layer = TransformerLayer(cfg, ctx, cfg.num_layers - 1)
        if hasattr(self.layer.mlp, "layer_number"):
            self.layer.mlp.layer_number = cfg.num_layers + depth
        self.final_norm = Norm(cfg, ctx)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, angles, documents) -> torch.Tensor:
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = gather_from_tp(self.eh_proj(x), self.ctx.pg, dim=-1)  # [s, b, h] (the projection gathers SP input)
        if self.ctx.sequence_parallel:
            x = scatter_to_sp(x, self.ctx.pg)
        return self.final_norm(self.layer(x, angles, None, documents))


class MTPBlock(nn.Module):
    """The D depths; ``forward`` gives each depth's final-normed hidden states."""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext) -> None:
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.layers = nn.ModuleList(MTPLayer(cfg, ctx, k) for k in range(cfg.mtp_depths))

    @property
    def recomputed(self) -> bool:
        """--recompute-granularity full with the uniform method recomputes each depth (megatron-core skips
        'block' for MTP, so does megalite)."""
        cfg = self.cfg
        return self.training and cfg.recompute_granularity == "full" and cfg.recompute_method in (None, "uniform")

    def forward(self, normed: torch.Tensor, shifts: Shifts, weight: torch.Tensor, angles,
                documents) -> list[torch.Tensor]:
        """``normed``: the main model's final-normed output [s(/tp), b, h]; ``shifts``: the micro-batch's shifted
        token ids; ``weight``: this rank's word-embedding rows."""
        out, h = [], normed
        p = self.cfg.hidden_dropout if self.training else 0.0
        for k, layer in enumerate(self.layers):
            e = hidden_dropout(vocab_lookup(shifts.tokens(k + 1), weight, self.cfg, self.ctx), p,
                               self.ctx.tracker, self.ctx.sequence_parallel)
            if self.recomputed:  # as megatron-core's 'uniform' recomputation of each MTP layer
                h = recompute(lambda x, y, a, d, one=layer: one(x, y, a, d), self.ctx.tracker, h, e, angles,
                              documents)
            else:
                h = layer(h, e, angles, documents)
            out.append(h)
        return out


class MTPLosses:
    """Each depth's per-micro-batch loss over the logging window (training only), for the "mtp_k loss" lines."""

    def __init__(self, depths: int) -> None:
        self.sums = torch.zeros(depths, dtype=torch.float64)
        self.microbatches = 0

    def add(self, losses: list[torch.Tensor]) -> None:
        self.sums += torch.stack([x.detach().double().cpu() for x in losses])
        self.microbatches += 1


def mtp_loss(per_token: list[torch.Tensor], labels_mask: torch.Tensor, count: torch.Tensor | None,
             factor: float, shifts: Shifts | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The MTP term added to the gradient, and each depth's loss for the log. ``per_token``: depth k's token
    losses [b, s] against the labels shifted k ahead; ``labels_mask``: the loss mask [b, s]; ``count``: the
    main loss's denominator with --calculate-per-token-loss (then every depth divides by it, as Megatron-LM
    leaves the sums to the global token count), else None: each depth's mean over its shifted mask. ``shifts``
    (context parallelism): the whole sequences' shifted masks, whose counts divide this rank's sums (its share
    of each mean; the CP ranks' shares sum to it)."""
    depths = len(per_token)
    term, logged = None, []
    for k, loss in enumerate(per_token):
        mask = shift_left(labels_mask, k + 1) if shifts is None else shifts.mask(k + 1)
        total = (loss.float() * mask).sum()
        n = mask.sum() if shifts is None else shifts.count(k + 1)
        mean = total / (n + (n == 0))
        logged.append(mean)  # Megatron-LM logs the mean over the shifted mask in either case
        part = (mean if count is None else total / (count + (count == 0))) * (factor / depths)
        term = part if term is None else term + part
    return term, logged


class AddToGradient(torch.autograd.Function):
    """``main`` unchanged in value, with ``extra``'s gradient joined to it in backward: the MTP loss counts in
    the gradient, with the micro-batch's loss scaling, but not in the reported loss (megatron-core's
    MTPLossAutoScaler)."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return main.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad


@torch.no_grad()
def window_mtp_losses(chunks: list[nn.Module], pg, depths: int) -> list[float]:
    """Each depth's loss over the logging window (then cleared): the mean over the window's micro-batches of
    every data-parallel replica (Megatron-LM's "mtp_k loss"). Every rank calls it (one world all-reduce); the
    last stage's first tensor-parallel rank of each CP rank of each replica contributes (the CP ranks' shares
    of the means sum to them; the first CP rank counts the micro-batches)."""
    from megalite import device
    from megalite.parallel.groups import Group

    table = torch.zeros(depths + 1, dtype=torch.float64, device=device.current_device())
    for c in chunks:
        losses = getattr(c, "mtp_losses", None)
        if losses is not None:
            if pg.tp_rank == 0:
                table[:depths] += losses.sums.to(table.device)
                table[depths] += losses.microbatches if pg.cp_rank == 0 else 0
            c.mtp_losses = MTPLosses(depths)
    pg.all_reduce(table, Group.WORLD)
    n = float(table[depths])
    return [float(x) / n if n else 0.0 for x in table[:depths]]
