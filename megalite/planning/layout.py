"""A candidate layout (the flags the search varies), applied to a run config, and the rules it must pass.

The rules are config/validate.py's own (world size, TP/PP/VP cuts, batch divisibility, sequence and
context parallelism, hierarchical reduction): the planner never proposes a layout pretrain_gpt.py would
refuse. Only the rules that need files, a tokenizer or a device are left to the run itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from megalite.config.arguments import MegaliteConfig
from megalite.config.validate import (
    domain_check,
    model_errors,
    optimizer_errors,
    parallel_errors,
    precision_errors,
    schedule_errors,
    training_errors,
)


@dataclass(frozen=True)
class Layout:
    """What --search varies; everything else is the user's config."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    vp_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage
    micro_batch: int = 1
    sequence_parallel: bool = False
    recompute: str | None = None  # None, "selective", "full"
    sharding: str = "no_shard"  # --data-parallel-sharding-strategy: no_shard, optim, optim_grads, optim_grads_params
    ep: int = 1  # --expert-model-parallel-size
    etp: int | None = None  # --expert-tensor-parallel-size (None: TP)
    account_loss: bool = False  # --account-for-loss-in-pipeline-split: the last stage one layer fewer
    first_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_layers: int | None = None  # --decoder-last-pipeline-num-layers

    @classmethod
    def from_config(cls, cfg: MegaliteConfig) -> "Layout":
        p = cfg.parallel
        return cls(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                   p.num_layers_per_virtual_pipeline_stage, cfg.training.micro_batch_size, p.sequence_parallel,
                   cfg.model.recompute_granularity, cfg.ddp.sharding, p.expert_model_parallel_size,
                   p.expert_tensor_parallel_size, p.account_for_loss_in_pipeline_split,
                   p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)

    def apply(self, cfg: MegaliteConfig) -> MegaliteConfig:
        """A copy of ``cfg`` with this layout's flags (the sections it changes copied, the others shared:
        the search builds one per candidate)."""
        out = copy.copy(cfg)
        for section in ("model", "parallel", "training", "ddp"):
            setattr(out, section, copy.copy(getattr(cfg, section)))
        p = out.parallel
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = self.tp, self.pp
        p.context_parallel_size, p.num_layers_per_virtual_pipeline_stage = self.cp, self.vp_layers
        p.sequence_parallel = self.sequence_parallel
        p.expert_model_parallel_size, p.expert_tensor_parallel_size = self.ep, self.etp
        # the search chooses the split itself: even, the loss counted as a layer, or first/last counts
        p.account_for_loss_in_pipeline_split, p.account_for_embedding_in_pipeline_split = self.account_loss, False
        p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = self.first_layers, self.last_layers
        p.pipeline_model_parallel_layout = p.num_virtual_stages_per_pipeline_rank = None
        out.training.micro_batch_size = self.micro_batch
        out.model.recompute_granularity = self.recompute
        if self.recompute != "full":
            out.model.recompute_method = None
        out.ddp.use_distributed_optimizer = self.sharding == "optim"
        out.ddp.use_megatron_fsdp = False
        out.ddp.data_parallel_sharding_strategy = None if self.sharding in ("no_shard", "optim") else self.sharding
        if self.sharding != "optim":
            out.ddp.overlap_param_gather = False
        if self.sharding != "optim_grads_params":
            out.ddp.fsdp_keep_params_across_microbatches = False
        return out

    def flags(self) -> str:
        """The command-line flags that select this layout."""
        out = [f"--tensor-model-parallel-size {self.tp}", f"--pipeline-model-parallel-size {self.pp}"]
        if self.cp > 1:
            out.append(f"--context-parallel-size {self.cp}")
        if self.vp_layers:
            out.append(f"--num-layers-per-virtual-pipeline-stage {self.vp_layers}")
        if self.account_loss:
            out.append("--account-for-loss-in-pipeline-split")
        if self.first_layers is not None:
            out.append(f"--decoder-first-pipeline-num-layers {self.first_layers}")
        if self.last_layers is not None:
            out.append(f"--decoder-last-pipeline-num-layers {self.last_layers}")
        out.append(f"--micro-batch-size {self.micro_batch}")
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.ep > 1:
            out.append(f"--expert-model-parallel-size {self.ep}")
        if self.etp is not None and self.etp != self.tp:
            out.append(f"--expert-tensor-parallel-size {self.etp}")
        if self.recompute:
            out.append(f"--recompute-granularity {self.recompute}")
        if self.sharding == "optim":
            out.append("--use-distributed-optimizer")
        elif self.sharding != "no_shard":
            out.append(f"--data-parallel-sharding-strategy {self.sharding}")
        return " ".join(out)


def layout_rule_errors(cfg: MegaliteConfig, world_size: int, local_world_size: int) -> list[str]:
    """config/validate.py's rules for this config on this world (those that need no file or device)."""
    errors = domain_check(cfg)
    if errors:
        return errors
    return [*model_errors(cfg.model), *parallel_errors(cfg, world_size, local_world_size),
            *training_errors(cfg, world_size), *optimizer_errors(cfg.optimizer),
            *schedule_errors(cfg.training, cfg.optimizer), *precision_errors(cfg.precision, cfg.ddp)]
