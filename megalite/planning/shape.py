"""The numbers every memory and time term reads, derived once from a run config and a world size."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.arguments import MegaliteConfig


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

    @classmethod
    def of(cls, cfg: MegaliteConfig, world: int, vocab: int) -> "RunShape":
        p, t, pr = cfg.parallel, cfg.training, cfg.precision
        tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
        dp = max(world // (tp * pp * cp), 1)
        k = p.num_layers_per_virtual_pipeline_stage
        v = cfg.model.num_layers // (pp * k) if k and pp > 1 else 1
        gbs = t.global_batch_size or t.micro_batch_size * dp
        m = max(gbs // (t.micro_batch_size * dp), 1)
        low = pr.bf16 or pr.fp16
        return cls(cfg, world, vocab, tp, pp, cp, dp, v, m, t.micro_batch_size, cfg.model.seq_length,
                   cfg.model.hidden_size, p.sequence_parallel and tp > 1, cfg.model.recompute_granularity,
                   2 if low else 4, 2 if cfg.ddp.grad_reduce_in_bf16 else 4)

    @property
    def layers_per_stage(self) -> int:
        return self.cfg.model.num_layers // self.pp

    @property
    def layers_per_chunk(self) -> int:
        return self.layers_per_stage // self.v

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
