"""GPT: token (+ learned position) embedding -> transformer layers -> final norm -> output layer.

A pipeline stage builds only its part: ``pre_process`` (first stage) owns the embedding,
``post_process`` (last stage) the final norm, output layer and loss. Layers are keyed by their
global number, so parameter names (``layers.7.mlp.fc1.weight``) are the same in every layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megalite.attention import Documents
from megalite.config.model import ModelConfig
from megalite.model.mtp import MTPBlock, MTPLosses, Shifts
from megalite.model.norm import Norm
from megalite.model.rope import KindAngles, rope_frequencies, rope_scaling
from megalite.model.transformer import TransformerLayer
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.cross_entropy import softcap, vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megalite.tensor_parallel.layers import (
    ColumnParallelLinear,
    ReplicatedEmbedding,
    VocabParallelEmbedding,
    linear_gathering_sequence,
    padded_vocab_size,
)
from megalite.tensor_parallel.mappings import copy_to_tp, gather_from_tp, scatter_to_sp
from megalite.tensor_parallel.param_meta import amend_param
from megalite.tensor_parallel.random import hidden_dropout
from megalite.tensor_parallel.recompute import recompute
from megalite.tensor_parallel.sharding import VocabShardSpec
from megalite.tensor_parallel.weight_grad import linear

TIED_EMBEDDING = "embedding.word.weight"


def _run(layers: list[nn.Module], x: torch.Tensor, angles: torch.Tensor | None,
         documents: Documents | None = None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, angles, None, documents)
    return x


class Embedding(nn.Module):
    """Token embedding (vocab-parallel) plus learned absolute positions, then dropout. -> [s, b, h]"""

    def __init__(self, cfg: ModelConfig, ctx: BuildContext, vocab_size: int, padded_vocab: int) -> None:
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.word = VocabParallelEmbedding(vocab_size, padded_vocab, cfg.hidden_size, ctx)
        self.position = (ReplicatedEmbedding(cfg.max_position_embeddings, cfg.hidden_size, ctx)
                         if cfg.position_embedding_type == "learned_absolute" else None)

    def forward(self, tokens: torch.Tensor, position_offset: int = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the tokens' positions when they are not consecutive, [s] (context parallelism) or
        [b, s] (each sample's own: reset after every document)."""
        x = self.word(tokens)  # [s, b, h], summed over TP
        if self.cfg.embedding_multiplier != 1.0:  # rounded to the run's dtype first, as transformers does
            x = x * x.new_tensor(self.cfg.embedding_multiplier)
        if self.position is not None:
            if positions is None:
                pos = self.position.weight[position_offset: position_offset + tokens.shape[1]].unsqueeze(1)
            else:
                pos = self.position.weight[positions]
                pos = pos.unsqueeze(1) if positions.dim() == 1 else pos.transpose(0, 1)
            x = x + pos
        ctx = self.ctx
        if ctx.sequence_parallel:
            x = scatter_to_sp(x, ctx.pg)
        return hidden_dropout(x, self.cfg.hidden_dropout if self.training else 0.0, ctx.tracker,
                              ctx.sequence_parallel)


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: BuildContext, vocab_size: int, *,
                 layer_numbers: Sequence[int] | None = None, pre_process: bool = True,
                 post_process: bool = True) -> None:
        """``layer_numbers``: the global numbers of this chunk's layers (default all); ``pre_process`` /
        ``post_process``: this chunk holds the embedding / the final norm, output layer and loss."""
        super().__init__()
        self.cfg, self.ctx, self.pg, self.vocab_size = cfg, ctx, ctx.pg, vocab_size
        self.pre_process, self.post_process = pre_process, post_process
        self.padded_vocab = padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by, ctx.pg.tp_size)
        layer_numbers = list(range(cfg.num_layers)) if layer_numbers is None else list(layer_numbers)
        if pre_process:
            self.embedding = Embedding(cfg, ctx, vocab_size, self.padded_vocab)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ctx, i) for i in layer_numbers})
        if post_process:
            self.final_norm = Norm(cfg, ctx)
            if cfg.tied_embeddings and pre_process:
                self.output_layer = None  # use the embedding's weight
            else:
                self.output_layer = ColumnParallelLinear(
                    cfg.hidden_size, self.padded_vocab, ctx, bias=False,
                    spec=VocabShardSpec(dim=0, vocab_size=vocab_size, padded_vocab=self.padded_vocab))
                amend_param(self.output_layer.weight, full_shape=(vocab_size, cfg.hidden_size))
                if cfg.tied_embeddings:  # the last stage's copy of the tied embedding
                    amend_param(self.output_layer.weight, copy_of=TIED_EMBEDDING, tied_embedding=True)
        # --mtp-num-layers: the depths on the last stage, which look the shifted tokens up in the embedding, the
        # tied output layer's copy, or (untied) a copy of their own tied like it (model/mtp.py)
        self.mtp = MTPBlock(cfg, ctx) if post_process and cfg.mtp_depths else None
        self.mtp_embedding = None
        if self.mtp is not None and not pre_process and not cfg.tied_embeddings:
            self.mtp_embedding = VocabParallelEmbedding(vocab_size, self.padded_vocab, cfg.hidden_size, ctx)
            amend_param(self.mtp_embedding.weight, copy_of=TIED_EMBEDDING, tied_embedding=True,
                        embedding_or_output=True)
        self.mtp_losses = MTPLosses(cfg.mtp_depths) if self.mtp is not None else None
        self.mtp_per_token: list[torch.Tensor] | None = None  # the last forward's, read by the forward step
        if (cfg.tied_embeddings or cfg.mtp_depths) and pre_process and not post_process:  # the first stage's tie
            amend_param(self.embedding.word.weight, tied_embedding=True)
        if pre_process:
            amend_param(self.embedding.word.weight, embedding_or_output=True)
        if post_process and self.output_layer is not None:
            amend_param(self.output_layer.weight, embedding_or_output=True)
        self._rope_cache: tuple[int, torch.device, torch.Tensor | KindAngles] | None = None

    def _rope(self, seq_len: int, device: torch.device, offset: int = 0) -> torch.Tensor | KindAngles | None:
        """Angles of positions offset..offset+seq_len-1 (each position's angles do not depend on how
        many positions were computed, so a longer cached table is sliced); with --rotary-base-local the
        windowed layers' own angles beside the others' (``KindAngles``)."""
        cfg = self.cfg
        if not cfg.rotary:  # plain RoPE or YaRN
            return None
        end = offset + seq_len
        if self._rope_cache is None or self._rope_cache[0] < end or self._rope_cache[1] != device:
            rot = cfg.rotary_dim  # the rotated channels per head (MLA: --qk-pos-emb-head-dim)
            table = rope_frequencies(end, rot, cfg.rotary_base, device, rope_scaling(cfg),
                                     cfg.rotary_seq_len_interpolation_factor)
            if cfg.rotary_base_local is not None:  # windowed layers: their own base, unscaled
                table = KindAngles(table, rope_frequencies(end, rot, cfg.rotary_base_local, device))
            self._rope_cache = (end, device, table)
        table = self._rope_cache[2]
        return table.map(lambda t: t[offset:end]) if isinstance(table, KindAngles) else table[offset:end]

    def _run_layers(self, x: torch.Tensor, angles: torch.Tensor | None, documents: Documents | None = None
                    ) -> torch.Tensor:
        """The layers, with full recomputation where configured: 'uniform' checkpoints groups of
        --recompute-num-layers layers, 'block' the first --recompute-num-layers layers of this chunk."""
        layers = list(self.layers.values())
        cfg = self.cfg
        if cfg.recompute_granularity != "full" or not self.training:
            return _run(layers, x, angles, documents)
        n = cfg.recompute_num_layers
        if cfg.recompute_method in (None, "uniform"):
            for i in range(0, len(layers), n):
                group = layers[i:i + n]
                x = recompute(lambda h, a, d, g=group: _run(g, h, a, d), self.ctx.tracker, x, angles, documents)
            return x
        for i, layer in enumerate(layers):
            x = _run([layer], x, angles, documents) if i >= n else recompute(
                lambda h, a, d, one=layer: _run([one], h, a, d), self.ctx.tracker, x, angles, documents)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocab columns of the logits, [s, b, v_pad/tp], from final hidden states."""
        return self._project(self.final_norm(hidden))

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer (or the tied embedding) on final-normed hidden states."""
        if self.output_layer is None:
            if self.ctx.sequence_parallel:
                return linear_gathering_sequence(hidden, self.embedding.word.weight, None, self.pg)
            return linear(copy_to_tp(hidden, self.pg), self.embedding.word.weight)
        return self.output_layer(hidden)

    def forward(self, tokens: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, kv_cache=None, sequence_index: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, documents: Documents | None = None,
                mtp_tokens: torch.Tensor | None = None, mtp_shifts: Shifts | None = None) -> torch.Tensor:
        """First stage: tokens [b, s]; other stages: ``hidden`` [s, b, h] from the previous stage.

        Returns the per-token loss [b, s] when ``labels`` is given on the last stage, the full logits
        [b, s, vocab] on the last stage without labels, else the hidden states for the next stage.
        ``kv_cache`` (inference, see megalite/inference/kv_cache.py): the new tokens sit at positions
        ``kv_cache.offset`` onwards and attend to the cached keys/values of ``kv_cache.layer(number)``.
        ``sequence_index`` [s] (context parallelism): where this rank's tokens sit in the sequences, which
        causality follows; ``position_ids`` [b, s] (--reset-position-ids): the positions the learned or
        rotary embeddings see, else the sequence index; ``documents`` (--reset-attention-mask): attention
        stays inside each packed document. ``mtp_tokens`` [b, s] (--mtp-num-layers, a stage without the
        embedding): the input tokens, whose shifts the MTP depths embed; their token losses are left in
        ``mtp_per_token`` for the forward step. ``mtp_shifts`` (context parallelism): the tokens and labels
        shifted along the whole sequences (model/mtp.py), in place of this rank's own shifted."""
        offset = 0 if kv_cache is None else kv_cache.offset
        positions = position_ids if position_ids is not None else sequence_index
        x = self.embedding(tokens, offset, positions) if self.pre_process else hidden
        if positions is None:
            seq_len = x.shape[0] * (self.pg.tp_size if self.ctx.sequence_parallel else 1)
            angles = self._rope(seq_len, x.device, offset)
        else:
            angles = self._rope(self.cfg.seq_length, x.device)
            index = positions if positions.dim() == 1 else positions.t()
            if isinstance(angles, KindAngles):
                angles = angles.map(lambda t: t[index])
            elif angles is not None:
                angles = angles[index]
        if kv_cache is None:
            x = self._run_layers(x, angles, documents)
        else:
            for number, layer in self.layers.items():
                x = layer(x, angles, kv_cache.layer(int(number)))
        if not self.post_process:
            return x
        cap = self.cfg.final_logit_softcapping  # logits C * tanh(logits / C) in the loss and in the logits
        if labels is None:
            full = gather_from_tp(self.logits(x), self.pg, dim=-1)[..., : self.vocab_size]
            return (full if cap is None else softcap(full, cap)).transpose(0, 1).contiguous()
        normed = self.final_norm(x)
        # each depth's token losses against the labels shifted 1 + depth ahead; they change only gradients, so a
        # forward without them (evaluation) skips them
        if self.mtp is not None and torch.is_grad_enabled():
            table = (self.embedding.word.weight if self.pre_process else self.output_layer.weight
                     if self.mtp_embedding is None else self.mtp_embedding.weight)
            shifts = mtp_shifts or Shifts(tokens if tokens is not None else mtp_tokens, labels, None)
            hiddens = self.mtp(normed, shifts, table, angles, documents)
            self.mtp_per_token = [self._token_loss(h, shifts.labels(k + 1)) for k, h in enumerate(hiddens)]
        return self._token_loss(normed, labels)

    def _token_loss(self, normed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] of final-normed hidden states against ``labels`` [b, s]."""
        cap = self.cfg.final_logit_softcapping
        if self.cfg.cross_entropy_loss_fusion:  # never the full fp32 logits
            weight = self.embedding.word.weight if self.output_layer is None else self.output_layer.weight
            return fused_linear_cross_entropy(normed, weight, labels.t(), self.pg, self.vocab_size,
                                              self.ctx.sequence_parallel, softcap=cap).t()
        return vocab_parallel_cross_entropy(self._project(normed), labels.t(), self.pg, self.vocab_size,
                                            softcap=cap).t()
