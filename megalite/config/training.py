"""Training, optimizer and logging flags (Megatron-LM names)."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.domain import MAX_COUNT, MAX_RANKS, Domain, at_least, count, fraction, in_fp32, positive, size
from megalite.config.flags import option


@dataclass(kw_only=True)
class TrainingConfig:
    """Training: batch sizes, length of the run, evaluation and seed."""

    micro_batch_size: int = option(2, help="Samples per micro-batch per data-parallel rank.", domain=size())
    global_batch_size: int | None = option(
        None, help="Samples per optimizer step over all data-parallel ranks; default micro-batch x DP.", domain=size())
    train_iters: int | None = option(
        None, help="Optimizer steps to train; default 100 unless --train-samples is given.", domain=count())
    train_samples: int | None = option(
        None, help="Samples to train on instead of --train-iters (iterations = samples // global batch); "
        "the learning-rate schedule is then counted in samples (--lr-*-samples).", domain=count())
    calculate_per_token_loss: bool = option(
        False, help="Normalise the loss by the global batch's unmasked-token count (all micro-batches, all "
        "data-parallel ranks) instead of by each micro-batch's own count; the logged loss is then the per-token "
        "mean of the global batch. Differs only when loss masks differ (--eod-mask-loss). docs/design.md §3.9.")
    seed: int = option(1234, help="Seed of model init, data order and dropout; equal in every layout (NumPy "
                       "takes seeds below 2^32; the test split uses seed + 2).", domain=at_least(0, 2**32 - 3))
    eval_interval: int = option(1000, help="Evaluate on the validation set every this many iterations.",
                               domain=count())
    eval_iters: int = option(10, help="Global batches per evaluation.",
                             domain=Domain(lo=1, hi=MAX_COUNT, off=0, off_means="skips evaluation"))
    log_interval: int = option(100, help="Print the log line every this many iterations.", domain=count())
    exit_interval: int | None = option(None, help="Stop after the iteration that is a multiple of this "
                                        "(unset: never).", domain=count())
    exit_duration_in_mins: float | None = option(None, help="Save (with --save) and stop after this many "
                                                  "minutes.", domain=positive(hi=10**9))
    exit_signal_handler: bool = option(
        False, help="On SIGTERM, finish the current iteration, save a checkpoint (with --save) and exit 0.")
    check_for_nan_in_loss_and_grad: bool = option(
        True, flag="--no-check-for-nan-in-loss-and-grad",
        help="Keep training when the loss or the gradient norm is NaN/inf (by default the run stops there, "
        "naming the rank and iteration, before anything is saved; an fp16 step skipped on overflow is no stop).")
    manual_gc: bool = option(
        False, help="Turn Python's automatic garbage collector off for the run and collect at fixed points "
        "instead (at the start, every --manual-gc-interval iterations, around each evaluation), so that "
        "no rank pauses for a collection at a step where its peers do not.")
    manual_gc_interval: int = option(
        0, help="With --manual-gc: also collect after every this many iterations.",
        domain=Domain(lo=1, hi=MAX_COUNT, off=0, off_means="never collects between steps"))
    manual_gc_eval: bool = option(
        True, flag="--no-manual-gc-eval",
        help="With --manual-gc: no collection before and after each evaluation.")
    empty_unused_memory_level: int = option(
        0, choices=[0, 1, 2], domain=Domain(lo=1, hi=2, off=0, off_means="never empties the cache"),
        help="Hand the device caching allocator's unused blocks back to the device: 1 after each "
        "forward-backward of a training step and of every evaluation batch, 2 also after each optimizer "
        "step. Costs speed, may help a run near the memory limit; nothing to free on CPU.")
    skip_memory_check: bool = option(
        False, help="Start even when the planner's memory estimate per rank exceeds the device's memory (on CPU: "
        "the host's available memory, shared by the ranks on the host). By default such a run stops at start-up, "
        "before anything is allocated, naming the estimate, its largest terms and the flags behind them.")

    def __post_init__(self) -> None:
        if self.train_iters is None and self.train_samples is None:
            self.train_iters = 100


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer: AdamW, learning-rate schedule and clipping."""

    optimizer: str = option("adam", help="Optimizer (AdamW with decoupled weight decay).", choices=["adam"])
    lr: float = option(1e-4, help="Peak learning rate.", domain=in_fp32(at_least(0)))
    min_lr: float = option(0.0, help="Learning rate at the end of the decay.", domain=in_fp32(at_least(0)))
    lr_decay_style: str = option("cosine", help="Decay after warm-up (WSD: warm-up, stable, then an anneal "
                                 "over the last --lr-wsd-decay-iters).",
                                 choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_decay_iters: int | None = option(None, help="Iterations to decay over; default --train-iters.",
                                        domain=count())
    lr_decay_samples: int | None = option(None, help="Samples to decay over (with --train-samples); default "
                                          "--train-samples.", domain=count())
    decoupled_lr: float | None = option(
        None, help="Peak learning rate of the input embedding and the output layer (only these), in the same "
        "schedule as --lr (same warm-up and decay shape).", domain=in_fp32(at_least(0)))
    decoupled_min_lr: float | None = option(
        None, help="Learning rate of the input embedding and the output layer at the end of the decay, with "
        "--decoupled-lr; default --min-lr.", domain=in_fp32(at_least(0)))
    lr_warmup_iters: int = option(0, help="Linear warm-up iterations from --lr-warmup-init to --lr.",
                                  domain=at_least(0, MAX_COUNT))
    lr_warmup_samples: int = option(0, help="Linear warm-up samples (with --train-samples).",
                                    domain=at_least(0, MAX_COUNT))
    lr_warmup_fraction: float | None = option(
        None, help="Warm-up as a fraction of the decay span, instead of --lr-warmup-iters/-samples.",
        domain=fraction(hi_open=True))
    lr_warmup_init: float = option(0.0, help="Learning rate at the start of the warm-up.",
                                   domain=in_fp32(at_least(0)))
    lr_wsd_decay_style: str = option("exponential", help="Anneal shape of the WSD schedule.",
                                     choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: int | None = option(None, help="Iterations of the WSD anneal (the end of the decay "
                                            "span).", domain=count())
    lr_wsd_decay_samples: int | None = option(None, help="Samples of the WSD anneal (with --train-samples).",
                                                 domain=count())
    weight_decay: float = option(0.01, help="Decoupled weight decay (not on biases and norm weights).",
                                 domain=at_least(0))
    clip_grad: float = option(1.0, help="Clip gradients to this global L2 norm.",
                              domain=Domain(lo=0, lo_open=True, off=0, off_means="disables clipping"))
    adam_beta1: float = option(0.9, help="Adam beta1.", domain=fraction(hi_open=True))
    adam_beta2: float = option(0.999, help="Adam beta2.", domain=fraction(hi_open=True))
    adam_eps: float = option(1e-8, help="Adam epsilon.", domain=fraction(lo_open=True))


@dataclass(kw_only=True)
class LoggingConfig:
    """Logging: where and how progress is reported."""

    tensorboard_dir: str | None = option(None, help="Write TensorBoard scalars here.")
    wandb_project: str | None = option(None, help="Log to this Weights & Biases project (works offline).")
    log_throughput: bool = option(True, help="Leave tokens/s, TFLOP/s and MFU off the log line (on by default; "
                                  "--log-throughput, Megatron's switch, is accepted).",
                                  flag="--no-log-throughput")
    peak_tflops: float | None = option(None, help="Device peak TFLOP/s for MFU; default: known GPU table.",
                                        domain=positive(hi=10**9))
    timing_log_level: int = option(0, help="0: no phase timers; 1: per-phase min/max times and the "
                                   "communication share every --log-interval (synchronizes the device).",
                                   choices=[0, 1, 2], domain=at_least(0, 2))
    log_memory: bool = option(True, help="Leave the per-rank memory off the log line (on by default).",
                              flag="--no-log-memory")
    tensorboard_queue_size: int = option(1000, help="TensorBoard events buffered before a flush.",
                                         domain=size())
    wandb_exp_name: str | None = option(None, help="Weights & Biases run name.")
    wandb_save_dir: str | None = option(None, help="Where Weights & Biases writes its files.")
    profile: bool = option(False, help="Record a torch.profiler trace (Chrome/Perfetto JSON, one per rank).")
    profile_step_start: int = option(10, help="First profiled iteration.", domain=at_least(0, MAX_COUNT))
    profile_step_end: int = option(12, help="Profiling stops after this iteration.", domain=count())
    profile_ranks: list[int] | None = option(None, help="Ranks to profile (default: all).",
                                             domain=at_least(0, MAX_RANKS))
    profile_dir: str = option("profiles", help="Where the traces are written.")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints: where to save and load, how often, and what to restore."""

    save: str | None = option(None, help="Directory to save checkpoints to.")
    load: str | None = option(None, help="Directory to load the latest checkpoint from (any layout). When it "
                              "equals --save and holds no checkpoint yet, training starts fresh.")
    save_interval: int | None = option(None, help="Save every this many iterations (and at the end).",
                                        domain=count())
    async_save: bool = option(False, help="Save in the background: the step that saves stops only to copy "
                              "this rank's shards into host memory, a thread writes and checksums them, and "
                              "the tracker moves once every rank's write is complete (agreed at a later step "
                              "boundary). At most one save in flight; the next save and the end of the run "
                              "wait for it. Applies to megalite's own format (--ckpt-format is ignored).")
    no_load_optim: bool = option(False, help="Load weights only; start the optimizer fresh.")
    no_load_rng: bool = option(False, help="Do not restore the RNG states.")
    finetune: bool = option(False, help="Load weights only and start at iteration 0 (new optimizer, new data "
                            "position).")
    overwrite_checkpoint: bool = option(False, help="Let --save replace the checkpoint of another run that "
                                        "is already there (another model, no --load, --finetune, or a later "
                                        "iteration than --load's); without it such a run is refused at start-up.")
    on_bad_checkpoint: str = option(
        "set-aside", choices=["set-aside", "refuse"],
        help="When --load equals --save (a run restarting into its own folder) and the newest checkpoint fails "
        "its checks (a file's CRC, metadata.json, the tracker): set-aside renames it to iter_N.corrupt-TAG "
        "(never deleted), says so in one line and resumes from the newest one that passes (a garbled or "
        "missing tracker: the newest complete iteration folder); refuse stops with the error instead.")
    max_consecutive_failed_saves: int = option(
        3, domain=count(),
        help="A periodic save that fails to write (full disk, file-size limit, I/O error) leaves every earlier "
        "checkpoint intact and training goes on, retrying at the next --save-interval; after this many failed "
        "saves in a row the run stops. 1 stops at the first failure. The final save's failure always stops it.")
