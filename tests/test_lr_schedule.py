"""The learning rate equals megatron-core's OptimizerParamScheduler as Megatron's loop drives it:
built with the schedule in samples, stepped by the global batch after every successful update, the
rate applied by iteration k read before its step and the rate logged for k read after it. The scheduler's
spans in samples are written out per case as Megatron-LM derives them from the flags, so megalite's own
flag-to-samples conversion is checked too, not repeated."""

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
    """The optimizer surface the scheduler writes to: parameter groups (one by default)."""

    def __init__(self, groups: list[dict] | None = None) -> None:
        self.param_groups = groups or [{}]


def _megatron_groups(cfg) -> list[dict]:
    """The default group and the --decoupled-lr group as megatron-core forms them: each starts with
    max_lr = --lr, min_lr = --min-lr, and the embedding/output group takes the override megatron-core's
    get_standard_config_overrides gives for its is_embedding_or_output_parameter key."""
    from megatron.core.optimizer import OptimizerConfig as McoreConfig
    from megatron.core.optimizer import get_standard_config_overrides

    o = cfg.optimizer
    mc = McoreConfig(lr=o.lr, min_lr=o.min_lr, decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr)
    (override,) = [v for k, v in get_standard_config_overrides(mc).items()
                   if k.attr == "is_embedding_or_output_parameter"]
    base = {"max_lr": o.lr, "min_lr": o.min_lr}
    return [dict(base), {**base, **override}]


def _megatron(cfg, spans: tuple[float, int, int | None], groups: list[dict] | None = None):
    """megatron-core's scheduler built as Megatron-LM's get_optimizer_param_scheduler builds it, with the
    (warm-up, decay, WSD decay) spans in samples that function derives from the case's flags, written out by
    hand per case (not derived by code here, which would repeat megalite's own conversion)."""
    o = cfg.optimizer
    warmup, decay, wsd = spans
    opt = _Groups(groups)
    sched = OptimizerParamScheduler(opt, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
                                    lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=o.lr_decay_style,
                                    start_wd=0.01, end_wd=0.01, wd_incr_steps=decay, wd_incr_style="constant",
                                    wsd_decay_steps=wsd, lr_wsd_decay_style=o.lr_wsd_decay_style)
    return sched, opt


# (flags, Megatron-LM's (warm-up, decay, WSD decay) in samples): iteration flags count GBS = 4 samples each,
# --train-iters 30 (120 samples) unless --train-samples; the decay span defaults to the whole run, a warm-up
# fraction is of the decay span.
CASES = [
    ("--lr-decay-style constant --lr-warmup-iters 5", (20, 120, None)),
    ("--lr-decay-style constant", (0, 120, None)),
    ("--lr-decay-style linear --lr-warmup-iters 5 --min-lr 1e-5", (20, 120, None)),
    ("--lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-5", (20, 120, None)),
    ("--lr-decay-style cosine --lr-warmup-iters 3 --lr-decay-iters 20 --min-lr 1e-5 --lr-warmup-init 1e-5",
     (12, 80, None)),
    ("--lr-decay-style cosine --lr-warmup-fraction 0.1 --lr-decay-iters 25", (10.0, 100, None)),
    ("--lr-decay-style inverse-square-root --lr-warmup-iters 4 --min-lr 1e-6", (16, 120, None)),
    ("--lr-decay-style inverse-square-root --min-lr 1e-6", (0, 120, None)),
    ("--lr-decay-style WSD --lr-warmup-iters 3 --lr-wsd-decay-iters 10 --lr-wsd-decay-style exponential",
     (12, 120, 40)),
    ("--lr-decay-style WSD --lr-wsd-decay-iters 8 --lr-wsd-decay-style linear --min-lr 1e-5", (0, 120, 32)),
    ("--lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 6 --lr-wsd-decay-style cosine", (8, 120, 24)),
    ("--lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 6 --lr-wsd-decay-style minus_sqrt",
     (8, 120, 24)),
    ("--train-samples 120 --lr-decay-style cosine --lr-warmup-samples 10 --min-lr 1e-5", (10, 120, None)),
    ("--train-samples 120 --lr-decay-samples 100 --lr-decay-style linear --lr-warmup-samples 6", (6, 100, None)),
    ("--train-samples 120 --lr-decay-style WSD --lr-warmup-fraction 0.05 --lr-wsd-decay-samples 40", (6.0, 120, 40)),
    ("--train-samples 122 --lr-decay-style inverse-square-root --lr-warmup-samples 9 --min-lr 1e-6",
     (9, 122, None)),
]


@pytest.mark.parametrize("flags,spans", CASES, ids=[c[0] for c in CASES])
def test_applied_and_logged_rate_equal_megatron_core(flags, spans):
    extra = [] if "--train-samples" in flags else ["--train-iters", "30"]
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--lr", "3e-4", "--global-batch-size", str(GBS),
                      "--micro-batch-size", "1", *extra, *flags.split()])
    validate(cfg, GBS)
    ours = schedule_from_config(cfg.optimizer, cfg.training)
    sched, opt = _megatron(cfg, spans)
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


DECOUPLED_CASES = [
    ("--lr-decay-style cosine --lr-warmup-iters 5 --min-lr 1e-5 --decoupled-lr 5e-4 --decoupled-min-lr 4.5e-5",
     (20, 120, None)),
    ("--lr-decay-style linear --lr-warmup-iters 3 --min-lr 1e-5 --decoupled-lr 1e-4",  # final rate: --min-lr
     (12, 120, None)),
    ("--lr-decay-style inverse-square-root --lr-warmup-iters 4 --min-lr 1e-6 --decoupled-lr 6e-4 "
     "--decoupled-min-lr 2e-5", (16, 120, None)),
    ("--lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 6 --lr-wsd-decay-style cosine --decoupled-lr 1e-3 "
     "--decoupled-min-lr 1e-4 --lr-warmup-init 1e-5", (8, 120, 24)),
    ("--lr-decay-style constant --lr-warmup-iters 5 --decoupled-lr 0", (20, 120, None)),
    ("--train-samples 120 --lr-decay-style cosine --lr-warmup-samples 10 --min-lr 1e-5 --decoupled-lr 2e-4 "
     "--decoupled-min-lr 0", (10, 120, None)),
]


@pytest.mark.parametrize("flags,spans", DECOUPLED_CASES, ids=[c[0] for c in DECOUPLED_CASES])
def test_decoupled_group_rate_equals_megatron_core(flags, spans):
    """Two parameter groups, the second with --decoupled-lr/--decoupled-min-lr: at every iteration both the
    applied and the logged rate of each group equal megatron-core's (the log line shows the default group's)."""
    extra = [] if "--train-samples" in flags else ["--train-iters", "30"]
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--lr", "3e-4", "--global-batch-size", str(GBS),
                      "--micro-batch-size", "1", *extra, *flags.split()])
    validate(cfg, GBS)
    ours = schedule_from_config(cfg.optimizer, cfg.training)
    sched, opt = _megatron(cfg, spans, _megatron_groups(cfg))
    skipped, seen = 0, set()
    for k in range(1, cfg.training.train_iters + 1):
        for phase in ("applied", "logged"):
            if phase == "logged":
                if k % 7 != 3:
                    sched.step(increment=GBS)
                else:
                    skipped += 1
            done = k - 1 if phase == "applied" else k
            for decoupled, group in zip((False, True), opt.param_groups):
                got = ours.after(done, skipped, GBS, decoupled=decoupled)
                assert got == pytest.approx(group["lr"], rel=1e-12, abs=1e-15), (k, phase, decoupled, flags)
            seen.add((opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]))
    assert any(a != b for a, b in seen), "the two groups never differed: the test would not see a mix-up"


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
