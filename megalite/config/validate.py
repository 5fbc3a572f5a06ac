"""Every rule a flag combination must satisfy, checked before any process group exists.

Each message names the flags and the rule, so the user can fix the command line without reading code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config.arguments import MegaliteConfig


class ConfigError(ValueError):
    """An invalid flag combination; the message lists every broken rule."""


def _divides(errors: list[str], a: int, a_flag: str, b: int, b_flag: str) -> None:
    if b <= 0 or a % b:
        errors.append(f"{a_flag} ({a}) must be divisible by {b_flag} ({b})")


def _hierarchical_errors(cfg: "MegaliteConfig", world_size: int, local_world_size: int | None) -> list[str]:
    """--hierarchical-dp-reduce needs every node to hold the same number of each DP group's ranks."""
    from megalite.parallel.layout import RankLayout
    from megalite.training.setup import launcher_env

    if local_world_size is None:
        _, env_world, _, env_local = launcher_env()
        local_world_size = env_local if env_world == world_size else world_size
    p = cfg.parallel
    layout = RankLayout(world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                        p.context_parallel_size, p.layout_order, local_world_size)
    try:
        layout.dp_node_groups()
    except ValueError as e:
        return [f"--hierarchical-dp-reduce: {e}; change --tensor-model-parallel-size/--pipeline-model-parallel-size"
                f", --use-tp-pp-dp-mapping or --nproc-per-node, or drop the flag"]
    return []


def validate(cfg: "MegaliteConfig", world_size: int, local_world_size: int | None = None) -> None:
    """Raise ConfigError listing every violated rule for a run on ``world_size`` ranks.

    ``local_world_size``: ranks per node; default the launcher's LOCAL_WORLD_SIZE when its WORLD_SIZE is
    ``world_size``, else one node.

    Fills in derived defaults (global batch size) on success.
    """
    m, p, t, o, d = cfg.model, cfg.parallel, cfg.training, cfg.optimizer, cfg.data
    errors: list[str] = []
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size

    for flag, value in [("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                        ("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--micro-batch-size", t.micro_batch_size), ("--train-iters", t.train_iters),
                        ("--log-interval", t.log_interval), ("--eval-interval", t.eval_interval)]:
        if value <= 0:
            errors.append(f"{flag} must be positive, got {value}")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))

    # Model shape.
    _divides(errors, m.hidden_size, "--hidden-size", m.num_attention_heads, "--num-attention-heads")
    if m.group_query_attention and not m.num_query_groups:
        errors.append("--group-query-attention needs --num-query-groups")
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        errors.append(f"--num-attention-heads ({m.num_attention_heads}) must be divisible by "
                      f"--num-query-groups ({groups})")
    _divides(errors, m.num_attention_heads, "--num-attention-heads", tp, "--tensor-model-parallel-size")
    if groups % tp and tp % groups:
        errors.append(f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}) must divide "
                      "one another (groups split over ranks, or ranks share a group)")
    _divides(errors, m.ffn_hidden_size, "--ffn-hidden-size", tp, "--tensor-model-parallel-size")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        errors.append(f"--seq-length ({m.seq_length}) must be <= --max-position-embeddings "
                      f"({m.max_position_embeddings}) with learned absolute positions")
    if m.position_embedding_type == "rope" and m.kv_channels and (
            int(m.kv_channels * m.rotary_percent) % 2):
        errors.append(f"--rotary-percent x head dim ({m.kv_channels}) must be even for RoPE")
    for flag, value in [("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)]:
        if not 0.0 <= value < 1.0:
            errors.append(f"{flag} must be in [0, 1), got {value}")
    if m.recompute_num_layers <= 0:
        errors.append("--recompute-num-layers must be positive")
    if m.make_vocab_size_divisible_by <= 0:
        errors.append("--make-vocab-size-divisible-by must be positive")

    # Layout.
    if cp != 1:
        errors.append("--context-parallel-size must be 1 (context parallelism is not implemented)")
    if world_size % (tp * pp * cp):
        errors.append(f"world size ({world_size}) must be divisible by --tensor-model-parallel-size ({tp}) x "
                      f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp})")
    dp = max(world_size // (tp * pp * cp), 1)
    if p.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1")
    _divides(errors, m.num_layers, "--num-layers", pp, "--pipeline-model-parallel-size")
    if p.hierarchical_dp_reduce and world_size % (tp * pp * cp) == 0:
        errors.extend(_hierarchical_errors(cfg, world_size, local_world_size))

    # Batches.
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    from megalite.pipeline.validate import pipeline_errors

    errors.extend(pipeline_errors(cfg, dp))
    if t.global_batch_size % (t.micro_batch_size * dp):
        errors.append(f"--global-batch-size ({t.global_batch_size}) must be divisible by --micro-batch-size "
                      f"({t.micro_batch_size}) x data-parallel size ({dp} = world {world_size} / "
                      f"(TP {tp} x PP {pp}))")
    if t.eval_iters < 0:
        errors.append(f"--eval-iters must be >= 0, got {t.eval_iters}")

    # Optimizer.
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        errors.append(f"need 0 <= --min-lr ({o.min_lr}) <= --lr ({o.lr})")
    if o.lr_warmup_iters < 0:
        errors.append("--lr-warmup-iters must be >= 0")
    if o.clip_grad < 0:
        errors.append("--clip-grad must be >= 0")

    # Precision and data parallelism.
    pr, dd = cfg.precision, cfg.ddp
    if pr.fp16 and pr.bf16:
        errors.append("--fp16 and --bf16 are exclusive")
    if pr.loss_scale is not None and not pr.fp16:
        errors.append("--loss-scale applies to --fp16 only")
    if pr.min_loss_scale <= 0 or pr.initial_loss_scale < pr.min_loss_scale:
        errors.append(f"need 0 < --min-loss-scale ({pr.min_loss_scale}) <= --initial-loss-scale "
                      f"({pr.initial_loss_scale})")
    if pr.hysteresis < 1 or pr.loss_scale_window < 1:
        errors.append("--hysteresis and --loss-scale-window must be >= 1")
    if dd.overlap_param_gather and not dd.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer")
    if dd.ddp_bucket_size is not None and dd.ddp_bucket_size <= 0:
        errors.append("--ddp-bucket-size must be positive")

    lg = cfg.logging
    if lg.profile and not 0 <= lg.profile_step_start < lg.profile_step_end:
        errors.append(f"need 0 <= --profile-step-start ({lg.profile_step_start}) < --profile-step-end "
                      f"({lg.profile_step_end})")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        errors.append("--exit-duration-in-mins must be positive")

    # Checkpoints.
    ck = cfg.checkpoint
    if ck.save_interval is not None and ck.save_interval <= 0:
        errors.append("--save-interval must be positive")
    if ck.save_interval and not ck.save:
        errors.append("--save-interval needs --save")
    if ck.finetune and not ck.load:
        errors.append("--finetune needs --load")

    # Data.
    has_paths = bool(d.data_path or d.train_data_path)
    if d.mock_data and has_paths:
        errors.append("--mock-data and --data-path/--train-data-path are exclusive")
    if not d.mock_data and not has_paths:
        errors.append("give --data-path (or --train-data-path), or --mock-data for synthetic data")
    if d.tokenizer_type == "NullTokenizer" and not d.vocab_size:
        errors.append("--tokenizer-type NullTokenizer needs --vocab-size")

    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
