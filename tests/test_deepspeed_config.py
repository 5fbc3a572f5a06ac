"""--deepspeed-config: a DeepSpeed ds_config.json becomes megalite flags.
- the seed-style config (ZeRO stage 3, optimizer offload to CPU, fp16, AdamW) on 2 ranks through torchrun
  prints the mapping and is refused by name while ZeRO-3 is not in megalite; its stage-1 variant trains,
  with exactly the losses of the equivalent command line;
- a key that cannot be honoured is named (refused when it changes the math, warned when it only tunes);
- inconsistent batch sizes are refused as DeepSpeed refuses them, naming the keys;
- command-line flags win over the file."""

from __future__ import annotations

import copy
import json

import pytest

from megalite.config import parse_args, validate
from tests.cli_utils import launch_pretrain, losses

MODEL = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "6", "--eval-iters", "0"]
SEED = {  # the shape of DeepSpeed's published ZeRO-3 + CPU offload examples
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 1,
    "wall_clock_breakdown": False,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 2, "total_num_steps": 6,
                                                      "warmup_type": "linear"}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": 5000},
}
# The same run spelled in megalite flags (what the mapping prints), for the stage-1 variant.
EQUIVALENT = ("--micro-batch-size 2 --global-batch-size 8 --log-interval 1 --clip-grad 1.0 --lr 3e-3 "
              "--adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --lr-warmup-init 0 "
              "--lr-decay-style linear --min-lr 0 --lr-decay-iters 6 --lr-warmup-iters 2 --fp16 "
              "--initial-loss-scale 4096 --loss-scale-window 1000 --hysteresis 2 --min-loss-scale 1 "
              "--use-distributed-optimizer --optimizer-cpu-offload --overlap-grad-reduce "
              "--ddp-bucket-size 5000").split()


def _write(tmp_path, cfg: dict, name: str = "ds_config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _stage(n: int) -> dict:
    cfg = copy.deepcopy(SEED)
    cfg["zero_optimization"]["stage"] = n
    return cfg


def test_seed_config_on_two_ranks_prints_mapping(tmp_path):
    proc = launch_pretrain([*MODEL, "--deepspeed_config", _write(tmp_path, SEED)], nproc=2)
    out = proc.stdout + proc.stderr
    for row in ["train_batch_size", "--global-batch-size 8", "micro 2 x accumulation 2 x DP 2", "--fp16",
                "--initial-loss-scale 4096.0", "--optimizer-cpu-offload", "--lr-decay-style linear"]:
        assert row in out, f"{row!r} missing from the mapping:\n{out[-3000:]}"
    assert "--data-parallel-sharding-strategy optim_grads_params" in out, out[-3000:]
    curve = losses(proc)  # ZeRO-3 with the optimizer offloaded, fp16: it trains
    assert len(curve) == 6 and all(v[0] == v[0] for v in curve.values())


def test_stage1_variant_trains_as_the_equivalent_flags(tmp_path):
    ds = losses(launch_pretrain([*MODEL, "--deepspeed-config", _write(tmp_path, _stage(1))], nproc=2))
    flags = losses(launch_pretrain([*MODEL, *EQUIVALENT], nproc=2))
    assert len(ds) == 6 and ds == flags  # exactly: same flags, same math


def test_mapping_values_and_command_line_wins(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args([*MODEL, "--deepspeed-config", _write(tmp_path, _stage(1)), "--lr", "1e-3"])
    validate(cfg, 2)
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (2, 8)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.weight_decay == 0.1 and cfg.optimizer.adam_beta2 == 0.95
    assert cfg.precision.fp16 and cfg.precision.initial_loss_scale == 4096.0 and cfg.precision.loss_scale is None
    assert cfg.ddp.use_distributed_optimizer and cfg.ddp.optimizer_cpu_offload and cfg.ddp.ddp_bucket_size == 5000
    out = capsys.readouterr().out
    assert "optimizer.params.lr" in out and "[overridden by the command line]" in out
    assert "zero_optimization.contiguous_gradients" in out  # a tuning key: named, not honoured


def test_deepspeed_defaults_without_scheduler_or_clipping(tmp_path, capsys):
    cfg = parse_args([*MODEL, "--deepspeed-config", _write(tmp_path, {"train_micro_batch_size_per_gpu": 4})])
    assert cfg.optimizer.lr_decay_style == "constant" and cfg.optimizer.clip_grad == 0.0
    assert (cfg.training.micro_batch_size, cfg.training.global_batch_size) == (4, 4)


def test_cosine_and_warmup_lr_schedulers(tmp_path, capsys):
    ds = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50, "warmup_num_steps": 5,
                                                             "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
                                                             "warmup_type": "linear"}}}
    o = parse_args([*MODEL, "--deepspeed-config", _write(tmp_path, ds)]).optimizer
    assert (o.lr_decay_style, o.lr_decay_iters, o.lr_warmup_iters) == ("cosine", 50, 5)
    assert o.lr_warmup_init == pytest.approx(0.001) and o.min_lr == pytest.approx(1e-4)
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.02, "warmup_num_steps": 3,
                                                      "warmup_type": "linear"}}
    o = parse_args([*MODEL, "--deepspeed-config", _write(tmp_path, ds)]).optimizer
    assert (o.lr_decay_style, o.lr, o.lr_warmup_iters) == ("constant", 0.02, 3)


@pytest.mark.parametrize("edit, named", [
    (lambda c: c["optimizer"].update(type="Lamb"), "optimizer.type"),
    (lambda c: c["scheduler"]["params"].pop("warmup_type"), "scheduler.params.warmup_type"),
    (lambda c: c["fp16"].update(consecutive_hysteresis=True), "fp16.consecutive_hysteresis"),
    (lambda c: c["zero_optimization"]["offload_optimizer"].update(device="nvme"), "offload_optimizer.device"),
    (lambda c: c["zero_optimization"].update(offload_param={"device": "cpu"}), "zero_optimization.offload_param"),
    (lambda c: c.update(curriculum_learning={"enabled": True}), "curriculum_learning"),
    (lambda c: c.update(some_future_key=1), "some_future_key"),
    (lambda c: c.update(train_batch_size="auto"), "train_batch_size is \"auto\""),
])
def test_unhonourable_key_is_named(tmp_path, capsys, edit, named):
    cfg = _stage(1)
    edit(cfg)
    with pytest.raises(SystemExit) as e:
        parse_args([*MODEL, "--deepspeed-config", _write(tmp_path, cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "--deepspeed-config" in err


@pytest.mark.parametrize("batch, fragment", [
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     "train_batch_size (10) must equal train_micro_batch_size_per_gpu (2) x gradient_accumulation_steps (2) x "
     "data-parallel size (2) = 8"),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}, "train_batch_size (6)"),
    ({"gradient_accumulation_steps": 2}, "give train_batch_size or train_micro_batch_size_per_gpu"),
])
def test_inconsistent_batch_sizes_refused(tmp_path, capsys, monkeypatch, batch, fragment):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = {k: v for k, v in _stage(1).items() if k not in batch and "batch" not in k and "accumulation" not in k}
    cfg.update(batch)
    with pytest.raises(SystemExit):
        parse_args([*MODEL, "--deepspeed-config", _write(tmp_path, cfg)])
    assert fragment in capsys.readouterr().err
