"""Every rule a flag combination must satisfy, checked before any process group exists.

First, alone, every numeric field is checked against the domain its option declares (``domain_check``:
finite, in range, or its documented off value), so that the rules after it never see NaN, inf or a
negative size. Then one function per config section returns the messages of the rules it breaks (pure:
nothing is changed); ``validate`` runs them all, raises one ConfigError listing every message, and only then
fills in the derived defaults (``fill_derived_defaults``). The layout rules (how a model is cut over
TP/PP/VP, what a world size allows) are ``layout_errors`` and ``world_errors``, shared with the
offline resharder and inference loading. Each message names the flags and the rule, so the user can
fix the command line without reading code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.data_values import data_string_errors
from megalite.config.flags import domain_errors
from megalite.config.mla import mla_errors
from megalite.config.mtp import mtp_errors
from megalite.config.validate_cp import context_parallel_errors, cp_comm_errors
from megalite.config.validate_moe import expert_layout_errors, moe_errors
from megalite.config.validate_pipeline import checked_split
from megalite.config.yarn import yarn_errors

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig
    from megalite.config.data import DataConfig
    from megalite.config.model import ModelConfig
    from megalite.config.parallel import ParallelConfig
    from megalite.config.precision import DDPConfig, PrecisionConfig
    from megalite.config.training import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig
    from megalite.parallel.placement import LayerSplit


class ConfigError(ValueError):
    """An invalid flag combination; the message lists every broken rule."""


def _raise_if(errors: list[str]) -> None:
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def data_parallel_size(cfg: "MegaliteConfig", world_size: int) -> int:
    p = cfg.parallel
    return max(world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                              * p.context_parallel_size), 1)


def domain_check(cfg: "MegaliteConfig") -> list[str]:
    """Every numeric field against its declared domain (config/domain.py): finite, in range, or its
    documented off value. Checked first, alone, so that the rules below, which multiply and divide
    sizes, only ever see values in their domain."""
    return domain_errors(cfg)


def model_errors(m: "ModelConfig") -> list[str]:
    """The model's own shape, whatever the layout."""
    errors = []
    if m.hidden_size % m.num_attention_heads:
        errors.append(f"--hidden-size ({m.hidden_size}) must be divisible by --num-attention-heads "
                      f"({m.num_attention_heads})")
    if m.group_query_attention and not m.num_query_groups:
        errors.append("--group-query-attention needs --num-query-groups")
    if not m.group_query_attention and m.num_query_groups not in (None, m.num_attention_heads):
        errors.append(f"--num-query-groups ({m.num_query_groups}) needs --group-query-attention (without it "
                      "every head has its own key/value head and the flag would be ignored)")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        errors.append(f"--recompute-method {m.recompute_method} needs --recompute-granularity full (it says which "
                      "layers full recomputation covers, and would be ignored otherwise)")
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        errors.append(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                      f"--num-query-groups ({groups})")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        errors.append(f"--seq-length ({m.seq_length}) must be <= --max-position-embeddings "
                      f"({m.max_position_embeddings}) with learned absolute positions")
    if m.rotary and not m.multi_latent_attention and m.kv_channels and int(m.kv_channels * m.rotary_percent) % 2:
        errors.append(f"--rotary-percent x head dim ({m.kv_channels}) must be even for RoPE")
    if m.use_rope_scaling and m.position_embedding_type != "rope":
        errors.append("--use-rope-scaling needs --position-embedding-type rope (it scales RoPE's frequencies)")
    if m.use_rope_scaling and m.rope_scaling_high_freq_factor <= m.rope_scaling_low_freq_factor:
        errors.append(f"--rope-scaling-high-freq-factor ({m.rope_scaling_high_freq_factor:g}) must exceed "
                      f"--rope-scaling-low-freq-factor ({m.rope_scaling_low_freq_factor:g}): the band between "
                      "them is interpolated")
    if m.qk_layernorm_scope != "head" and not m.qk_layernorm:
        errors.append(f"--qk-layernorm-scope {m.qk_layernorm_scope} needs --qk-layernorm (it says what that norm "
                      "covers, and would be ignored otherwise)")
    if m.qk_layernorm and m.qk_layernorm_scope == "projection" and m.normalization != "RMSNorm":
        errors.append("--qk-layernorm-scope projection needs --normalization RMSNorm (its one all-reduce over the "
                      "tensor-parallel ranks carries the sum of squares only)")
    errors += mla_errors(m)  # --multi-latent-attention and its sizes (config/mla.py)
    errors += mtp_errors(m)  # --mtp-num-layers, --mtp-loss-scaling-factor (config/mtp.py)
    return errors + window_errors(m) + activation_and_rope_errors(m) + yarn_errors(m)


def window_errors(m: "ModelConfig") -> list[str]:
    """--window-size and --window-attn-skip-freq (attention/window.py)."""
    if m.window_size is None:
        return ["--window-attn-skip-freq needs --window-size (it picks which layers the window applies to)"] \
            if m.window_attn_skip_freq is not None else []
    if len(m.window_size) != 2 or m.window_size[1] != 0:
        return [f"--window-size takes two numbers LEFT RIGHT with RIGHT 0 (attention is causal), got "
                f"{' '.join(map(str, m.window_size))}"]
    try:
        m.attention_windows()
    except ValueError as e:
        return [str(e)]
    return []


def activation_and_rope_errors(m: "ModelConfig") -> list[str]:
    """--geglu, and the RoPE options of a layer kind (--rotary-base-local) or a linear factor."""
    errors = []
    if m.swiglu and m.geglu:
        errors.append("--swiglu and --geglu are two activations of the gated MLP: pick one")
    windowed = bool(m.window_size) and m.window_size[0] >= 0
    if m.rotary_base_local is not None and not (m.rotary and windowed):
        errors.append("--rotary-base-local needs --position-embedding-type rope and windowed layers (--window-size): "
                      "it is the RoPE base of the windowed layers")
    if m.rotary_seq_len_interpolation_factor is not None:
        if m.position_embedding_type != "rope":
            errors.append("--rotary-seq-len-interpolation-factor needs --position-embedding-type rope (YaRN scales "
                          "its own way)")
        if m.use_rope_scaling:
            errors.append("--rotary-seq-len-interpolation-factor and --use-rope-scaling are two RoPE scalings: "
                          "pick one")
    return errors


def layout_errors(m: "ModelConfig", tp: int, pp: int, layers_per_virtual_stage: int | None = None,
                  split: "LayerSplit | None" = None) -> list[str]:
    """Why the model cannot be cut into this (TP, PP, VP) layout (empty when it can): heads, KV groups
    and FFN columns over TP ranks, layers over pipeline stages and virtual stages (an uneven ``split``:
    by its own rules, parallel/placement.py)."""
    if tp <= 0 or pp <= 0:
        return [f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be positive"]
    errors = []
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    if heads % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --num-attention-heads ({heads})")
    if groups % tp and tp % groups:
        errors.append(f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}) must divide one "
                      "another (groups split over ranks, or ranks share a group)")
    if m.ffn_hidden_size % tp:
        errors.append(f"--tensor-model-parallel-size ({tp}) must divide --ffn-hidden-size ({m.ffn_hidden_size})")
    if split is not None and not split.even:
        return errors + split.errors()
    if m.num_layers % pp:
        errors.append(f"--pipeline-model-parallel-size ({pp}) must divide --num-layers ({m.num_layers})")
    elif split is not None and not split.v_shape and split.vp > 1 and m.num_layers % split.n:
        errors.append(f"--num-layers ({m.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
                      f"--num-virtual-stages-per-pipeline-rank ({split.vp})")
    k = layers_per_virtual_stage
    if k is None:
        return errors
    if k <= 0:
        errors.append(f"--num-layers-per-virtual-pipeline-stage must be positive, got {k}")
    elif pp == 1:
        errors.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    elif m.num_layers % (pp * k):
        errors.append(f"--num-layers ({m.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
                      f"--num-layers-per-virtual-pipeline-stage ({k})")
    return errors


def pipeline_schedule_errors(cfg: "MegaliteConfig") -> list[str]:
    """--pipeline-schedule's own rules: the zero-bubble schedules place their chunks themselves (ZB-H1 one
    per rank, ZB-V two in a V, whose first rank holds both the embedding and the output layer)."""
    p, m = cfg.parallel, cfg.model
    kind, pp = p.pipeline_schedule, p.pipeline_model_parallel_size
    errors = []
    if kind in ("zb-h1", "zbv") and p.num_layers_per_virtual_pipeline_stage is not None:
        chunks = "two per rank" if kind == "zbv" else "one per rank"
        errors.append(f"--pipeline-schedule {kind} places its own model chunks ({chunks}); drop "
                      "--num-layers-per-virtual-pipeline-stage")
    uneven = (p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers,
              p.account_for_embedding_in_pipeline_split, p.account_for_loss_in_pipeline_split,
              p.pipeline_model_parallel_layout) != (None, None, False, False, None)
    if kind == "zbv" and not uneven and m.num_layers % (2 * pp):
        errors.append(f"--pipeline-schedule zbv needs --num-layers ({m.num_layers}) divisible by 2 x "
                      f"--pipeline-model-parallel-size ({2 * pp}): two model chunks per rank")
    return errors


def world_errors(world_size: int, tp: int, pp: int, cp: int) -> list[str]:
    """What the number of ranks allows."""
    errors = []
    if world_size % (tp * pp * cp):
        errors.append(f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
                      f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    return errors


def _hierarchical_errors(cfg: "MegaliteConfig", world_size: int, local_world_size: int) -> list[str]:
    """--hierarchical-dp-reduce needs every node to hold the same number of each DP group's ranks."""
    from megalite.parallel.layout import RankLayout  # lazily: config stays importable without torch

    try:
        layout = RankLayout.from_config(cfg.parallel, world_size, local_world_size)
    except ValueError:  # sizes, expert or CP sub-groups that fit no layout: the other sections name them
        return []
    try:
        layout.dp_node_groups()
    except ValueError as e:
        return [f"--hierarchical-dp-reduce: {e}; change --tensor-model-parallel-size/--pipeline-model-parallel-size"
                f", --use-tp-pp-dp-mapping or --nproc-per-node, or drop the flag"]
    return []


def parallel_errors(cfg: "MegaliteConfig", world_size: int, local_world_size: int) -> list[str]:
    """The layout section: world size, the model cut over TP/PP/VP, context parallelism (validate_cp.py),
    sequence parallelism, topology."""
    p = cfg.parallel
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    errors = world_errors(world_size, tp, pp, cp) + moe_errors(cfg)
    if cfg.model.is_moe:
        errors += expert_layout_errors(world_size, tp, pp, cp, p.expert_model_parallel_size,
                                       p.expert_tensor_parallel_size or tp)
    if p.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    split_errors, split = checked_split(cfg)
    errors += split_errors + pipeline_schedule_errors(cfg) + cp_comm_errors(cfg)
    errors += layout_errors(cfg.model, tp, pp, p.num_layers_per_virtual_pipeline_stage, split)
    if cp > 1:
        errors += context_parallel_errors(cfg)
    if p.hierarchical_dp_reduce and world_size % (tp * pp * cp) == 0:
        errors += _hierarchical_errors(cfg, world_size, local_world_size)
    return errors


def training_errors(cfg: "MegaliteConfig", world_size: int) -> list[str]:
    """Batches (global = micro x DP x accumulation; the interleaved schedule's micro-batch count),
    evaluation and time limits."""
    t, p = cfg.training, cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    gbs = t.global_batch_size if t.global_batch_size is not None else t.micro_batch_size * dp
    errors = []
    if pp > 1 and p.pipeline_schedule != "zbv" and p.virtual_stages(cfg.model.num_layers) > 1:
        m = gbs // (t.micro_batch_size * dp)
        if m % pp:
            errors.append(f"the interleaved schedule needs the number of micro-batches per step ({m} = "
                          f"--global-batch-size {gbs} / (--micro-batch-size {t.micro_batch_size} x "
                          f"data-parallel {dp})) to be divisible by --pipeline-model-parallel-size ({pp})")
    if gbs % (t.micro_batch_size * dp):
        errors.append(f"--global-batch-size ({gbs}) must be divisible by --micro-batch-size "
                      f"({t.micro_batch_size}) x data-parallel size ({dp} = world {world_size} / "
                      f"(TP {tp} x PP {pp}))")
    if t.train_samples is not None and 0 < t.train_samples < gbs:
        errors.append(f"--train-samples ({t.train_samples}) must be at least one global batch ({gbs})")
    return errors


def optimizer_errors(o: "OptimizerConfig") -> list[str]:
    errors = []
    if o.min_lr > o.lr:
        errors.append(f"need 0 <= --min-lr ({o.min_lr}) <= --lr ({o.lr})")
    if o.lr_warmup_init > o.lr:
        errors.append(f"need 0 <= --lr-warmup-init ({o.lr_warmup_init}) <= --lr ({o.lr})")
    errors += decoupled_lr_errors(o)
    if o.lr_warmup_fraction is not None and (o.lr_warmup_iters or o.lr_warmup_samples):
        errors.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive")
    return errors


def decoupled_lr_errors(o: "OptimizerConfig") -> list[str]:
    """The embedding and output layer's own rates: a final rate needs a peak rate, and lies below it."""
    if o.decoupled_lr is None:
        return ["--decoupled-min-lr needs --decoupled-lr (it is the final rate of the embedding and output "
                "layer's own schedule)"] if o.decoupled_min_lr is not None else []
    final = (f"--decoupled-min-lr ({o.decoupled_min_lr})" if o.decoupled_min_lr is not None
             else f"--min-lr ({o.min_lr}, the default of --decoupled-min-lr)")
    low = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
    if low > o.decoupled_lr:
        return [f"need 0 <= {final} <= --decoupled-lr ({o.decoupled_lr})"]
    return []


def schedule_errors(t: "TrainingConfig", o: "OptimizerConfig") -> list[str]:
    """The learning-rate schedule is counted in iterations or in samples, as the run's length is. A warm-up
    as long as the decay span is accepted (Megatron refuses it), so that a shortened run of an example
    script works: the rate warms up, then drops to --min-lr."""
    by_samples = t.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    length = f"--train-{unit}"
    errors = []
    if by_samples and t.train_iters is not None:
        errors.append("--train-iters and --train-samples are exclusive")
    for flag in (f"--lr-decay-{other}", f"--lr-warmup-{other}", f"--lr-wsd-decay-{other}"):
        if getattr(o, flag[2:].replace("-", "_")):
            errors.append(f"{flag} needs --train-{other} (with {length} the schedule is counted in {unit}: "
                          f"use --{flag[2:].replace(other, unit)})")
    decay = getattr(o, f"lr_decay_{unit}") or getattr(t, f"train_{unit}")
    wsd = getattr(o, f"lr_wsd_decay_{unit}")
    if o.lr_decay_style == "WSD" and wsd is None:
        errors.append(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}")
    if o.lr_decay_style == "WSD" and decay and wsd and wsd > decay:
        errors.append(f"--lr-wsd-decay-{unit} ({wsd}) must be <= the decay span --lr-decay-{unit} ({decay})")
    return errors


def precision_errors(pr: "PrecisionConfig", dd: "DDPConfig") -> list[str]:
    """Mixed precision, the loss scaler and the data-parallel reduction."""
    errors = []
    if pr.fp16 and pr.bf16:
        errors.append("--fp16 and --bf16 are exclusive")
    if pr.loss_scale is not None and not pr.fp16:
        errors.append("--loss-scale applies to --fp16 only")
    if pr.initial_loss_scale < pr.min_loss_scale:
        errors.append(f"need 0 < --min-loss-scale ({pr.min_loss_scale}) <= --initial-loss-scale "
                      f"({pr.initial_loss_scale})")
    errors += compression_errors(dd)
    if dd.optimizer_offload_fraction != 1.0 and not dd.optimizer_cpu_offload:
        errors.append("--optimizer-offload-fraction needs --optimizer-cpu-offload")
    return errors


def compression_errors(dd: "DDPConfig") -> list[str]:
    """--grad-compression compresses the all-reduce; the sharded paths reduce-scatter instead."""
    errors = []
    if dd.grad_compression == "none":
        return errors
    if dd.shards_optimizer:
        flag = "--use-distributed-optimizer" if dd.use_distributed_optimizer else \
            "--use-megatron-fsdp" if dd.data_parallel_sharding_strategy is None else \
            f"--data-parallel-sharding-strategy {dd.data_parallel_sharding_strategy}"
        errors.append(f"--grad-compression {dd.grad_compression} compresses the all-reduce and cannot be used with "
                      f"{flag} (its gradients are reduce-scattered); drop one of them")
    return errors


def sharding_errors(dd: "DDPConfig", p: "ParallelConfig") -> list[str]:
    """--data-parallel-sharding-strategy against the flags that imply or need a strategy."""
    errors = []
    if dd.data_parallel_sharding_strategy == "no_shard" and dd.use_distributed_optimizer:
        errors.append("--use-distributed-optimizer shards the optimizer state (strategy optim); it contradicts "
                      "--data-parallel-sharding-strategy no_shard")
    if dd.overlap_param_gather and not dd.shards_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (or a sharding strategy other "
                      "than no_shard)")
    if dd.fsdp_keep_params_across_microbatches and not dd.shards_params:
        errors.append(f"--fsdp-keep-params-across-microbatches needs sharded parameters "
                      f"(--data-parallel-sharding-strategy optim_grads_params), not {dd.sharding}")
    if dd.shards_grads and p.hierarchical_dp_reduce:
        errors.append(f"--hierarchical-dp-reduce reduces a full gradient buffer once per step; "
                      f"--data-parallel-sharding-strategy {dd.sharding} reduce-scatters every micro-batch: "
                      "use one of them")
    return errors


def kernel_errors(m: "ModelConfig", pr: "PrecisionConfig") -> list[str]:
    """Kernel choices this device cannot run in the run's dtype (--attention-backend flash in fp32 on CUDA),
    and a torch below the supported range."""
    from megalite.compat import too_old  # lazily: config stays importable without torch
    from megalite.device import attention_backend_error

    errors = [too_old(), attention_backend_error(m.attention_backend, pr.params_dtype)]
    return [e for e in errors if e]


def logging_errors(lg: "LoggingConfig") -> list[str]:
    if lg.profile and not lg.profile_step_start < lg.profile_step_end:
        return [f"need 0 <= --profile-step-start ({lg.profile_step_start}) < --profile-step-end "
                f"({lg.profile_step_end})"]
    return []


def checkpoint_errors(ck: "CheckpointConfig") -> list[str]:
    errors = []
    if ck.save_interval and not ck.save:
        errors.append("--save-interval needs --save")
    if ck.async_save and not ck.save:
        errors.append("--async-save needs --save (it is how checkpoints are written there)")
    if ck.finetune and not ck.load:
        errors.append("--finetune needs --load")
    return errors


def data_errors(d: "DataConfig") -> list[str]:
    errors = []
    has_paths = bool(d.data_path or d.train_data_path)
    if d.mock_data and has_paths:
        errors.append("--mock-data and --data-path/--train-data-path are exclusive")
    if not d.mock_data and not has_paths:
        errors.append("give --data-path (or --train-data-path), or --mock-data for synthetic data")
    if d.tokenizer_type == "NullTokenizer" and d.vocab_size is None:
        errors.append("--tokenizer-type NullTokenizer needs --vocab-size")
    return errors + data_string_errors(d.data_path, [d.train_data_path, d.valid_data_path, d.test_data_path],
                                       d.split)


def fill_derived_defaults(cfg: "MegaliteConfig", world_size: int) -> None:
    """The values a valid config derives from others: --global-batch-size defaults to micro-batch x DP;
    with --train-samples, --train-iters is samples // global batch (as Megatron-LM)."""
    t = cfg.training
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * data_parallel_size(cfg, world_size)
    if t.train_samples is not None:
        t.train_iters = t.train_samples // t.global_batch_size


def validate(cfg: "MegaliteConfig", world_size: int, local_world_size: int | None = None) -> None:
    """Raise ConfigError listing every violated rule for a run on ``world_size`` ranks, of which
    ``local_world_size`` (default: all) share a node; then fill in the derived defaults."""
    _raise_if(domain_check(cfg))
    _raise_if([*model_errors(cfg.model), *parallel_errors(cfg, world_size, local_world_size or world_size),
               *training_errors(cfg, world_size), *optimizer_errors(cfg.optimizer),
               *schedule_errors(cfg.training, cfg.optimizer),
               *precision_errors(cfg.precision, cfg.ddp), *sharding_errors(cfg.ddp, cfg.parallel),
               *kernel_errors(cfg.model, cfg.precision),
               *logging_errors(cfg.logging),
               *checkpoint_errors(cfg.checkpoint), *data_errors(cfg.data)])
    fill_derived_defaults(cfg, world_size)
