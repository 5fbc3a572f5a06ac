"""Token dispatch: each kept (token, expert) assignment to the rank holding that expert, and back.

Experts are split over EP ranks in contiguous blocks (EP rank r holds experts r*E/ep ... (r+1)*E/ep - 1);
each expert's hidden size may be split again over expert-TP ranks, which then all see the same tokens and
return partial sums. Two ways to move the tokens, with the same result:

- ``alltoall``: sort this rank's assignments by expert, exchange the per-expert counts over EP, send each
  EP rank exactly the rows it needs (one uneven all-to-all), gather them over expert-TP (an all-to-all
  that sends every rank the whole block), regroup by local expert; back the same way (the expert-TP step
  sums the partials). Bytes: each assigned row once per direction over EP, x etp over expert-TP.
- ``allgather``: all-gather every token (and its routing) over expert-TP x EP, run the local experts on
  the assignments that name them, reduce-scatter the weighted sums back (partials and other ranks'
  experts summed in one collective). Bytes: the whole group's tokens, both ways.

``dispatch`` returns the local experts' input sorted by expert with the row count of each; ``combine``
takes their output in that order and returns [T, h], the probability-weighted sum per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.moe.comm import all_to_all_v, gather_rows, gather_rows_nograd, reduce_scatter_rows
from megalite.moe.router import Routing, capacity
from megalite.parallel.groups import Group, ProcessGroups


def _sort_blocks(sizes: torch.Tensor) -> torch.Tensor:
    """Rows laid out as blocks ``sizes`` [a, b] (block (i, j) after (i, j-1), then rows of i+1) reordered as
    (j, i): the permutation index (new row -> old row)."""
    a, b = sizes.shape
    block = torch.arange(a * b, device=sizes.device).repeat_interleave(sizes.reshape(-1))
    return torch.sort((block % b) * a + block // b, stable=True).indices


@dataclass
class _State:
    """What combine needs from dispatch."""

    slot_token: torch.Tensor  # [n] the token each dispatched row came from (T: a padding row)
    slot_prob: torch.Tensor  # [n] its routing weight (0 for padding)
    tokens: int
    splits: tuple = ()  # alltoall: (EP send, EP receive, expert-TP rows per rank)
    order: torch.Tensor | None = None  # rows regrouped by local expert (new -> old)
    inverse: torch.Tensor | None = None  # old -> new


class Dispatcher:
    """Shared by both: which of this rank's experts an assignment names, and the sort by expert."""

    def __init__(self, num_experts: int, pg: ProcessGroups, topk: int = 1, pad_factor: float | None = None) -> None:
        self.pg, self.E, self.topk = pg, num_experts, topk
        self.ep, self.etp = pg.size(Group.EP), pg.size(Group.ETP)
        self.local = num_experts // self.ep
        self.first = pg.index(Group.EP) * self.local
        self.pad_factor = pad_factor  # alltoall: every expert's rows from a rank padded to the capacity

    def _assignments(self, routing: Routing, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kept assignments sorted by expert (stable, so by token within an expert): (token, prob, expert,
        count per expert [num_experts])."""
        k = routing.experts.shape[1]
        flat = routing.kept.reshape(-1).nonzero().squeeze(1)
        expert = routing.experts.reshape(-1)[flat]
        order = torch.sort(expert, stable=True).indices
        sel = flat[order]
        return sel // k, routing.probs.reshape(-1)[sel], expert[order], torch.bincount(expert, minlength=num_experts)

    def _padded(self, token: torch.Tensor, prob: torch.Tensor, counts: torch.Tensor, tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every expert's rows padded to the capacity with padding rows (token index ``tokens``, weight 0)."""
        cap, dev = capacity(tokens, self.topk, self.E, self.pad_factor), counts.device
        starts = counts.cumsum(0) - counts
        slot = (torch.arange(self.E, device=dev).repeat_interleave(counts) * cap
                + torch.arange(int(counts.sum()), device=dev) - starts.repeat_interleave(counts))
        tok = torch.full((self.E * cap,), tokens, dtype=torch.long, device=dev).index_copy(0, slot, token)
        pr = prob.new_zeros(self.E * cap).index_copy(0, slot, prob)
        return tok, pr, torch.full_like(counts, cap)

    @staticmethod
    def _weighted_sum(rows: torch.Tensor, st: _State) -> torch.Tensor:
        """[T, h]: each token's rows times their routing weights, summed (fp32 accumulation)."""
        out = rows.new_zeros((st.tokens + 1, rows.shape[1]), dtype=torch.float32)
        out.index_add_(0, st.slot_token, rows.float() * st.slot_prob.unsqueeze(1))
        return out[: st.tokens].to(rows.dtype)


class AllToAllDispatcher(Dispatcher):
    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], _State]:
        pg, T = self.pg, x.shape[0]
        token, prob, _, counts = self._assignments(routing, self.E)
        if self.pad_factor is not None:
            token, prob, counts = self._padded(token, prob, counts, T)
        source = torch.cat([x, x.new_zeros((1, x.shape[1]))]) if self.pad_factor is not None else x  # + a zero row
        rows = source.index_select(0, token)
        per_rank = counts.view(self.ep, self.local)
        recv = torch.empty_like(per_rank)  # [source EP rank, local expert]
        pg.all_to_all(recv, per_rank.contiguous(), Group.EP, label="moe_counts")
        send_splits, recv_splits = per_rank.sum(1).tolist(), recv.sum(1).tolist()
        rows = all_to_all_v(rows, pg, Group.EP, recv_splits, send_splits)
        blocks = recv.unsqueeze(0)  # [expert-TP source, EP source, local expert]
        etp_rows = [rows.shape[0]]
        if self.etp > 1:
            blocks = gather_rows_nograd(recv.unsqueeze(0), pg, Group.ETP)
            etp_rows = blocks.sum((1, 2)).tolist()
            rows = all_to_all_v(rows.repeat(self.etp, 1), pg, Group.ETP, etp_rows, [rows.shape[0]] * self.etp)
        order = _sort_blocks(blocks.reshape(-1, self.local))
        st = _State(token, prob, T, (send_splits, recv_splits, etp_rows), order, torch.argsort(order))
        return rows.index_select(0, order), blocks.sum((0, 1)).tolist(), st

    def combine(self, y: torch.Tensor, st: _State) -> torch.Tensor:
        pg = self.pg
        send_splits, recv_splits, etp_rows = st.splits
        y = y.index_select(0, st.inverse)
        if self.etp > 1:  # every expert-TP rank's partial sums of this rank's rows, added
            n = sum(recv_splits)
            y = all_to_all_v(y, pg, Group.ETP, [n] * self.etp, etp_rows).view(self.etp, n, -1).sum(0)
        y = all_to_all_v(y, pg, Group.EP, send_splits, recv_splits)
        return self._weighted_sum(y, st)


class AllGatherDispatcher(Dispatcher):
    def dispatch(self, x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int], _State]:
        pg, group = self.pg, Group.EMP
        every = gather_rows(x, pg, group)  # [T x (etp x ep), h]
        probs = gather_rows(routing.probs, pg, group)
        experts = gather_rows_nograd(routing.experts, pg, group)
        kept = gather_rows_nograd(routing.kept, pg, group)
        local = (experts >= self.first) & (experts < self.first + self.local)
        gathered = Routing(probs, experts - self.first, kept & local, None, routing.counts)
        token, prob, _, counts = self._assignments(gathered, self.local)
        st = _State(token, prob, every.shape[0])
        return every.index_select(0, token), counts.tolist(), st

    def combine(self, y: torch.Tensor, st: _State) -> torch.Tensor:
        return reduce_scatter_rows(self._weighted_sum(y, st), self.pg, Group.EMP)


def make_dispatcher(kind: str, num_experts: int, pg: ProcessGroups, topk: int = 1, pad_factor: float | None = None
                    ) -> Dispatcher:
    """``pad_factor``: --moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity (alltoall pads
    each expert's rows from each rank to the capacity; the allgather dispatcher does not pad, and the
    config refuses the flag with it)."""
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, pg, topk, pad_factor)
    if kind == "allgather":
        return AllGatherDispatcher(num_experts, pg, topk)
    raise ValueError(f"--moe-token-dispatcher-type must be alltoall or allgather, got {kind!r}")
