"""Forward-only passes through a model laid out over pipeline stages (and virtual chunks).

Inference needs no schedule: one batch goes through the virtual stages in order, each hands its hidden
states [s, b, h] to the next with a tagged send/recv, and the last stage returns the logits or the
per-token loss. Every rank knows the batch's shape (it holds the tokens), so receive buffers need no
shape exchange. Layers are held in eval mode by the caller; this file does no autograd.
"""

from __future__ import annotations

import torch
from torch import nn

from megalite.parallel.groups import ProcessGroups

HIDDEN_TAG = 7100  # distinct from the training executor's tags


def hidden_dtype(chunks: list[nn.Module]) -> torch.dtype:
    return next(chunks[0].parameters()).dtype


@torch.no_grad()
def pipeline_forward(chunks: list[nn.Module], pg: ProcessGroups, tokens: torch.Tensor,
                     labels: torch.Tensor | None = None, kv_cache=None) -> torch.Tensor | None:
    """Run ``tokens`` [b, s] through every virtual stage. Returns, on the ranks of the last stage, the
    model's output (per-token loss [b, s] with ``labels``, else full logits [b, s, vocab]); None elsewhere.

    Virtual stage v = chunk * pp + pp_rank (see megalite/pipeline/partition.py): ranks visit their
    chunks in that global order, so each send meets the matching receive."""
    pp, vp = pg.pp_size, len(chunks)
    b, s = tokens.shape
    hidden_size = chunks[0].cfg.hidden_size
    dtype = hidden_dtype(chunks)
    out = None
    for v in range(pp * vp):
        owner, chunk = v % pp, v // pp
        if owner != pg.pp_rank:
            continue
        model = chunks[chunk]
        if v == 0:
            x = model(tokens, labels=labels, kv_cache=kv_cache)
        else:
            x = torch.empty(s, b, hidden_size, dtype=dtype, device=tokens.device)
            pg.irecv(x, (v - 1) % pp, HIDDEN_TAG).wait()
            x = model(labels=labels, hidden=x, kv_cache=kv_cache)
        if v == pp * vp - 1:
            out = x
        else:
            pg.isend(x, (v + 1) % pp, HIDDEN_TAG).wait()
    return out


def from_last_stage(tensor: torch.Tensor | None, pg: ProcessGroups, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """The last stage's ``tensor`` on every rank of this rank's pipeline group (a broadcast over PP)."""
    if pg.pp_size == 1:
        assert tensor is not None
        return tensor
    buf = tensor.contiguous() if pg.is_last_stage else torch.empty(shape, dtype=dtype, device=device)
    return pg.broadcast(buf, "pp", src_index=pg.pp_size - 1)
