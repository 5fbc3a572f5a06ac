"""A DeepSpeed ``ds_config.json`` (--deepspeed-config, or DeepSpeed's own spelling --deepspeed_config), read
as megalite flag values.

Each DeepSpeed key becomes the megalite flag with the same meaning (DeepSpeed's documented semantics and
defaults: no scheduler means a constant rate, no ``gradient_clipping`` means no clipping, fp16's initial
scale is 2^16); the mapping is printed at start-up. A key megalite cannot honour is named: refused when
honouring it would change the training math (another optimizer, log-shaped warm-up, NVMe offload,
quantized ZeRO), a warning when it only tunes speed or memory (bucket sizes, prefetching, monitors).
Keys nobody listed here are refused too: megalite cannot tell whether they change the math. Flags on
the command line (and a --config file) win over the DeepSpeed file. The batch keys are resolved as
DeepSpeed does (train_batch_size = micro x accumulation x data-parallel size), once the data-parallel
size is known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from megalite.config.file_values import ConfigFileError, read_text
from megalite.config.strict_load import StrictReadError, load_json

FLAG = "--deepspeed-config"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The megalite field each resolved batch key sets (for messages naming the key the user wrote).
BATCH_KEY_OF = {"micro_batch_size": "train_micro_batch_size_per_gpu", "global_batch_size": "train_batch_size"}

# Keys that only tune speed, memory or monitoring: named in a warning, then ignored.
TUNING: dict[str, str] = {
    "prescale_gradients": "megalite always divides gradients by the DP size before the sum (same math)",
    "gradient_predivide_factor": "a rounding choice around the DP sum (same math)",
    "memory_breakdown": "use --log-memory (on by default)",
    "dump_state": "debug printing",
    "tensorboard": "use --tensorboard-dir", "wandb": "use --wandb-project", "csv_monitor": "monitor only",
    "comms_logger": "DP bytes are counted by megalite's ProcessGroups", "flops_profiler": "use --profile",
    "activation_checkpointing": "recomputation does not change the math: use --recompute-granularity",
    "checkpoint": "megalite writes its own sharded checkpoints (--save)", "aio": "NVMe I/O tuning",
    "autotuning": "no autotuner", "zero_allow_untested_optimizer": "megalite's AdamW is the one optimizer",
    "zero_force_ds_cpu_optimizer": "megalite's host AdamW is torch's", "timers": "use --timing-log-level",
    "monitor_config": "monitor only", "seq_parallel_communication_data_type": "megalite's SP sends params dtype",
}
ZERO_TUNING = ("contiguous_gradients", "allgather_partitions", "allgather_bucket_size", "reduce_scatter",
               "round_robin_gradients", "sub_group_size", "elastic_checkpoint", "load_from_fp32_weights",
               "ignore_unused_parameters", "memory_efficient_linear", "stage3_prefetch_bucket_size",
               "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
               "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
               "legacy_stage1", "use_multi_rank_bucket_allreduce", "mics_shard_size",
               "mics_hierarchical_params_gather", "zero_hpz_partition_size", "cpu_offload_use_pin_memory")
# Keys whose feature megalite does not have, and which change what is trained.
REFUSED: dict[str, str] = {
    "amp": "NVIDIA apex AMP is not implemented (use fp16 or bf16)",
    "sparse_attention": "sparse attention is not implemented", "sparse_gradients": "sparse gradients are not "
    "implemented", "compression_training": "compression training is not implemented",
    "data_efficiency": "data sampling/routing schedules are not implemented",
    "curriculum_learning": "curriculum learning is not implemented", "elasticity": "elastic batch sizes "
    "are not implemented", "quantize_training": "quantized training is not implemented",
    "progressive_layer_drop": "progressive layer drop is not implemented",
    "eigenvalue": "eigenvalue-based schedules are not implemented",
}


@dataclass
class Row:
    key: str
    flag: str
    value: Any
    note: str = ""


@dataclass
class DeepSpeedMapping:
    """What a ds_config.json says in megalite terms: field values, the printed rows, the keys refused
    (raised together), the tuning keys warned about, and the key each field value came from (``written``,
    for messages about a value: they name the key the user wrote)."""

    path: str
    values: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    warned: list[str] = field(default_factory=list)
    batch: dict[str, int] = field(default_factory=dict)
    written: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, name: str, value: Any, note: str = "") -> None:
        self.values[name] = value
        if key.startswith("("):  # no key at all: nothing the user wrote
            self.written.pop(name, None)
        elif "DeepSpeed's default" in note:
            self.written[name] = f"DeepSpeed's default for '{key}', {self.path}"
        else:
            self.written[name] = f"'{key}' in {self.path}"
        shown = "" if value is True else value
        self.rows.append(Row(key, f"--{name.replace('_', '-')}", shown, note))

    def refuse(self, key: str, why: str) -> None:
        self.refused.append(f"{key}: {why}")

    def warn(self, key: str, why: str) -> None:
        self.warned.append(f"{key}: {why}")

    def report(self, given: set[str]) -> str:
        """The mapping as printed at start-up; rows whose field the command line (or --config) sets say so."""
        lines = [f"{FLAG} {self.path}: DeepSpeed key -> megalite flag (command-line flags win)"]
        for r in self.rows:
            name = r.flag[2:].replace("-", "_")
            right = f"{r.flag} {r.value}".rstrip()
            note = f"  ({r.note})" if r.note else ""
            won = "  [overridden by the command line]" if name in given else ""
            lines.append(f"  {r.key:<42} -> {right}{note}{won}")
        lines += [f"  not honoured (tuning only, ignored): {w}" for w in self.warned]
        return "\n".join(lines)


def _auto_values(data: Any, prefix: str = "") -> list[str]:
    """Keys whose value is the Hugging Face Trainer placeholder "auto" (filled in by that integration)."""
    if isinstance(data, dict):
        return [k for key, v in data.items() for k in _auto_values(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if data == "auto" else []


def _number(m: DeepSpeedMapping, key: str, value: Any, kind: type = float) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        m.refuse(key, f"expects {'an integer' if kind is int else 'a number'}, got {value!r}")
        return None
    return kind(value)


def _section(m: DeepSpeedMapping, key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        m.refuse(key, f"expects a mapping, got {value!r}")
        return {}
    return value


def _optimizer(m: DeepSpeedMapping, sec: dict) -> None:
    kind = str(sec.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        m.refuse("optimizer.type", f"{sec.get('type')!r}: megalite trains with AdamW only (type Adam or AdamW)")
        return
    params = _section(m, "optimizer.params", sec.get("params", {}))
    m.rows.append(Row("optimizer.type", "--optimizer", "adam", "AdamW, decoupled weight decay; megalite exempts "
                      "biases and norm weights from decay, as Megatron does"))
    for name, default in (("lr", 1e-3), ("eps", 1e-8), ("weight_decay", 0.0)):
        value = _number(m, f"optimizer.params.{name}", params.get(name, default))
        note = "" if name in params else "DeepSpeed's default"
        m.set(f"optimizer.params.{name}", {"eps": "adam_eps"}.get(name, name), value, note)
    betas = params.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2):
        m.refuse("optimizer.params.betas", f"expects [beta1, beta2], got {betas!r}")
    else:
        m.set("optimizer.params.betas[0]", "adam_beta1", _number(m, "optimizer.params.betas[0]", betas[0]))
        m.set("optimizer.params.betas[1]", "adam_beta2", _number(m, "optimizer.params.betas[1]", betas[1]))
    for key, value in params.items():
        if key in ("lr", "eps", "weight_decay", "betas"):
            continue
        if (key, value) in (("adam_w_mode", True), ("amsgrad", False), ("bias_correction", True)):
            continue
        if key == "torch_adam":
            m.warn(f"optimizer.params.{key}", "which AdamW kernel runs (same update)")
            continue
        m.refuse(f"optimizer.params.{key}", f"{value!r} changes the update; megalite runs AdamW with bias "
                 "correction (adam_w_mode true, amsgrad false)")


def _warmup(m: DeepSpeedMapping, p: dict, where: str) -> None:
    """The linear warm-up every DeepSpeed Warmup* scheduler starts with (DeepSpeed's default is log-shaped:
    refused, megalite's warm-up is linear)."""
    shape = p.get("warmup_type", "log")
    if shape != "linear":
        m.refuse(f"{where}.warmup_type", f"{shape!r}{' (DeepSpeed default)' if 'warmup_type' not in p else ''}: "
                 "megalite's warm-up is linear; set \"warmup_type\": \"linear\"")
    steps = _number(m, f"{where}.warmup_num_steps", p.get("warmup_num_steps", 1000), int)
    m.set(f"{where}.warmup_num_steps", "lr_warmup_iters", steps, "" if "warmup_num_steps" in p else
          "DeepSpeed's default")
    if p.get("last_batch_iteration", -1) != -1:
        m.refuse(f"{where}.last_batch_iteration", "resume a schedule from megalite's checkpoint (--load) instead")


def _scheduler(m: DeepSpeedMapping, sec: dict | None, lr: float | None) -> None:
    if sec is None:
        m.set("(no scheduler)", "lr_decay_style", "constant", "DeepSpeed applies no schedule: constant rate")
        m.set("(no scheduler)", "lr_warmup_iters", 0)
        return
    kind, where = sec.get("type"), "scheduler.params"
    p = _section(m, where, sec.get("params", {}))
    known = {"warmup_type", "warmup_num_steps", "last_batch_iteration"}
    if kind in ("WarmupLR", "WarmupDecayLR"):
        known |= {"warmup_min_lr", "warmup_max_lr", "total_num_steps"}
        m.set(f"{where}.warmup_max_lr", "lr", _number(m, f"{where}.warmup_max_lr", p.get("warmup_max_lr", 1e-3)),
              "the scheduler's peak replaces optimizer.params.lr")
        low = _number(m, f"{where}.warmup_min_lr", p.get("warmup_min_lr", 0.0))
        m.set(f"{where}.warmup_min_lr", "lr_warmup_init", low)
        if kind == "WarmupDecayLR":
            m.set("scheduler.type", "lr_decay_style", "linear", "WarmupDecayLR: linear decay to warmup_min_lr")
            m.set(f"{where}.warmup_min_lr", "min_lr", low)
            if "total_num_steps" not in p:
                m.refuse(f"{where}.total_num_steps", "WarmupDecayLR needs it")
            m.set(f"{where}.total_num_steps", "lr_decay_iters", _number(m, f"{where}.total_num_steps",
                                                                       p.get("total_num_steps", 1), int))
        else:
            m.set("scheduler.type", "lr_decay_style", "constant", "WarmupLR: constant after warm-up")
    elif kind == "WarmupCosineLR":
        known |= {"total_num_steps", "warmup_min_ratio", "cos_min_ratio"}
        base = lr if lr is not None else 1e-3
        m.set("scheduler.type", "lr_decay_style", "cosine", "DeepSpeed counts the first decay step as 1, megalite "
              "as 0: the cosine is one step later here")
        low = _number(m, f"{where}.warmup_min_ratio", p.get("warmup_min_ratio", 0.0))
        m.set(f"{where}.warmup_min_ratio", "lr_warmup_init", None if low is None else low * base, "x lr")
        end = _number(m, f"{where}.cos_min_ratio", p.get("cos_min_ratio", 1e-4))
        m.set(f"{where}.cos_min_ratio", "min_lr", None if end is None else end * base, "x lr")
        if "total_num_steps" not in p:
            m.refuse(f"{where}.total_num_steps", "WarmupCosineLR needs it")
        m.set(f"{where}.total_num_steps", "lr_decay_iters", _number(m, f"{where}.total_num_steps",
                                                                   p.get("total_num_steps", 1), int))
    else:
        m.refuse("scheduler.type", f"{kind!r}: megalite maps WarmupLR, WarmupDecayLR and WarmupCosineLR")
        return
    _warmup(m, p, where)
    for key in sorted(set(p) - known):
        m.refuse(f"{where}.{key}", f"not a parameter of {kind} megalite knows")


MAX_SCALE_POWER = 64  # 2^64: --initial-loss-scale's bound (MAX_LOSS_SCALE)
MIN_SCALE_POWER = -126  # 2^-126: the least normal fp32 number


def _fp16(m: DeepSpeedMapping, sec: dict) -> None:
    if not sec.get("enabled", False):
        return
    m.set("fp16.enabled", "fp16", True)
    scale = _number(m, "fp16.loss_scale", sec.get("loss_scale", 0))
    if scale:
        m.set("fp16.loss_scale", "loss_scale", scale, "constant scale")
    else:
        m.rows.append(Row("fp16.loss_scale", "(dynamic loss scaling)", "", "0: dynamic"))
    power = _number(m, "fp16.initial_scale_power", sec.get("initial_scale_power", 16), int)
    if power is not None and not MIN_SCALE_POWER <= power <= MAX_SCALE_POWER:  # before 2**power is computed
        m.refuse("fp16.initial_scale_power", f"2^power is the initial loss scale, a normal fp32 number <= 2^"
                 f"{MAX_SCALE_POWER}: expects an integer in [{MIN_SCALE_POWER}, {MAX_SCALE_POWER}], got {power}")
        power = None
    m.set("fp16.initial_scale_power", "initial_loss_scale", None if power is None else float(2**power),
          f"2^{power}" + ("" if "initial_scale_power" in sec else ", DeepSpeed's default"))
    for key, name, default, kind in (("loss_scale_window", "loss_scale_window", 1000, int),
                                     ("hysteresis", "hysteresis", 2, int),
                                     ("min_loss_scale", "min_loss_scale", 1.0, float)):
        m.set(f"fp16.{key}", name, _number(m, f"fp16.{key}", sec.get(key, default), kind),
              "" if key in sec else "DeepSpeed's default")
    for key, value in sec.items():
        if key in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                   "min_loss_scale") or (key, value) in (("consecutive_hysteresis", False), ("auto_cast", False),
                                                         ("fp16_master_weights_and_grads", False)):
            continue
        m.refuse(f"fp16.{key}", f"{value!r} changes when steps are skipped or what is kept in fp16; "
                 "megalite keeps fp32 main params and Megatron's hysteresis")


def _zero(m: DeepSpeedMapping, sec: dict) -> None:
    stage = _number(m, "zero_optimization.stage", sec.get("stage", 0), int)
    if stage == 1:
        m.set("zero_optimization.stage", "use_distributed_optimizer", True, "ZeRO-1: optimizer state sharded")
    elif stage in (2, 3):
        strategy = "optim_grads" if stage == 2 else "optim_grads_params"
        m.set("zero_optimization.stage", "data_parallel_sharding_strategy", strategy, f"ZeRO-{stage}")
    elif stage not in (0, None):
        m.refuse("zero_optimization.stage", f"must be 0-3, got {stage}")
    off = _section(m, "zero_optimization.offload_optimizer", sec.get("offload_optimizer", {}))
    if sec.get("cpu_offload") is True:  # DeepSpeed's older spelling
        off = {"device": "cpu", **off}
    dev = off.get("device", "none")
    if dev == "cpu":
        m.set("zero_optimization.offload_optimizer.device", "optimizer_cpu_offload", True)
        if "ratio" in off:
            m.set("zero_optimization.offload_optimizer.ratio", "optimizer_offload_fraction",
                  _number(m, "zero_optimization.offload_optimizer.ratio", off["ratio"]))
        if "pin_memory" in off:
            m.warn("zero_optimization.offload_optimizer.pin_memory", "megalite pins the host pool wherever the "
                   "build supports it")
    elif dev != "none":
        m.refuse("zero_optimization.offload_optimizer.device", f"{dev!r}: megalite offloads to cpu only")
    for key in set(off) - {"device", "pin_memory", "ratio"}:
        m.warn(f"zero_optimization.offload_optimizer.{key}", "offload tuning")
    _zero_rest(m, sec)


def _zero_rest(m: DeepSpeedMapping, sec: dict) -> None:
    for key, value in sec.items():
        where = f"zero_optimization.{key}"
        if key in ("stage", "offload_optimizer", "cpu_offload"):
            continue
        if key == "overlap_comm":
            if value:
                m.set(where, "overlap_grad_reduce", True, "same math")
        elif key == "reduce_bucket_size":
            m.set(where, "ddp_bucket_size", _number(m, where, value, int), "elements")
        elif key == "offload_param":
            if _section(m, where, value).get("device", "none") != "none":
                m.refuse(where, "parameter offload is not implemented")
        elif key in ZERO_TUNING:
            m.warn(where, "bucket/prefetch/layout tuning (same math)")
        elif key.startswith("zero_quantized") and not value:
            continue
        else:
            m.refuse(where, f"{value!r}: not a ZeRO option megalite can honour")


def _top_level(m: DeepSpeedMapping, key: str, value: Any) -> None:
    if key in BATCH_KEYS:
        n = _number(m, key, value, int)
        if n is not None and n <= 0:
            m.refuse(key, f"must be positive, got {n}")
        elif n is not None:
            m.batch[key] = n
    elif key in ("fp16", "bf16", "bfloat16"):
        sec = _section(m, key, value)
        if key == "fp16":
            _fp16(m, sec)
        elif sec.get("enabled", False):
            m.set(f"{key}.enabled", "bf16", True)
            for extra in set(sec) - {"enabled"}:
                m.warn(f"{key}.{extra}", "bf16 tuning")
    elif key == "gradient_clipping":
        m.set(key, "clip_grad", _number(m, key, value), "0: no clipping")
    elif key == "zero_optimization":
        _zero(m, _section(m, key, value))
    elif key == "pipeline":
        _pipeline(m, _section(m, key, value))
    elif key == "steps_per_print":
        m.set(key, "log_interval", _number(m, key, value, int))
    elif key == "wall_clock_breakdown":
        m.set(key, "timing_log_level", 1 if value else 0, "per-phase timers")
    elif key == "communication_data_type":
        if value == "bf16":
            m.set(key, "grad_reduce_in_bf16", True)
        elif value not in ("fp32", None):
            m.refuse(key, f"{value!r}: megalite reduces gradients in fp32 or bf16")
    elif key in TUNING:
        m.warn(key, TUNING[key])
    elif key in REFUSED:
        m.refuse(key, REFUSED[key])
    elif key not in ("optimizer", "scheduler"):
        m.refuse(key, "a key megalite does not know: it cannot tell whether it changes training")


def _pipeline(m: DeepSpeedMapping, sec: dict) -> None:
    for key, value in sec.items():
        where = f"pipeline.{key}"
        if key == "stages" and value != "auto":
            m.set(where, "pipeline_model_parallel_size", _number(m, where, value, int))
        elif key in ("stages", "partition", "seed_layers", "activation_checkpoint_interval",
                     "pipe_partitioned", "grad_partitioned", "use_reentrant"):
            m.warn(where, "megalite cuts layers evenly over --pipeline-model-parallel-size (same math)")
        else:
            m.refuse(where, f"{value!r}: not a pipeline option megalite knows")


def load_deepspeed_config(path: str) -> DeepSpeedMapping:
    """The mapping of ``path`` (its refused keys in ``refused``: see ``refusal``); raises ConfigFileError
    for a file that is not a readable JSON object or holds "auto" values."""
    text = read_text(FLAG, path)
    try:
        data = load_json(text, path)
    except StrictReadError as e:
        raise ConfigFileError(f"{FLAG} {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"{FLAG}: cannot read {path} as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{FLAG}: {path} must hold a JSON object")
    m = DeepSpeedMapping(path)
    auto = _auto_values(data)
    if auto:
        raise ConfigFileError(f"{FLAG} {path}: {', '.join(auto)} is \"auto\" (filled in by the Hugging Face "
                              "Trainer integration, not by DeepSpeed): give the value")
    for key, value in data.items():
        _top_level(m, key, value)
    opt = data.get("optimizer")
    if opt is not None:
        _optimizer(m, _section(m, "optimizer", opt))
    _scheduler(m, None if "scheduler" not in data else _section(m, "scheduler", data["scheduler"]),
               m.values.get("lr"))
    if "gradient_clipping" not in data:
        m.set("(no gradient_clipping)", "clip_grad", 0.0, "DeepSpeed's default: no clipping")
    return m


def refusal(m: DeepSpeedMapping) -> str | None:
    """The one error naming every key of the file megalite cannot honour (None: all honoured)."""
    return f"{FLAG} {m.path}: cannot honour " + "; ".join(m.refused) if m.refused else None


def resolve_batch(m: DeepSpeedMapping, dp: int) -> dict[str, int]:
    """{micro_batch_size, global_batch_size} from the DeepSpeed batch keys as DeepSpeed resolves them (any
    two give the third; one alone means no accumulation); inconsistent keys are refused, naming them."""
    b = m.batch
    tbs, mbs, gas = (b.get(k) for k in BATCH_KEYS)
    if tbs is None and mbs is None:
        raise ConfigFileError("give train_batch_size or train_micro_batch_size_per_gpu "
                              "(DeepSpeed needs one of them)")
    if tbs is not None and mbs is None:
        mbs = tbs // ((gas or 1) * dp) or 1
    gas = gas if gas is not None else (tbs // (mbs * dp) if tbs is not None else 1) or 1
    tbs = tbs if tbs is not None else mbs * gas * dp
    if tbs != mbs * gas * dp:
        raise ConfigFileError(
            f"train_batch_size ({tbs}) must equal train_micro_batch_size_per_gpu ({mbs}) x "
            f"gradient_accumulation_steps ({gas}) x data-parallel size ({dp}) = {mbs * gas * dp}, as DeepSpeed "
            "requires (a key not in the file is derived from the others)")
    m.rows[:0] = [Row("train_micro_batch_size_per_gpu", "--micro-batch-size", mbs),
                  Row("train_batch_size", "--global-batch-size", tbs,
                      f"micro {mbs} x accumulation {gas} x DP {dp}")]
    return {"micro_batch_size": mbs, "global_batch_size": tbs}
