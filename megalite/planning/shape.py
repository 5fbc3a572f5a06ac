"""The numbers every memory and time term reads, derived once from a run config and a world size."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megalite.config.arguments import MegaliteConfig
from megalite.parallel.placement import LayerSplit
from megalite.planning.model_shape import EXPERT_FAMILY, LayerShape, ModelShape


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """docs/design.md §3.1 (the same rule as tensor_parallel/layers.py, which needs torch)."""
    unit = divisible_by * tp
    return -(-vocab // unit) * unit


@dataclass(frozen=True)
class RunShape:
    cfg: MegaliteConfig
    world: int
    vocab: int
    tp: int
    pp: int
    cp: int
    dp: int
    v: int  # model chunks per pipeline rank (interleaving)
    m: int  # micro-batches per step per pipeline
    b: int
    s: int
    h: int
    sp: bool
    recompute: str | None
    param_bytes: int  # bytes per weight element (bf16/fp16: 2, fp32: 4)
    grad_bytes: int  # bytes per gradient element in the gradient buffer
    ep: int = 1  # expert parallel: a stage's ranks cut as expert-TP x EP x expert-DP
    etp: int = 1  # expert tensor parallel
    model_shape: ModelShape = ModelShape(())  # each layer's kind (model_shape.py); every layer term sums over it
    te_layers: bool = False  # activations as Megatron-Core's Transformer Engine layers keep them (memory.py)

    @classmethod
    def of(cls, cfg: MegaliteConfig, world: int, vocab: int) -> "RunShape":
        p, t, pr = cfg.parallel, cfg.training, cfg.precision
        tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
        dp = max(world // (tp * pp * cp), 1)
        # ZB-V's two chunks are modelled as one chunk of the rank's layers; its bubble and deferred W's are
        # planning/zero_bubble.py's
        v = p.virtual_stages(cfg.model.num_layers) if pp > 1 and p.pipeline_schedule != "zbv" else 1
        gbs = t.global_batch_size or t.micro_batch_size * dp
        m = max(gbs // (t.micro_batch_size * dp), 1)
        low = pr.bf16 or pr.fp16
        model = ModelShape.of(cfg.model)
        experts = EXPERT_FAMILY in model.families  # EP and expert-TP cut only the expert family
        return cls(cfg, world, vocab, tp, pp, cp, dp, v, m, t.micro_batch_size, cfg.model.seq_length,
                   cfg.model.hidden_size, p.sequence_parallel and tp > 1, cfg.model.recompute_granularity,
                   2 if low else 4, 2 if cfg.ddp.grad_reduce_in_bf16 else 4,
                   p.expert_model_parallel_size if experts else 1,
                   (p.expert_tensor_parallel_size or tp) if experts else 1, model)

    @property
    def edp(self) -> int:
        """Expert data parallel: the stage's ranks (TP x CP x DP) over expert-TP x EP."""
        return max(self.tp * self.cp * self.dp // (self.ep * self.etp), 1)

    @property
    def cp_a2a(self) -> int:
        """a2a+p2p's all-to-all group: the first --hierarchical-context-parallel-sizes (cp without them)."""
        sizes = self.cfg.parallel.hierarchical_context_parallel_sizes
        return sizes[0] if sizes else self.cp

    @property
    def families(self) -> tuple[str, ...]:
        """The parameter families the model has (model_shape.py): "expert" only with MoE layers."""
        return self.model_shape.families

    @cached_property
    def split(self) -> LayerSplit:
        """The layer placement the run builds (parallel/placement.py): even or Megatron-LM's uneven flags;
        a shape re-cut to other sizes (e.g. the whole model on one rank, for its parameter count) is even."""
        split = self.cfg.parallel.layer_split(self.cfg.model.num_layers)
        if (split.pp, 1 if split.v_shape else split.vp) == (self.pp, self.v):
            return split
        return LayerSplit(self.cfg.model.num_layers, self.pp, self.v)

    def chunk_layers(self, stage: int, chunk: int) -> list[int]:
        """Global layer numbers of (pipeline rank, model chunk), as the model is built (ZB-V's V: all the
        rank's layers, its chunks modelled as one)."""
        if self.split.v_shape:
            return self.split.rank_layers(stage)
        return self.split.layers(stage, chunk)

    def layers_in(self, stage: int) -> int:
        """Transformer layers of a pipeline rank (all its chunks)."""
        return len(self.split.rank_layers(stage))

    def chunk_size(self, stage: int, chunk: int | None = None) -> float:
        """Layers of one chunk of a pipeline rank (chunk None: the mean over its chunks)."""
        if chunk is None:
            return self.layers_in(stage) / self.v
        return len(self.chunk_layers(stage, chunk))

    @property
    def busiest_stage(self) -> int:
        """The pipeline rank with the most layers (the first of them): the one that paces an uneven pipeline."""
        return max(range(self.pp), key=lambda r: (self.layers_in(r), -r))

    @property
    def loss_rank(self) -> int:
        """The pipeline rank holding the output layer and the loss (ZB-V: rank 0, its second chunk)."""
        return self.split.stages.holder(self.split.stages.last)[0] if self.pp > 1 else 0

    @cached_property
    def _kinds_per_chunk(self) -> dict[tuple[int, int], dict[LayerShape, int]]:
        return {(r, c): self.model_shape.count(self.chunk_layers(r, c)) for r in range(self.pp)
                for c in range(self.v)}

    @cached_property
    def _kinds_per_stage(self) -> dict[int, dict[LayerShape, int]]:
        out: dict[int, dict[LayerShape, int]] = {r: {} for r in range(self.pp)}
        for (r, _), kinds in self._kinds_per_chunk.items():
            for kind, n in kinds.items():
                out[r][kind] = out[r].get(kind, 0) + n
        return out

    def kinds_in(self, stage: int, chunk: int | None = None) -> dict[LayerShape, int]:
        """How many layers of each kind a pipeline rank holds (one chunk of it, or all its chunks)."""
        if chunk is not None:
            return self._kinds_per_chunk[(stage, chunk)]
        return self._kinds_per_stage[stage]

    def moe_layers_in(self, stage: int, chunk: int | None = None) -> int:
        """MoE layers on a pipeline rank (one chunk of it, or all its chunks)."""
        return sum(n for kind, n in self.kinds_in(stage, chunk).items() if kind.moe)

    @property
    def layers_per_stage(self) -> int:
        """Layers of the fullest pipeline rank (an even split: num_layers / p)."""
        return self.layers_in(self.busiest_stage)

    @property
    def recomputed_share(self) -> float:
        """The share of a chunk's layers full recomputation runs forward again: all of them (uniform), or
        the first --recompute-num-layers of each chunk (block); 0 without full recomputation."""
        m = self.cfg.model
        if self.recompute != "full":
            return 0.0
        if m.recompute_method == "block":
            return min(m.recompute_num_layers, self.layers_per_chunk) / max(self.layers_per_chunk, 1)
        return 1.0

    @property
    def layers_per_chunk(self) -> int:
        """Layers of the largest chunk."""
        return max(len(self.chunk_layers(r, c)) for r in range(self.pp) for c in range(self.v))

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.vocab, self.cfg.model.make_vocab_size_divisible_by, self.tp)

    @property
    def act_bytes(self) -> int:
        """Bytes of one activation element (activations have the weights' dtype)."""
        return self.param_bytes

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one rank: the sequence is split over CP (and over TP with SP,
        for the elementwise activations only)."""
        return self.b * self.s // self.cp

    @property
    def dtype(self) -> str:
        pr = self.cfg.precision
        return "bf16" if pr.bf16 else "fp16" if pr.fp16 else "fp32"
