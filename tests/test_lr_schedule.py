"""The learning rate equals megatron-core's OptimizerParamScheduler as Megatron's loop drives it:
built with the schedule in samples, stepped by the global batch after every successful update, the
rate applied by iteration k read before its step and the rate logged for k read after it."""

from __future__ import annotations

import warnings

import pytest

from megalite.config import parse_args, validate
from megalite.optimizer.lr_schedule import schedule_from_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

GBS = 4


class _Groups:
    """The optimizer surface the scheduler writes to: one parameter group."""

    def __init__(self) -> None:
        self.param_groups = [{}]


def _megatron(cfg):
    """megatron-core's scheduler built as Megatron-LM's get_optimizer_param_scheduler builds it."""
    o, t = cfg.optimizer, cfg.training
    if t.train_samples is None:
        decay = (o.lr_decay_iters or t.train_iters) * GBS
        wsd = o.lr_wsd_decay_iters * GBS if o.lr_wsd_decay_iters is not None else None
        warmup = o.lr_warmup_iters * GBS
    else:
        decay = o.lr_decay_samples or t.train_samples
        wsd = o.lr_wsd_decay_samples
        warmup = o.lr_warmup_samples
    if o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    opt = _Groups()
    sched = OptimizerParamScheduler(opt, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
                                    lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=o.lr_decay_style,
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=decay, wd_incr_style="constant",
                                    wsd_decay_steps=wsd, lr_wsd_decay_style=o.lr_wsd_decay_style)
    return sched, opt


CASES = [
    "--lr-decay-style constant --lr-warmup-iters 5",
    "--lr-decay-style constant",
    "--lr-decay-style linear --lr-warmup-iters 5 --min-lr 1e-5",
    "--lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-5",
    "--lr-decay-style cosine --lr-warmup-iters 3 --lr-decay-iters 20 --min-lr 1e-5 --lr-warmup-init 1e-5",
    "--lr-decay-style cosine --lr-warmup-fraction 0.1 --lr-decay-iters 25",
    "--lr-decay-style inverse-square-root --lr-warmup-iters 4 --min-lr 1e-6",
    "--lr-decay-style inverse-square-root --min-lr 1e-6",
    "--lr-decay-style WSD --lr-warmup-iters 3 --lr-wsd-decay-iters 10 --lr-wsd-decay-style exponential",
    "--lr-decay-style WSD --lr-wsd-decay-iters 8 --lr-wsd-decay-style linear --min-lr 1e-5",
    "--lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 6 --lr-wsd-decay-style cosine",
    "--lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 6 --lr-wsd-decay-style minus_sqrt",
    "--train-samples 120 --lr-decay-style cosine --lr-warmup-samples 10 --min-lr 1e-5",
    "--train-samples 120 --lr-decay-samples 100 --lr-decay-style linear --lr-warmup-samples 6",
    "--train-samples 120 --lr-decay-style WSD --lr-warmup-fraction 0.05 --lr-wsd-decay-samples 40",
    "--train-samples 122 --lr-decay-style inverse-square-root --lr-warmup-samples 9 --min-lr 1e-6",
]


@pytest.mark.parametrize("flags", CASES)
def test_applied_and_logged_rate_equal_megatron_core(flags):
    extra = [] if "--train-samples" in flags else ["--train-iters", "30"]
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--lr", "3e-4", "--global-batch-size", str(GBS),
                      "--micro-batch-size", "1", *extra, *flags.split()])
    validate(cfg, GBS)
    ours = schedule_from_config(cfg.optimizer, cfg.training)
    sched, opt = _megatron(cfg)
    skipped = 0
    for k in range(1, cfg.training.train_iters + 1):
        applied = opt.param_groups[0]["lr"]  # what Megatron's optimizer.step() uses at iteration k
        assert ours.after(k - 1, skipped, GBS) == pytest.approx(applied, rel=1e-12, abs=1e-15), (k, flags)
        update_successful = k % 7 != 3  # an fp16 overflow now and then: the scheduler does not step
        if update_successful:
            sched.step(increment=GBS)
        else:
            skipped += 1
        logged = opt.param_groups[0]["lr"]  # Megatron's log line for iteration k
        assert ours.after(k, skipped, GBS) == pytest.approx(logged, rel=1e-12, abs=1e-15), (k, flags)


def test_warmup_reaches_lr_one_iteration_later_and_then_decays():
    """The issue's example: with 5 warm-up iterations, iteration 1 applies 0, iteration 6 applies --lr
    and iteration 7 already a decayed rate."""
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--lr", "1e-3", "--lr-warmup-iters", "5",
                      "--train-iters", "20"])
    validate(cfg, 1)
    s, g = schedule_from_config(cfg.optimizer, cfg.training), cfg.training.global_batch_size
    applied = [s.after(k - 1, 0, g) for k in range(1, 8)]
    assert applied[0] == 0.0 and applied[4] == pytest.approx(0.8e-3) and applied[5] == 1e-3
    assert applied[6] < 1e-3


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
def test_warmup_longer_than_decay_warms_up_then_drops(style):
    """Accepted (a shortened example run): warm-up as usual, then --min-lr (--lr when constant)."""
    from megalite.optimizer.lr_schedule import LRSchedule

    s = LRSchedule(1e-3, 1e-4, warmup_steps=8, decay_steps=4, style=style)
    assert [s.at(n) for n in (0, 4, 8)] == pytest.approx([0.0, 5e-4, 1e-3])
    assert s.at(9) == (1e-3 if style == "constant" else 1e-4)
