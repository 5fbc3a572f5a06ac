"""Which global layers each virtual pipeline stage holds and which (rank, chunk) holds each virtual stage:
the one placement rule that model building, checkpointing (stage_params), config validation and the
planner all read, so a checkpoint's layout-free keys mean the same layers everywhere.

Pure arithmetic (no torch), so it sits below config and planning. Two placements of the p·v virtual
stages (``StageMap``): round-robin (1F1B, interleaved 1F1B: stage s = chunk·p + rank) and the V of ZB-V
(two chunks per rank: chunk 0 is stage r, chunk 1 stage 2p−1−r). The layers are cut in pipeline order,
virtual stage 0 first (``LayerSplit.counts``): evenly, or as Megatron-LM's uneven flags say.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
VSTAGES, LAYOUT = "--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-layout"


@dataclass(frozen=True)
class StageMap:
    pp: int
    vp: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        if self.v_shape and self.vp != 2:
            raise ValueError(f"the V-shaped placement holds 2 chunks per rank, not {self.vp}")

    @property
    def last(self) -> int:
        return self.pp * self.vp - 1

    def stage(self, rank: int, chunk: int) -> int:
        if self.v_shape:
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        return chunk * self.pp + rank

    def holder(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual stage ``stage``."""
        if self.v_shape:
            return (stage, 0) if stage < self.pp else (2 * self.pp - 1 - stage, 1)
        return stage % self.pp, stage // self.pp


@dataclass(frozen=True)
class LayerSplit:
    """How ``num_layers`` layers are cut over the p·v virtual stages. ``first``/``last``: the layers of
    the first/last pipeline rank (round-robin; with v chunks each of its chunks holds 1/v of them) or of
    the V's first/last virtual stage (ZB-V: rank 0's chunk 0 and chunk 1); the other stages split the
    rest evenly. ``embedding``/``loss``: the embedding/loss counts as one layer of an even split.
    ``layout``: every virtual stage's count, given (--pipeline-model-parallel-layout)."""

    num_layers: int
    pp: int
    vp: int = 1
    v_shape: bool = False
    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    layout: tuple[int, ...] | None = None

    @property
    def stages(self) -> StageMap:
        return StageMap(self.pp, self.vp, self.v_shape)

    @property
    def n(self) -> int:
        return self.pp * self.vp

    @property
    def even(self) -> bool:
        """No uneven flag: every virtual stage holds num_layers / (p·v) layers."""
        return (self.first, self.last, self.embedding, self.loss, self.layout) == (None, None, False, False, None)

    def errors(self) -> list[str]:
        """Why the flags cannot cut the layers (empty when they can); one line per broken rule."""
        if self.even:
            return [] if self.num_layers % self.n == 0 else [
                f"--num-layers ({self.num_layers}) must be divisible by the {self.n} virtual pipeline stages"]
        errors = self._flag_errors()
        if not errors:
            errors = [f"{self._source()}: virtual stage {s} would hold no layer (only the stages holding the "
                      "embedding or the loss may be empty)"
                      for s, c in enumerate(self.counts) if c == 0 and 0 < s < self.n - 1]
        return errors

    def _source(self) -> str:
        if self.layout is not None:
            return LAYOUT
        return " / ".join(f for f, on in ((FIRST, self.first is not None), (LAST, self.last is not None),
                                          (EMBEDDING, self.embedding), (LOSS, self.loss)) if on)

    def _flag_errors(self) -> list[str]:
        if self.layout is not None:
            given = sum(self.layout)
            if len(self.layout) != self.n:
                need = (f"2 x --pipeline-model-parallel-size ({self.n}) under ZB-V's V" if self.v_shape
                        else f"a multiple of --pipeline-model-parallel-size ({self.pp})")
                return [f"{LAYOUT} has {len(self.layout)} stages; it needs {need}"]
            return [] if given == self.num_layers else [
                f"{LAYOUT} holds {given} transformer layers (t), --num-layers is {self.num_layers}"]
        if (self.first is not None or self.last is not None) and (self.embedding or self.loss):
            return [f"{EMBEDDING} / {LOSS} and {FIRST} / {LAST} are exclusive (the account-for flags "
                    "count the embedding / the loss as a layer of an even split)"]
        if self.pp == 1:
            return [f"{self._source()} needs --pipeline-model-parallel-size > 1"]
        if self.embedding or self.loss:
            total = self.num_layers + self.embedding + self.loss
            return [] if total % self.n == 0 else [
                f"{self._source()}: --num-layers ({self.num_layers}) + {self.embedding + self.loss} must be divisible "
                f"by the {self.n} virtual pipeline stages"]
        return self._first_last_errors()

    def _first_last_errors(self) -> list[str]:
        per = 1 if self.v_shape else self.vp  # virtual stages a first/last count is spread over
        errors = [f"{flag} ({k}) must be divisible by {VSTAGES} ({self.vp}): each of the rank's model chunks "
                  "holds an equal share" for flag, k in ((FIRST, self.first), (LAST, self.last))
                  if k is not None and k % per]
        rest = self.num_layers - (self.first or 0) - (self.last or 0)
        middle = self._middle_stages()
        if rest < 0:
            errors.append(f"{self._source()} ({(self.first or 0) + (self.last or 0)} layers) exceed --num-layers "
                          f"({self.num_layers})")
        elif middle == 0 and rest:
            errors.append(f"{FIRST} + {LAST} ({self.num_layers - rest}) must equal --num-layers "
                          f"({self.num_layers}): no stage is left for the other {rest}")
        elif middle and rest % middle:
            errors.append(f"{self._source()}: the remaining {rest} of --num-layers ({self.num_layers}) must split "
                          f"evenly over the {middle} other virtual pipeline stages")
        return errors

    def _middle_stages(self) -> int:
        """The virtual stages sharing the layers the first/last counts leave."""
        if self.v_shape:
            return self.n - (self.first is not None) - (self.last is not None)
        return (self.pp - (self.first is not None) - (self.last is not None)) * self.vp

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Layers of every virtual stage, in pipeline order (valid when ``errors()`` is empty)."""
        n = self.n
        if self.layout is not None:
            return tuple(self.layout)
        if self.embedding or self.loss:
            per = (self.num_layers + self.embedding + self.loss) // n
            out = [per] * n
            out[0] -= self.embedding
            out[-1] -= self.loss
            return tuple(out)
        if self.first is None and self.last is None:
            return (self.num_layers // n,) * n
        middle = self._middle_stages()
        share = (self.num_layers - (self.first or 0) - (self.last or 0)) // middle if middle else 0
        out = [share] * n
        ends = [(0, self.first), (n - 1, self.last)] if self.v_shape else [
            (c * self.pp + r, k // self.vp) for r, k in ((0, self.first), (self.pp - 1, self.last))
            for c in range(self.vp) if k is not None]
        for s, k in ends:
            if k is not None:
                out[s] = k
        return tuple(out)

    def stage_layers(self, stage: int) -> list[int]:
        """Global layer numbers of virtual stage ``stage`` (contiguous, in pipeline order)."""
        start = sum(self.counts[:stage])
        return list(range(start, start + self.counts[stage]))

    def layers(self, rank: int, chunk: int) -> list[int]:
        """Global layer numbers of (pipeline rank, model chunk)."""
        return self.stage_layers(self.stages.stage(rank, chunk))

    def rank_layers(self, rank: int) -> list[int]:
        """All the layers a pipeline rank holds (its chunks in order)."""
        return [i for c in range(self.vp) for i in self.layers(rank, c)]

    def rank_chunks(self, rank: int) -> list[list[int]]:
        """Each of a pipeline rank's chunks' layer numbers (what a checkpoint's ``chunk_layers`` records)."""
        return [self.layers(rank, c) for c in range(self.vp)]

    def chunk_table(self) -> list[list[list[int]]]:
        """``rank_chunks`` of every pipeline rank."""
        return [self.rank_chunks(r) for r in range(self.pp)]
